"""Recipe 4 — PipeDream (Narayanan et al. 2019) and PipeDream-2BW (Narayanan et al. 2021): the
optimizer's plans for PipeDream's own profiles, and its update rules against synchronous training.

    python recipes/pipedream/run.py --size smoke     # plans + 1 seed x 2 epochs per rule (CI)
    python recipes/pipedream/run.py --size reduced   # plans + 3 seeds x 20 epochs per rule on the digits

1. Plans. For every ``graph.txt`` profile PipeDream ships (``tests/data/pipedream-profiles``), the
   ``pipedream`` partitioner (the dynamic program of §3.1, with stage replication) on 4, 8 and 16
   workers linked at 10 Gbit/s: the configuration (workers per stage, PipeDream's "15-1" notation),
   the slowest stage's time per micro-batch, and the speed-up over one worker and over data
   parallelism on the same workers (all layers replicated, gradients all-reduced), as PipeDream's
   comparison reads. ``plans.md``.
2. Rules. ``experiment=pipedream_digits`` with ``update_rule=sync,stash,vertical,2bw`` over seeds:
   test accuracy per rule (``accuracy.md``, ``accuracy.png``): the papers' claim is that weight
   stashing, vertical sync and 2BW reach the accuracy of synchronous training.
"""

from __future__ import annotations

from pathlib import Path

from lightning_pipe.cost.network import Network
from lightning_pipe.cost.profile_file import load_profile
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.train.recipe import output_directory, sized_parser
from lightning_pipe.train.sweep import compare

PROFILES = Path(__file__).resolve().parents[2] / "tests" / "data" / "pipedream-profiles"
RULES = ("sync", "stash", "vertical", "2bw")
WORKERS = (4, 8, 16)
BANDWIDTH = 10e9 / 8  # 10 Gbit/s, PipeDream's slower cluster
SIZES = {
    "smoke": {"seeds": [0], "overrides": ["trainer.max_epochs=2"]},
    "reduced": {"seeds": [0, 1, 2], "overrides": []},
}


def plans() -> str:
    lines = [
        "`python recipes/pipedream/run.py`: the pipedream partitioner on PipeDream's profiles, 10 Gbit/s links.",
        "",
        "| profile | layers | workers | configuration | stages | slowest stage (ms) | vs 1 worker | vs data parallel |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for directory in sorted(path for path in PROFILES.iterdir() if path.is_dir()):
        costs = load_profile(directory / "graph.txt")
        alone = sum(layer.seconds for layer in costs.layers)
        for workers in WORKERS:
            request = PlanRequest(costs, workers, network=Network(BANDWIDTH))
            plan = partition(request, "pipedream")
            data_parallel = request.plan_unchecked("data parallel", [list(range(len(costs)))], [workers])
            configuration = "-".join(str(stage.replicas) for stage in plan.stages)
            lines.append(
                f"| {directory.name} | {len(costs)} | {workers} | {configuration} | {len(plan.stages)} "
                f"| {plan.bottleneck_seconds * 1e3:.2f} | {alone / plan.bottleneck_seconds:.1f}x "
                f"| {data_parallel.bottleneck_seconds / plan.bottleneck_seconds:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = sized_parser(__doc__, SIZES)
    parser.add_argument("--plans-only", action="store_true", help="only the plans (a second)")
    args = parser.parse_args(argv)
    output = output_directory(args, __file__)
    (output / "plans.md").write_text(plans())
    print((output / "plans.md").read_text())
    if args.plans_only:
        return
    size = SIZES[args.size]
    heading = f"`python recipes/pipedream/run.py --size {args.size}`: test accuracy (%) per update rule."
    title = "PipeDream's rules vs synchronous"
    print(compare("pipedream_digits", RULES, size["seeds"], size["overrides"], output, "accuracy.md", heading, title))


if __name__ == "__main__":
    main()
