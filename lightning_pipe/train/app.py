"""The job ``lightning-pipe-train`` runs: fit the configured model on the configured data with the
pipeline strategy, test it, and leave in Hydra's run directory everything the run decided and
measured:

- ``.hydra/config.yaml`` (the composed configuration; Hydra writes it) and ``overrides.yaml``;
- ``plan.txt`` (the plan table and the prediction the strategy printed) and ``plan.json``
  (reusable with ``pipeline.plan=<path>``);
- ``metrics.csv`` (and TensorBoard events with ``logger=tensorboard``; in a multirun, whose runs
  start their processes anew for the test, the test's metrics go to ``test/metrics.csv``: a test in
  new processes starts a fresh CSV writer, which would rewrite ``metrics.csv`` with the test's columns
  only), ``pipeline_timeline.png``
  (measured timeline beside the predictions) and ``pipeline_trace.json`` (with ``logger=none``, in
  ``pipeline_logs/version_0/``: the strategy's directory for a run without a logger);
- ``results.json``: the test metrics, the predicted and measured step times.

With no arguments it runs the README's main job: a 2-stage 1F1B pipeline on 2 CPU processes training
a small MLP on scikit-learn's handwritten digits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from lightning_pipe.errors import PlanningError
from lightning_pipe.planning import setup_report
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.train import build
from lightning_pipe.train.config import register_configs

__all__ = ["main", "run"]

register_configs()


def run(cfg: DictConfig, directory: Path, multirun: bool = False) -> dict[str, Any]:
    """Fit and test as ``cfg`` says, writing into ``directory``; the test metrics (rank 0's)."""
    build.check(cfg)
    L.seed_everything(cfg.seed, workers=True)
    data = build.data_module(cfg)
    module = build.model(cfg, data)
    trainer = build.trainer(cfg, directory, multirun)
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    metrics: dict[str, Any] = {}
    if cfg.test:
        if multirun and trainer.loggers:  # new processes: keep the fit's metrics.csv as it is
            trainer.loggers = build.logger_list(cfg, directory / "test")
        (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    if trainer.global_rank == 0:
        metrics = {key: float(value) for key, value in metrics.items()}
        _write_results(trainer, directory, metrics)
    floor = cfg.min_test_accuracy
    if floor is not None and not metrics.get("test_acc", -math.inf) >= floor:
        raise PlanningError(f"test accuracy {metrics.get('test_acc')} is below min_test_accuracy={floor}")
    return metrics


def _write_results(trainer: L.Trainer, directory: Path, metrics: dict[str, float]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    strategy = trainer.strategy
    results: dict[str, Any] = {"test": metrics}
    if isinstance(strategy, PipelineStrategy) and strategy.stage_plan is not None:
        prediction = strategy.prediction
        (directory / "plan.txt").write_text(setup_report(strategy.stage_plan, prediction) + "\n")
        (directory / "plan.json").write_text(json.dumps(strategy.stage_plan.to_dict(), indent=1) + "\n")
        results["predicted_step_seconds"] = None if prediction is None else prediction.steady_step
        results["measured_step_seconds"] = strategy.measured_step_seconds
    (directory / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    rank_zero_info(f"results: {json.dumps(metrics)}; run directory {directory}")


@hydra.main(version_base="1.3", config_path="pkg://lightning_pipe.conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """``lightning-pipe-train [group=option ...] [key=value ...]`` (Hydra's command line)."""
    hydra_config = HydraConfig.get()
    metrics = run(cfg, Path(hydra_config.runtime.output_dir), hydra_config.mode == RunMode.MULTIRUN)
    return metrics.get("test_acc")
