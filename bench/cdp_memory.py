"""Activation memory per worker, DP against CDP: what the runtime measures against what the simulator
predicts (Fournier & Oyallon 2024, §4.1-4.2; :mod:`lightning_pipe.train.cyclic_memory`).

    python bench/cdp_memory.py                          # three models, small and large micro-batches
    python bench/cdp_memory.py --models mlp --rows 4 64 --workers 2 4 8

For each model, micro-batch size and N: the model cut into N stages, trained for 8 steps of N
micro-batches on one device (DP: together; CDP-v2: in the cyclic order) and on N processes (DP: all
at once; CDP-v2: each two time steps after the previous), the bytes autograd saves counted after
every action; the peak per worker (the workers' sum over N) for DP and CDP, their ratio as measured
and as the simulator predicts it from the profiled stage costs and from the costs the runs measured
(their actions' mean durations), and the differences in points. The paper's ideal ``(N + 1) / 2N``
is beside them. CDP's replicas start 1/N of a pass apart, by the profiled durations.

On ``processes`` the figure depends on when the workers' peaks meet, so on the actions' durations: a
profile taken alone misses what the run adds (the executor's own time, message latency), which the
run's costs hold; and on the jitter of the actions and of the executor's time between them, where
two peaks meet by a millisecond or less: a training run's peak is its worst step's, so each run
takes several steps. Rows with more processes than cores are marked: the replicas then share cores
and do not run at once as the simulator (and the paper) has them.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torchvision

from lightning_pipe.train.cyclic_memory import SETTINGS, measure, plan_split
from lightning_pipe.zoo.models import mlp_chain

_SMALL_VIT = {"image_size": 32, "patch_size": 8, "num_layers": 4, "num_heads": 4, "hidden_dim": 64, "mlp_dim": 128}
MODELS = {  # builders are partials of module classes: they go to other processes
    "mlp": (functools.partial(mlp_chain, (3, 32, 32), 10, width=1024, depth=8), (3, 32, 32)),
    "resnet18": (functools.partial(torchvision.models.resnet18, num_classes=10), (3, 32, 32)),
    "vit_tiny": (functools.partial(torchvision.models.VisionTransformer, **_SMALL_VIT, num_classes=10), (3, 32, 32)),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 32], help="samples per micro-batch")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="N")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=8, help="steps of each run (the peak is over all of them)")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    print(
        "| model | rows | setting | N | DP peak (MiB) | CDP peak (MiB) | CDP/DP measured | simulated | points | "
        "simulated, run's costs | points | ideal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        build, shape = MODELS[name]
        for rows in args.rows:
            microbatch = torch.randn(rows, *shape)
            for workers in args.workers:
                split = plan_split(build, microbatch, workers)
                for setting in args.settings:
                    result = measure(build, microbatch, 10, setting, workers, split, steps=args.steps)
                    measured, simulated = result.ratio("measured"), result.ratio("predicted")
                    calibrated = result.ratio("calibrated")
                    dp, cdp = (result.measured[kind] / 2**20 for kind in ("dp", "cdp"))
                    shared = setting == "processes" and workers > cores
                    print(
                        f"| {name} | {rows} | {setting}{f' ({cores} cores)' if shared else ''} | {workers} | {dp:.2f} "
                        f"| {cdp:.2f} | {measured:.3f} | {simulated:.3f} | {100 * (measured - simulated):+.1f} | "
                        f"{calibrated:.3f} | {100 * (measured - calibrated):+.1f} | {result.ideal:.3f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
