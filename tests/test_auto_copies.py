"""``schedule="auto"`` on pipeline copies (4 processes, ``stages=2``: 2 copies of 2 workers): a switch
to a family whose own shape for ``stages=2`` is another (Rahimi's ``ddp``: one copy of 4 workers;
interleaved 1F1B: 4 copies of 1) runs on the copies the search priced it on; the switch carries the
buffers no state dict holds (Qwen2's rotary ``inv_freq``, needed by a rank that held no stage of it
before); and a run resumed from the last checkpoint written during the fit chooses and calibrates
from its own first steps (its executor counts on from the checkpoint's step: the calibration read
it as steps of this fit, and took the median of none). Every rank ends with the same model: the copies train in
step, as one synchronous pipeline fed both copies' rows."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.schedule import StageCosts
from lightning_pipe.strategy.choosing import Chosen
from lightning_pipe.strategy.trials import Trial
from tests.lightning_cases import assert_states_close, final_state, trainer
from tests.test_model_zoo import ROWS, VOCAB, ZooModule

SWITCH_TO = ("ddp", "interleaved")
STEPS = 40


class _Switching(PipelineStrategy):
    """Tries at the calibration the best ``ddp`` and interleaved configurations, whatever the
    prediction says."""

    def _to_try(self, compute: StageCosts, in_run: StageCosts, since: int) -> Any:
        super()._to_try(compute, in_run, since)
        picked = [next(c for c in self.candidates if c.family == family) for family in SWITCH_TO]
        return [Trial(c.stage_plan, Chosen.of(c, self.schedule_options), c.label) for c in picked]


def _data() -> DataLoader:
    ids = torch.randint(1, VOCAB, (2 * (STEPS + 24) * ROWS, 8), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=ROWS)


def _worker(rank: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    module = ZooModule("qwen2")
    strategy = _Switching("auto", stages=2, microbatches="auto", profile_cache=False)
    saves = ModelCheckpoint(dirpath=f"{root}/checkpoints", every_n_train_steps=10, save_last=True)
    run = trainer(f"{root}/fit", strategy, 4, max_steps=STEPS, callbacks=[saves], enable_checkpointing=True)
    run.fit(module, _data())
    tried = [t.chosen.schedule.family for t in strategy.trials.measured]
    fitted = final_state(run, module)
    resumed = ZooModule("qwen2")
    again = trainer(f"{root}/resumed", PipelineStrategy("auto", stages=2, microbatches="auto"), 4, max_steps=STEPS + 12)
    again.fit(resumed, _data(), ckpt_path=f"{root}/checkpoints/last.ckpt")
    return {
        "tried": tried,
        "copies": strategy.data_parallel,
        "fitted": fitted,
        "steps": (run.global_step, again.global_step),
        "resumed": final_state(again, resumed),
        "calibrated": again.strategy.calibration is not None,
    }


@pytest.mark.timeout(400)
def test_auto_switches_on_pipeline_copies_and_resumes(tmp_path: Path) -> None:
    per_rank = run_local(_worker, 4, str(tmp_path), timeout=380)
    assert per_rank[0]["calibrated"]  # rank 0's: the resumed run calibrated after its own first steps
    for got in per_rank:
        assert set(SWITCH_TO) <= set(got["tried"]), got["tried"]
        assert got["copies"] == 2
        assert got["steps"] == (STEPS, STEPS + 12)
        assert_states_close(got["fitted"], per_rank[0]["fitted"], 0.0)
        assert_states_close(got["resumed"], per_rank[0]["resumed"], 0.0)
