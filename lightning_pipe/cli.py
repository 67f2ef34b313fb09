"""``lightning-pipe``: the command line.

``lightning-pipe plan`` profiles a built-in model (or loads a profile) and prints a partition plan
as a table in the spirit of the Black GPipe ``dp>`` console, or as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from lightning_pipe.costs import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.memory import EXTRA_COPIES, SCHEDULES, MemoryModel
from lightning_pipe.network import Network
from lightning_pipe.partition import PARTITIONERS, Plan, PlanRequest, partition
from lightning_pipe.profile_file import load_profile, save_profile
from lightning_pipe.units import format_bytes, format_seconds, parse_bandwidth, parse_bytes

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _argument(parse: Callable[[str], float]) -> Callable[[str], float]:
    """Turn a parser's PlanningError into argparse's own message format."""

    def parse_argument(text: str) -> float:
        try:
            return parse(text)
        except PlanningError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse_argument.__name__ = parse.__name__
    return parse_argument


def _plan_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="profile a model (or load a profile) and split it into pipeline stages",
        description="Profile a model or load a profile, then print the partition plan.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="a lightning_pipe JSON profile or a PipeDream graph.txt")
    source.add_argument("--model", help="a built-in torchvision model to profile (vgg16, resnet50, ...)")
    parser.add_argument(
        "--input-shape",
        type=_positive_int,
        nargs="+",
        default=[3, 224, 224],
        metavar="N",
        help="shape of one sample for --model (default: 3 224 224)",
    )
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="micro-batch size for --model (default: 8)")
    parser.add_argument("--num-classes", type=_positive_int, default=1000)
    parser.add_argument("--device", default="cpu", help="device to profile on (default: cpu)")
    parser.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per layer (median)")
    parser.add_argument("--save-profile", metavar="FILE", help="write the profile as JSON")
    parser.add_argument("--devices", type=_positive_int, required=True, help="devices to split over")
    parser.add_argument("--partitioner", default="pipedream", choices=sorted(PARTITIONERS))
    parser.add_argument("--straight", action="store_true", help="one device per stage (no replication)")
    parser.add_argument("--memory-limit", type=_argument(parse_bytes), help="bytes per device, e.g. 16GB or 12GiB")
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=SCHEDULES,
        help="schedule whose in-flight activations the memory model counts (default: 1f1b)",
    )
    parser.add_argument(
        "--microbatches", type=_positive_int, help="micro-batches per step (default: the number of devices)"
    )
    parser.add_argument(
        "--optimizer",
        default="momentum",
        choices=sorted(EXTRA_COPIES),
        help="optimizer whose state counts towards memory (default: momentum)",
    )
    parser.add_argument(
        "--bandwidth",
        type=_argument(parse_bandwidth),
        default=float("inf"),
        help="link bandwidth, e.g. 10GB/s (default: free communication)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=_run_plan)


def _profile_model(args: argparse.Namespace) -> ChainCosts:
    import torch

    from lightning_pipe.models import torchvision_chain
    from lightning_pipe.profiler import profile_layers

    model = torchvision_chain(args.model, num_classes=args.num_classes)
    sample = torch.randn(args.batch_size, *args.input_shape)
    return profile_layers(model, sample, device=args.device, repeats=args.repeats, name=args.model)


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _table(costs: ChainCosts, plan: Plan) -> str:
    memory = plan.memory
    limit = "none" if plan.memory_limit is None else format_bytes(plan.memory_limit)
    bandwidth = "free" if plan.network.free else f"{format_bytes(plan.network.bandwidth)}/s"
    lines = [
        f"Profile: {costs.name} ({len(costs)} layers)",
        *[f"  note: {note}" for note in plan.notes],
        f"===== Partition ({plan.partitioner}) =====",
        f"# of layers : {len(costs)}",
        f"# of devices: {plan.devices} ({plan.devices_used} used)",
        f"schedule {memory.schedule}, {memory.microbatches or 'unbounded'} micro-batches, "
        f"memory limit {limit}, bandwidth {bandwidth}",
        f"{'stage':>5} {'layers':>14} {'reps':>4} {'cost':>11} {'compute':>11} {'memory':>11}  first .. last layer",
    ]
    for index, stage in enumerate(plan.stages):
        layers = stage.layers_json()
        span = f"{layers[0]} -> {layers[1]}" if stage.contiguous else ",".join(map(str, layers))
        names = f"{_short(costs.layers[stage.layers[0]].name)} .. {_short(costs.layers[stage.layers[-1]].name)}"
        lines.append(
            f"{index:>5} {span:>14} {stage.replicas:>4} {format_seconds(stage.stage_seconds):>11} "
            f"{format_seconds(stage.compute_seconds):>11} {format_bytes(stage.memory_bytes):>11}  {names}"
        )
    if plan.cut_seconds and not plan.network.free:
        lines.append("cut transfers (2·C): " + ", ".join(format_seconds(c) for c in plan.cut_seconds))
    lines.append(f"Pipeline bottleneck cost: {format_seconds(plan.bottleneck_seconds)} per micro-batch")
    return "\n".join(lines)


def _run_plan(args: argparse.Namespace) -> int:
    costs = load_profile(args.profile) if args.profile else _profile_model(args)
    if args.save_profile:
        save_profile(costs, args.save_profile)
    memory = MemoryModel(
        schedule=args.schedule,
        microbatches=args.microbatches or args.devices,
        extra_copies=EXTRA_COPIES[args.optimizer],
    )
    request = PlanRequest(
        costs,
        devices=args.devices,
        memory_limit=args.memory_limit,
        memory=memory,
        network=Network(args.bandwidth),
        straight=args.straight,
    )
    plan = partition(request, args.partitioner)
    if args.json:
        print(json.dumps({"profile": costs.name, "layers": len(costs), **plan.to_dict()}, indent=1))
    else:
        print(_table(costs, plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-pipe``."""
    parser = argparse.ArgumentParser(prog="lightning-pipe", description="Pipeline-parallel planning and training.")
    commands = parser.add_subparsers(dest="command", required=True)
    _plan_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except PlanningError as error:
        print(f"lightning-pipe {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
