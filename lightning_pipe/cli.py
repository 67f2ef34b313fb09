"""``lightning-pipe``: the command line.

``lightning-pipe plan`` profiles a built-in model (or loads a profile) and prints a partition plan
as a table in the spirit of the Black GPipe ``dp>`` console, or as JSON. ``lightning-pipe simulate``
generates a schedule, validates and simulates it, and draws it. ``lightning-pipe consolidate`` turns a
sharded checkpoint into one Lightning checkpoint file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_pipe.cost.memory import EXTRA_COPIES, SCHEDULES, MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.profile_file import load_profile, save_profile
from lightning_pipe.cost.profiler import given_names
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import CheckpointError, PipelineRuntimeError, PlanningError
from lightning_pipe.partition import PARTITIONERS, PlanRequest, partition
from lightning_pipe.partition.plan_file import load_plan
from lightning_pipe.schedule.cyclic import FORMS
from lightning_pipe.tables import plan_table, simulation_table
from lightning_pipe.util.files import read_json
from lightning_pipe.util.units import parse_bandwidth, parse_bytes

__all__ = ["main"]


def _whole_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _whole_at_least(1)
_whole = _whole_at_least(0)


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
    source.add_argument(
        "--model",
        help="a built-in torchvision model (vgg16, resnet50, ...) or your module as package.module:Class (its "
        "forward is captured as layers, fed its example_input_array, else the first batch of its "
        "train_dataloader(), else --input-shape)",
    )
    parser.add_argument("--init", metavar="JSON", help="keyword arguments of --model's class, as JSON")
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
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="splits within this fraction of the fastest are ties, decided by the least memory, then the fewest "
        "FLOPs in the largest stage (the strategy uses 0.02: timing jitter moves the split less often); default 0: "
        "the fastest as measured",
    )
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
    parser.add_argument(
        "--auto",
        action="store_true",
        help="rank every split x schedule (gpipe, 1f1b, zb_h1, interleaved, 1f1b_rr, ddp) x micro-batches "
        "(2, 4, 8) x per-stage recomputation by predicted time per mini-batch within --memory-limit, as "
        "schedule='auto' chooses; the profile is one micro-batch of a mini-batch split into --microbatches "
        "(default: the devices)",
    )
    parser.add_argument(
        "--rule",
        default=None,
        help="with --auto, the update rules allowed: sync (default: the flushing schedules), 'delayed' (also "
        "pipedream, 2bw and cdp, each with its own rule) or one delayed rule (2bw, stash, vertical, cdp_v1, cdp_v2)",
    )
    parser.add_argument("--top", type=_positive_int, default=5, help="with --auto, the candidates shown (default: 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=_run_plan)


def _profile_model(args: argparse.Namespace) -> ChainCosts:
    import torch

    from lightning_pipe.cost.profiler import profile_layers
    from lightning_pipe.zoo.models import torchvision_chain

    if ":" in args.model:
        return _profile_module(args)
    model = torchvision_chain(args.model, num_classes=args.num_classes)
    sample = torch.randn(args.batch_size, *args.input_shape)
    return profile_layers(model, sample, device=args.device, repeats=args.repeats, name=args.model)


def _profile_module(args: argparse.Namespace) -> ChainCosts:
    """A user's module (``package.module:Class``): forward captured on a sample micro-batch, its layers
    and cuts printed, each layer profiled."""
    import importlib

    from lightning_pipe.capture.describe import describe
    from lightning_pipe.cost.profiler import profile_layers
    from lightning_pipe.strategy.contract import pipeline_model

    path, _, name = args.model.partition(":")
    try:
        cls = getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError) as error:
        raise PlanningError(f"cannot import {args.model}: {error}") from None
    try:
        options = json.loads(args.init) if args.init else {}
    except json.JSONDecodeError as error:
        raise PlanningError(f"--init is not JSON: {error}") from None
    module = cls(**options).to(args.device)
    call = _sample_call(module, args)
    model = pipeline_model(module, call, args.devices)
    out = sys.stderr if args.json else sys.stdout

    def profile() -> ChainCosts:
        sample = model.inputs(call)
        return profile_layers(
            model.layers, sample, device=args.device, repeats=args.repeats, name=name, layer_names=model.names
        )

    costs = profile()
    order = model.order_for(costs, args.devices) if model.branches() else None
    if order is not None:  # as the strategy runs them (.capture.layer_order)
        model = model.reordered(order)
        print(f"The layers branch; they run in the order whose split is fastest: {', '.join(model.names)}", file=out)
        costs = profile()
    if model.captured is not None:
        print(describe(model.captured), file=out)
    return costs


def _sample_call(module: Any, args: argparse.Namespace) -> Any:
    """The arguments of one forward: the module's ``example_input_array``, else the first batch of its
    ``train_dataloader()`` as its ``training_step`` passes it on, else a random ``--input-shape``."""
    import torch

    from lightning_pipe.strategy.contract import Call, Entry
    from lightning_pipe.util.nested import map_tensors

    def on_device(value: Any) -> Any:
        return map_tensors(lambda t: t.to(args.device), value)

    example = getattr(module, "example_input_array", None)
    if example is not None:
        if isinstance(example, dict):
            return Call((), on_device(example))
        return Call(on_device(example) if isinstance(example, tuple) else (on_device(example),))
    loader = getattr(module, "train_dataloader", None)
    if callable(loader) and hasattr(module, "training_step"):
        try:
            batch = next(iter(loader()))
        except Exception:  # a module without data of its own: fall back to --input-shape
            batch = None
        if batch is not None:
            return Entry(module).capture(module.training_step, on_device(batch), 0)
    return Call((torch.randn(args.batch_size, *args.input_shape, device=args.device),))


def _run_plan(args: argparse.Namespace) -> int:
    costs = load_profile(args.profile) if args.profile else _profile_model(args)
    if args.save_profile:
        save_profile(costs, args.save_profile)
    if args.auto:
        return _run_auto(args, costs)
    if args.rule is not None:
        raise PlanningError("--rule chooses the rules --auto's search may pick: give --auto too")
    memory = MemoryModel(
        schedule=args.schedule,
        microbatches=args.microbatches or args.devices,
        extra_copies=EXTRA_COPIES[args.optimizer],
        split_backward=args.schedule in ("1f1b", "gpipe"),  # the runtime's early cool-down gradients
        accumulation=True,
    )
    request = PlanRequest(
        costs,
        devices=args.devices,
        memory_limit=args.memory_limit,
        memory=memory,
        network=Network(args.bandwidth),
        straight=args.straight,
        tolerance=args.tolerance,
    )
    plan = partition(request, args.partitioner)
    if args.json:
        names = given_names(costs)
        model = {"layers": len(costs)} if names is None else {"layers": len(costs), "layer_names": names}
        print(json.dumps({"profile": costs.name, **model, **plan.to_dict()}, indent=1))
    else:
        print(plan_table(costs, plan))
    return 0


def _run_auto(args: argparse.Namespace, costs: ChainCosts) -> int:
    """``plan --auto``: the ranking :func:`lightning_pipe.auto.search` gives, best first."""
    from lightning_pipe.auto import ranking_table, search

    candidates = search(
        costs,
        args.devices,
        memory_limit=args.memory_limit,
        rule=args.rule,
        profile_microbatches=args.microbatches or args.devices,
        extra_copies=EXTRA_COPIES[args.optimizer],
        network=Network(args.bandwidth),
    )
    if args.json:
        fields = ("family", "rule", "microbatches", "recompute", "bounds", "replicas", "step_seconds")
        fields += ("bubble_fraction", "memory_bytes", "why")
        ranked = [{name: getattr(c, name) for name in fields} for c in candidates[: args.top]]
        print(json.dumps({"profile": costs.name, "devices": args.devices, "candidates": ranked}, indent=1))
    else:
        print(ranking_table(candidates, top=args.top))
    return 0


def _replica_list(text: str) -> list[int]:
    try:
        return [_positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{error}: give one worker count >= 1 per stage, e.g. 2,1,1") from None


def _simulate_parser(commands: argparse._SubParsersAction) -> None:
    from lightning_pipe.schedule import FAMILIES
    from lightning_pipe.schedule.master import PRIORITIES

    parser = commands.add_parser(
        "simulate",
        help="generate a schedule, predict its makespan, bubble and memory, draw it",
        description="Generate a pipeline schedule, validate it and simulate it with per-stage costs.",
    )
    parser.add_argument("--schedule", required=True, choices=sorted(FAMILIES), help="schedule family")
    parser.add_argument("--stages", type=_positive_int, help="pipeline stages P (default: from --costs/--plan)")
    parser.add_argument("--microbatches", type=_positive_int, required=True, help="micro-batches per step m")
    parser.add_argument("--steps", type=_positive_int, default=1, help="optimizer steps to simulate")
    parser.add_argument("--virtual-stages", type=_positive_int, default=2, help="stages per worker (interleaved)")
    parser.add_argument("--period", type=float, help="period T of 1f1b_star")
    parser.add_argument("--k", type=_positive_int, help="k of kperiodic")
    parser.add_argument(
        "--slack", type=_whole, default=0, help="extra warm-up forwards per link (1f1b, pipedream, 2bw; default 0)"
    )
    parser.add_argument("--rule", help="update rule: stash|vertical (pipedream), cdp_v1|cdp_v2 (cdp)")
    parser.add_argument("--form", default="pipeline", choices=list(FORMS), help="cdp form")
    parser.add_argument("--groups", type=_positive_int, default=2, help="G of lpp/fslpp")
    parser.add_argument("--replicas", type=_positive_int, default=2, help="R of lpp/fslpp")
    parser.add_argument("--stage-replicas", type=_replica_list, help="workers per stage of 1f1b_rr, e.g. 2,1,1")
    parser.add_argument("--priority", default="backward_first", choices=sorted(PRIORITIES), help="greedy tie break")
    parser.add_argument("--forward", type=float, default=1.0, help="forward time of every stage (unit costs)")
    parser.add_argument("--backward", type=float, default=2.0, help="backward time of every stage (unit costs)")
    costs = parser.add_mutually_exclusive_group()
    costs.add_argument(
        "--costs", metavar="FILE", help='per-stage costs JSON {"forward": [...], "backward": [...], ...}'
    )
    costs.add_argument("--plan", metavar="FILE", help="a plan from lightning-pipe plan --json")
    parser.add_argument("--bandwidth", type=_argument(parse_bandwidth), help="link bandwidth, e.g. 10GB/s")
    parser.add_argument("--no-overlap", action="store_true", help="a sender is busy while it sends")
    parser.add_argument("--latency", type=float, help="seconds every message takes on top of bytes / bandwidth")
    parser.add_argument(
        "--overhead", type=float, help="seconds of processor time a message costs its sender and its receiver"
    )
    parser.add_argument(
        "--contention",
        type=float,
        help="how many times slower an action runs while every worker computes (workers sharing one machine)",
    )
    parser.add_argument(
        "--early-gradients",
        action="store_true",
        help="cool-down backwards send their input gradient first, as the runtime does (flushing schedules)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE", help="draw the timeline (.png or .svg)")
    parser.add_argument("--memory-plot", metavar="FILE", help="draw activation memory over time (.png or .svg)")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace JSON")
    parser.add_argument("--save-schedule", metavar="FILE", help="write the schedule IR as JSON")
    parser.set_defaults(run=_run_simulate)


def _stage_costs(args: argparse.Namespace) -> tuple[Any, list[int] | None]:
    """The stage costs to simulate, and a plan's replicas per stage (for 1f1b_rr) when a plan is given."""
    from lightning_pipe.schedule import StageCosts

    replicas = None
    if args.costs or args.plan:
        path = args.costs or args.plan
        if args.costs:
            costs = StageCosts.from_dict(read_json(path, "stage costs"), path)
        else:
            plan = load_plan(path)
            costs = StageCosts.from_plan(plan.document, path, replicated=args.schedule == "1f1b_rr")
            replicas = list(plan.replicas)
        if args.stages is not None and args.stages != costs.stages:
            raise PlanningError(f"--stages {args.stages} but {path} describes {costs.stages} stages")
    else:
        if args.stages is None:
            raise PlanningError("give --stages, or --costs/--plan from which the stage count is read")
        costs = StageCosts.uniform(args.stages, args.forward, args.backward)
    changes = {}
    if args.bandwidth is not None:
        changes["bandwidth"] = args.bandwidth
    if args.no_overlap:
        changes["overlap"] = False
    for name in ("latency", "overhead", "contention"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return (replace(costs, **changes) if changes else costs), replicas


def _run_simulate(args: argparse.Namespace) -> int:
    from lightning_pipe.schedule import build_schedule, simulate

    costs, plan_replicas = _stage_costs(args)
    graph = build_schedule(
        args.schedule,
        costs.stages,
        args.microbatches,
        args.steps,
        virtual_stages=args.virtual_stages,
        period=args.period,
        stage_seconds=[f + b for f, b in zip(costs.forward, costs.backward, strict=True)],
        k=args.k,
        rule=args.rule,
        form=args.form,
        groups=args.groups,
        replicas=args.replicas,
        priority=args.priority,
        forward=args.forward,
        backward=args.backward,
        stage_replicas=args.stage_replicas or plan_replicas,
        slack=args.slack,
    )
    schedule = graph.schedule
    result = simulate(schedule, costs, graph=graph, early_gradients=args.early_gradients)
    if args.save_schedule:
        Path(args.save_schedule).write_text(json.dumps(schedule.to_dict()) + "\n")
    _draw(args, result)
    print(json.dumps(result.to_dict(), indent=1) if args.json else simulation_table(result))
    return 0


def _draw(args: argparse.Namespace, result) -> None:
    if not (args.plot or args.memory_plot or args.trace):
        return
    from lightning_pipe.schedule.draw import chrome_trace, draw_memory, draw_timeline

    title = f"{result.schedule.family}: P={result.schedule.stages}, m={result.schedule.microbatches}"
    if args.plot:
        draw_timeline(result.timeline, args.plot, title=title, workers=result.schedule.workers)
    if args.memory_plot:
        draw_memory(result.memory_timeline, args.memory_plot, title=title + " activation memory")
    if args.trace:
        chrome_trace(result.timeline, args.trace, name=title)


def _consolidate_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one Lightning checkpoint file",
        description="Read a checkpoint PipelineStrategy(state_dict_type='sharded') wrote (a directory) and write "
        "the full model and optimizer state as one file in Lightning's own layout: MyModule.load_from_checkpoint, "
        "plain Lightning, DDP and a pipeline on any split read it.",
    )
    parser.add_argument("checkpoint", type=Path, help="the sharded checkpoint directory")
    parser.add_argument("output", type=Path, nargs="?", help="the file to write (default: CHECKPOINT.consolidated)")
    parser.set_defaults(run=_run_consolidate)


def _run_consolidate(args: argparse.Namespace) -> int:
    from lightning_pipe.strategy.sharded import consolidate, is_sharded

    if not is_sharded(args.checkpoint):
        raise PlanningError(
            f"{args.checkpoint} is not a sharded checkpoint (a directory with meta.pt and the .distcp files that "
            "PipelineStrategy(state_dict_type='sharded') writes)"
        )
    output = args.output or args.checkpoint.with_name(args.checkpoint.name + ".consolidated")
    checkpoint = consolidate(args.checkpoint, output)
    print(f"wrote {output}: {len(checkpoint['state_dict'])} state-dict entries")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-pipe``."""
    parser = argparse.ArgumentParser(prog="lightning-pipe", description="Pipeline-parallel planning and training.")
    commands = parser.add_subparsers(dest="command", required=True)
    _plan_parser(commands)
    _simulate_parser(commands)
    _consolidate_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (PlanningError, PipelineRuntimeError, CheckpointError) as error:
        print(f"lightning-pipe {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
