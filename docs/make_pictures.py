"""Draw every schedule family into docs/schedules/ and write the gallery page docs/schedules.md.

Run: ``python docs/make_pictures.py``. Costs: forward 1, backward 2 time units per stage (the papers'
examples), one activation unit per micro-batch in flight; the numbers in the gallery are what the
simulator predicts for exactly these pictures.
"""

from __future__ import annotations

from pathlib import Path

from lightning_pipe.schedule import StageCosts, build_schedule, simulate
from lightning_pipe.schedule.draw import draw_memory, draw_timeline

HERE = Path(__file__).resolve().parent
GALLERY = [
    ("gpipe", 4, 8, 1, {}, "GPipe: fill-drain with a flush"),
    ("1f1b", 4, 8, 1, {}, "1F1B (PipeDream-Flush)"),
    ("interleaved", 8, 8, 1, {"virtual_stages": 2}, "Interleaved 1F1B, 2 stages per worker"),
    ("looped_bfs", 8, 8, 1, {"virtual_stages": 2}, "Looped BFS, 2 stages per worker"),
    ("1f1b_star", 4, 8, 1, {"period": 6.0}, "1F1B*(T = 6): groups of two stages, NCA 2, 2, 1, 1"),
    ("kperiodic", 4, 9, 1, {"k": 2}, "k-periodic (k = 2): 1F1B with every third slot dropped"),
    ("zb_h1", 4, 8, 1, {}, "ZB-H1: backward split into I and W"),
    ("pipedream", 4, 2, 4, {}, "PipeDream asynchronous 1F1B (weight stashing), 4 steps of 2"),
    ("2bw", 4, 4, 3, {}, "PipeDream-2BW: no flush, two weight versions"),
    ("cdp", 4, 4, 3, {}, "Cyclic Data Parallelism, pipeline form (CDP-v2)"),
    ("cdp", 3, 3, 3, {"form": "pyramid"}, "Cyclic Data Parallelism, pyramid form: P(P+1)/2 workers"),
    ("cdp", 4, 4, 3, {"form": "single"}, "Cyclic Data Parallelism on one device"),
    ("cdp", 4, 4, 3, {"form": "dp"}, "Cyclic Data Parallelism, dp form: a replica per micro-batch, ring-reduced"),
    ("cdp", 4, 4, 3, {"form": "zero"}, "Cyclic Data Parallelism, ZeRO form: each stage's state passed on"),
    ("ddp", 4, 8, 1, {}, "DDP as w(s,b,d) = (b, b)"),
    ("fsdp", 4, 4, 1, {}, "FSDP as w(s,b,d) = (s, b)"),
    ("pp", 4, 8, 1, {}, "GPipe as w(s,b,d) = (s, s), greedy 1F1B priority"),
    ("lpp", 4, 8, 1, {"groups": 2, "replicas": 2}, "LPP, G = 2 groups of R = 2 workers"),
    ("fslpp", 4, 8, 1, {"groups": 2, "replicas": 2}, "FSLPP, G = 2, R = 2"),
]


def main() -> None:
    rows = [
        "# Schedule gallery",
        "",
        "Made by `python docs/make_pictures.py`: forward 1 and backward 2 time units per stage, boxes as wide as",
        "their simulated duration, one colour per micro-batch. Numbers are the simulator's for these pictures.",
        "",
        "| schedule | workers | makespan | bubble | peak activations per worker | weight versions |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    sections = []
    for family, stages, microbatches, steps, options, title in GALLERY:
        graph = build_schedule(family, stages, microbatches, steps, **options)
        schedule = graph.schedule
        sim = simulate(schedule, StageCosts.uniform(stages, 1.0, 2.0, saved_bytes=[1.0] * stages), graph)
        name = family + ("_" + options["form"] if "form" in options else "")
        heading = f"{title} (P={stages}, m={microbatches}, steps={steps})"
        draw_timeline(sim.timeline, HERE / "schedules" / f"{name}.png", title=heading, workers=schedule.workers)
        draw_memory(sim.memory_timeline, HERE / "schedules" / f"{name}_memory.png", title=f"{title}: live activations")
        rows.append(
            f"| [{name}](#{name}) | {schedule.workers} | {sim.makespan:g} | {sim.bubble_fraction:.1%} | "
            f"{' '.join(map(str, sim.peak_activations))} | {' '.join(map(str, sim.weight_versions))} |"
        )
        sections += [
            f"## {name}",
            "",
            heading,
            "",
            f"![{name}](schedules/{name}.png)",
            f"![{name} memory](schedules/{name}_memory.png)",
            "",
        ]
    (HERE / "schedules.md").write_text("\n".join([*rows, "", *sections]))


if __name__ == "__main__":
    main()
