"""The tables the command line and the strategy print: a partition plan, the placement of a
schedule's stages on workers, and a simulated schedule (``lightning-pipe plan`` and ``simulate``
print the first and the last; the strategy prints all three at set-up)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_pipe.util.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from lightning_pipe.cost.memory import MemoryModel
    from lightning_pipe.cost.records import ChainCosts
    from lightning_pipe.partition import Plan
    from lightning_pipe.schedule.ir import Schedule
    from lightning_pipe.schedule.simulation import Simulation

__all__ = ["placement_table", "plan_table", "simulation_table"]


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _in_flight(memory: MemoryModel) -> str:
    """What a plan's memory is counted as under: the closed form of a schedule, or the activations in
    flight per stage that the run's own family keeps (``MemoryModel.counts``)."""
    if memory.counts is None:
        return memory.schedule
    return f"the family's own schedule (micro-batches in flight per stage: {', '.join(map(str, memory.counts))})"


def plan_table(costs: ChainCosts, plan: Plan) -> str:
    """The plan as the Black GPipe ``dp>`` console shows one: each stage's layers, replicas, cost,
    compute time and memory, then the bottleneck."""
    memory = plan.memory
    limit = "none" if plan.memory_limit is None else format_bytes(plan.memory_limit)
    bandwidth = "free" if plan.network.free else f"{format_bytes(plan.network.bandwidth)}/s"
    lines = [
        f"Profile: {costs.name} ({len(costs)} layers)",
        *[f"  note: {note}" for note in plan.notes],
        f"===== Partition ({plan.partitioner}) =====",
        f"# of layers : {len(costs)}",
        f"# of devices: {plan.devices} ({plan.devices_used} used)",
        f"memory as under {_in_flight(memory)}, {memory.microbatches or 'unbounded'} micro-batches, "
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


def placement_table(schedule: Schedule) -> str:
    """Where each stage computes and where its weights live (the workers of one pipeline): Rahimi's
    ``w(s, b, d)`` as it came out, for every family."""
    lines = [
        f"===== Placement ({schedule.family}, {schedule.workers} workers per pipeline) =====",
        "stage  computes on  weights on",
    ]
    for stage in range(schedule.stages):
        computing, owners = schedule.computing(stage), schedule.owners[stage]
        lines.append(f"{stage:>5}  {_workers(computing):<11} {_workers(owners)}")
    after = schedule.params.get("cue_after")
    if isinstance(after, int):  # CDP's dp form: where each replica starts
        stages = schedule.stages
        action = f"F{after}" if after < stages else f"B{2 * stages - 1 - after}"
        lines.append(f"each worker starts its micro-batch when the previous one has done its {action}")
    return "\n".join(lines)


def _workers(workers: Sequence[int]) -> str:
    """``0``, ``0,2`` or ``0-3``."""
    if len(workers) > 2 and list(workers) == list(range(workers[0], workers[-1] + 1)):
        return f"{workers[0]}-{workers[-1]}"
    return ",".join(map(str, workers))


def simulation_table(result: Simulation) -> str:
    """The simulated schedule: makespan, steady step, bubble, and per worker its busy and idle time,
    activations and weight versions at their peak."""
    schedule = result.schedule
    lines = [
        f"{schedule.family}: {schedule.stages} stages, {schedule.microbatches} micro-batches x {schedule.steps} "
        f"step(s) on {schedule.workers} workers, rule {schedule.rule}" + ("" if schedule.flush else ", no flush"),
        f"makespan {result.makespan:.6g}, steady step {result.steady_step:.6g}, "
        f"throughput {result.throughput:.6g} micro-batches per time unit, bubble {result.bubble_fraction:.2%}",
        "NCA per stage: " + " ".join(str(n) for n in result.nca),
        f"{'worker':>6} {'busy':>10} {'idle':>10} {'activations':>11} {'act. bytes':>11} {'weights':>7}",
    ]
    for w in range(schedule.workers):
        lines.append(
            f"{w:>6} {result.busy[w]:>10.6g} {result.idle[w]:>10.6g} {result.peak_activations[w]:>11} "
            f"{format_bytes(result.peak_activation_bytes[w]):>11} {result.weight_versions[w]:>7}"
        )
    return "\n".join(lines)
