"""Recipe 1 — CDP (Fournier & Oyallon 2024), Table 2: the test accuracy of the synchronous baseline
(``sync``: the data-parallel update), CDP-v1 and CDP-v2, over seeds, with mean and spread.

    python recipes/cdp_table2/run.py --size smoke     # 1 seed, 2 epochs on the digits (CI)
    python recipes/cdp_table2/run.py --size reduced   # 5 seeds x 20 epochs on the digits, 2 CPUs
    python recipes/cdp_table2/run.py --size reduced_resnet   # CIFAR ResNet-18, 3 seeds x 20 epochs
    python recipes/cdp_table2/run.py --size full --experiment cdp_resnet18_cifar10 data.root=/data/cifar10

Each size runs one Hydra multirun of ``lightning-pipe-train`` over ``update_rule`` x ``seed`` (two or
more processes per run, spawned), then reads every run's ``results.json`` and writes into
``--output`` (default ``recipes/cdp_table2/results/<size>``): ``table.md`` (per rule: runs, mean and
standard deviation of the test accuracy, each seed's value, and the paper's figure where the
experiment is one of Table 2's) and ``accuracy.png`` (mean and each seed per rule).
"""

from __future__ import annotations

import sys

from lightning_pipe.train.recipe import output_directory, sized_parser
from lightning_pipe.train.sweep import compare

RULES = ("sync", "cdp_v1", "cdp_v2")
PAPER = {  # Table 2, top-1 %: (cdp_v1, cdp_v2, dp)
    "cdp_resnet18_cifar10": (94.1, 94.8, 94.7),
    "cdp_resnet50_cifar10": (94.0, 94.5, 94.5),
    "cdp_resnet18_imagenet": (69.9, 70.0, 70.1),
    "cdp_resnet50_imagenet": (75.8, 75.7, 75.4),
}
SIZES = {
    "smoke": {"experiment": "cdp_digits", "seeds": [0], "overrides": ["trainer.max_epochs=2"]},
    "reduced": {"experiment": "cdp_digits", "seeds": [0, 1, 2, 3, 4], "overrides": []},
    "reduced_resnet": {"experiment": "cdp_resnet18_digits", "seeds": [0, 1, 2], "overrides": []},
    "full": {"experiment": "cdp_resnet18_cifar10", "seeds": [0, 1, 2], "overrides": []},
}


def main(argv: list[str] | None = None) -> None:
    parser = sized_parser(__doc__, SIZES)
    parser.add_argument("--experiment", help="a Hydra experiment (default: the size's)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. data.root=/data/cifar10")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    experiment = args.experiment or size["experiment"]
    output = output_directory(args, __file__)
    command = "python recipes/cdp_table2/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    paper = dict(zip(("cdp_v1", "cdp_v2", "sync"), PAPER.get(experiment, ()), strict=False))
    heading = f"`{command.strip()}` (experiment `{experiment}`): test accuracy (%) per update rule."
    overrides = [*size["overrides"], *args.overrides]
    title = "synchronous vs CDP-v1 vs CDP-v2"
    print(compare(experiment, RULES, size["seeds"], overrides, output, "table.md", heading, title, paper))


if __name__ == "__main__":
    main()
