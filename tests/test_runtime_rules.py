"""The multi-process runtime equals the single-process reference of every update rule.

Each launch runs several cases in the same processes (2 and 4 workers, gloo, one thread each) to
keep the suite fast; parameters must match the reference to 1e-6 after several steps, with SGD
(momentum, weight decay) and with Adam, including an uneven last micro-batch, and over runs
separated by drains (``runs``: the steps of each), as at the end of every epoch.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.runtime.gradient_rings import PARTIAL, SUM
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import StageCosts, make_schedule, simulate
from tests.reference import (
    batches,
    build_stages,
    cdp_v2,
    leading_forwards,
    one_step_late,
    pipedream_stash,
    pipedream_vertical,
    reference,
    run_pipeline,
    sync,
)


def _case(name: str, family: str, stages: int, microbatches: int, steps: int = 4, **extra: object) -> dict:
    case = {"name": name, "family": family, "stages": stages, "microbatches": microbatches, "steps": steps}
    case.setdefault("optimizer", "sgd")
    case.update(extra)
    return case


def _rule(case: dict):
    family, options = case["family"], case.get("options", {})
    rule = options.get("rule")
    if family in ("pipedream",) or (family == "2bw" and rule == "stash"):
        make = pipedream_vertical if rule == "vertical" else pipedream_stash
        return make(case["stages"], case["microbatches"], options.get("slack", 0))
    if family == "2bw" or (family == "cdp" and rule == "cdp_v1"):
        return one_step_late
    if family == "cdp":
        return cdp_v2(case["stages"])
    return sync


def _check(cases: list[dict], workers: int) -> None:
    results = run_local(run_pipeline, workers, cases, timeout=240)
    for case in cases:
        stages = build_stages(case["stages"], frozen=case.get("frozen", ()), gated=case.get("gated", False))
        data = batches(case["steps"], rows=case.get("rows", 10))
        expected = reference(
            stages,
            data,
            case["microbatches"],
            _rule(case),
            case["optimizer"],
            runs=case.get("runs"),
            accumulate=case.get("accumulate", 1),
        )
        if "runs" in case:  # the drains matter: the rule started over at each differs from one run of every step
            one_run = reference(stages, data, case["microbatches"], _rule(case), case["optimizer"])
            flat = [torch.cat([p.flatten() for stage in result for p in stage]) for result in (expected, one_run)]
            assert (flat[0] - flat[1]).abs().max() > 1e-4, case["name"]
        seen = set()
        for rank_result in results:  # every replica of a stage, not just the first one found
            for stage, params in rank_result[case["name"]].items():
                seen.add(stage)
                for got, want in zip(params, expected[stage], strict=True):
                    error = (got - want).abs().max()
                    assert torch.allclose(got, want, atol=1e-6, rtol=0), (case["name"], stage, error)
        assert sorted(seen) == list(range(case["stages"])), case["name"]
        if case.get("options", {}).get("slack"):
            _check_warmup(case, [rank_result["leading forwards"][case["name"]] for rank_result in results])
        if case.get("options", {}).get("form") == "dp":
            _check_ring(case, [rank_result["ring messages"][case["name"]] for rank_result in results])


def _check_ring(case: dict, sent: list[dict[tuple[str, int, int], int]]) -> None:
    """CDP's dp form: each step, each stage's partial sum crossed each link ``k -> k + 1`` of the
    ring of workers once (none into the first worker), and the whole sum each link of its spread
    once, nothing else: ``2 (W - 1)`` messages per stage and step, no collective."""
    workers, steps = len(sent), case["steps"]
    for stage in range(case["stages"]):
        spread = [
            workers - 1,
            *make_schedule("cdp", case["stages"], case["microbatches"], 3, **case["options"]).rings[stage].spread,
        ]
        for worker, counts in enumerate(sent):
            expected = {}
            if worker + 1 < workers:
                expected[(PARTIAL, stage, worker + 1)] = steps
            if worker in spread[:-1]:
                expected[(SUM, stage, spread[spread.index(worker) + 1])] = steps
            assert {k: v for k, v in counts.items() if k[1] == stage} == expected, (case["name"], worker, counts)
    schedule = make_schedule("cdp", case["stages"], case["microbatches"], steps, **case["options"])
    predicted = simulate(schedule, StageCosts.uniform(case["stages"])).transfers["reduce"]
    received = [sum(n for c in sent for (_, _, to), n in c.items() if to == worker) for worker in range(workers)]
    assert received == predicted, (case["name"], received, predicted)  # the simulator prices each message


def _check_warmup(case: dict, ran: list[int]) -> None:
    """Each rank ran its schedule's warm-up with slack, which is longer than without (the references
    of these rules do not depend on the order, so this is what shows the slack order ran)."""
    options = case["options"]
    sizes = (case["family"], case["stages"], case["microbatches"], case["steps"])
    with_slack = [leading_forwards(order) for order in make_schedule(*sizes, **options).orders]
    without = [leading_forwards(order) for order in make_schedule(*sizes, **{**options, "slack": 0}).orders]
    assert ran == with_slack, (case["name"], ran, with_slack)
    assert with_slack[0] > without[0], (case["name"], with_slack, without)


TWO_WORKERS = [
    _case("gpipe", "gpipe", 2, 3),
    _case("1f1b-uneven", "1f1b", 2, 4, rows=10),
    _case("1f1b-adam", "1f1b", 2, 3, optimizer="adam"),
    _case("interleaved", "interleaved", 4, 4, options={"virtual_stages": 2}),
    _case("looped_bfs", "looped_bfs", 4, 2, options={"virtual_stages": 2}),
    _case("1f1b_star", "1f1b_star", 2, 3, options={"period": 6.0}),
    _case("kperiodic", "kperiodic", 2, 4, options={"k": 1}),
    _case("zb_h1", "zb_h1", 2, 3),
    _case("zb_h1-adam", "zb_h1", 2, 4, optimizer="adam"),
    _case("recompute", "1f1b", 2, 2, recompute=True),
    _case("ddp", "ddp", 2, 2),  # Rahimi et al.'s w(s, b, d) family: data parallel over 2 workers
    _case("pp", "pp", 2, 2),
    # FSDP: each worker computes both stages and owns one; a borrowed stage starting from other weights
    # shows the lender's weights arrive, the result shows the borrower's gradients get back
    _case("fsdp", "fsdp", 2, 2, foreign_init=True),
    _case("fsdp-adam-uneven", "fsdp", 2, 2, optimizer="adam", rows=11, foreign_init=True),
    _case("pipedream-stash", "pipedream", 2, 1, steps=5, options={"rule": "stash"}),
    _case("pipedream-vertical", "pipedream", 2, 2, options={"rule": "vertical"}),
    _case("2bw", "2bw", 2, 2, steps=5),
    _case("2bw-adam", "2bw", 2, 3, optimizer="adam"),
    _case("2bw-stash", "2bw", 2, 2, options={"rule": "stash"}),
    _case("cdp-v1", "cdp", 2, 2, options={"rule": "cdp_v1"}),
    _case("cdp-v2", "cdp", 2, 2, steps=5, options={"rule": "cdp_v2"}),
    _case("cdp-v2-adam", "cdp", 2, 3, optimizer="adam", options={"rule": "cdp_v2"}),
    # CDP's dp form: a replica per micro-batch, gradients reduced along the ring of workers
    _case("cdp-dp-v1", "cdp", 2, 2, options={"rule": "cdp_v1", "form": "dp"}),
    _case("cdp-dp-v2", "cdp", 2, 2, steps=5, options={"rule": "cdp_v2", "form": "dp"}),
    # CDP's ZeRO form: each stage's whole state passed from worker to worker
    _case("cdp-zero-v1", "cdp", 2, 2, options={"rule": "cdp_v1", "form": "zero"}),
    _case("cdp-zero-v2", "cdp", 2, 2, steps=5, options={"rule": "cdp_v2", "form": "zero"}),
    # frozen parameters: never differentiated, untouched by weight decay or momentum
    _case("1f1b-frozen-first-stage", "1f1b", 2, 3, frozen=((0, "0.weight"), (0, "0.bias"))),
    _case("2bw-frozen-weight", "2bw", 2, 2, frozen=((1, "weight"),)),
    _case("zb_h1-frozen-bias", "zb_h1", 2, 3, optimizer="adam", frozen=((0, "0.bias"), (1, "bias"))),
    # gloo instead of shared memory (what other hosts use), with receives posted ahead (the default
    # posts these small messages when needed), and a mix: 3-row micro-batches (160 bytes) ahead, 2-row
    # ones (128) and first messages (a header) when needed
    _case("2bw-gloo", "2bw", 2, 2, steps=5, shared_memory_bytes=0),
    _case("2bw-all-ahead", "2bw", 2, 2, steps=5, post_ahead_bytes=0, shared_memory_bytes=0),
    _case(
        "interleaved-all-ahead",
        "interleaved",
        4,
        4,
        options={"virtual_stages": 2},
        post_ahead_bytes=0,
        shared_memory_bytes=0,
    ),
    _case("1f1b-uneven-mixed-posting", "1f1b", 2, 4, rows=10, post_ahead_bytes=150, shared_memory_bytes=0),
    _case(
        "cdp-v2-mixed-posting",
        "cdp",
        2,
        4,
        rows=10,
        options={"rule": "cdp_v2"},
        post_ahead_bytes=150,
        shared_memory_bytes=0,
    ),
    # a shared-memory ring of 512 bytes: messages wrap around its end, and those that find it full
    # (the first ones, with their layout's description) go through gloo, in order with the others
    _case("1f1b-small-ring", "1f1b", 2, 4, rows=10, shared_memory_bytes=512),
    _case("2bw-small-ring", "2bw", 2, 4, steps=5, shared_memory_bytes=512),
    # slack: extra warm-up forwards per link (more micro-batches and, for pipedream, versions in flight)
    _case("1f1b-slack", "1f1b", 2, 4, options={"slack": 1}),
    _case("2bw-slack", "2bw", 2, 2, steps=5, options={"slack": 1}),
    _case("2bw-stash-slack", "2bw", 2, 3, optimizer="adam", options={"rule": "stash", "slack": 2}),
    _case("pipedream-stash-slack", "pipedream", 2, 1, steps=6, options={"rule": "stash", "slack": 2}),
    # drains (ends of epochs) between runs of 1 to 3 steps: the steps in flight finish, the next run fills
    # anew from the live weights (the rule starts over), optimizer states carry over; the ZeRO form's
    # stages go back to their owners and leave them again
    *(
        _case(f"{name}-drains", family, 2, microbatches, steps=7, runs=(3, 1, 3), options=options)
        for name, family, microbatches, options in [
            ("2bw", "2bw", 2, {}),
            ("2bw-stash", "2bw", 2, {"rule": "stash"}),
            ("pipedream-stash", "pipedream", 1, {"rule": "stash"}),
            ("pipedream-vertical", "pipedream", 2, {"rule": "vertical"}),
            ("cdp-v1", "cdp", 2, {"rule": "cdp_v1"}),
            ("cdp-v2", "cdp", 2, {"rule": "cdp_v2"}),
            ("cdp-dp-v1", "cdp", 2, {"rule": "cdp_v1", "form": "dp"}),
            ("cdp-dp-v2", "cdp", 2, {"rule": "cdp_v2", "form": "dp"}),
            ("cdp-zero-v1", "cdp", 2, {"rule": "cdp_v1", "form": "zero"}),
            ("cdp-zero-v2", "cdp", 2, {"rule": "cdp_v2", "form": "zero"}),
        ]
    ),
    _case(
        "cdp-zero-v2-adam-drains",
        "cdp",
        2,
        2,
        optimizer="adam",
        steps=6,
        runs=(1, 3, 2),
        options={"rule": "cdp_v2", "form": "zero"},
    ),
]

FOUR_WORKERS = [
    _case("1f1b", "1f1b", 4, 4),
    _case("gpipe-uneven", "gpipe", 4, 3, rows=11, optimizer="adam"),
    _case("interleaved", "interleaved", 8, 4, options={"virtual_stages": 2}),
    _case("zb_h1", "zb_h1", 4, 5),
    _case("pipedream-vertical", "pipedream", 4, 2, options={"rule": "vertical"}),
    _case("lpp", "lpp", 2, 2),  # 2 stages, each on 2 of the 4 workers
    _case("fslpp", "fslpp", 2, 2, foreign_init=True),  # workers 1 and 2 compute stages owned by 3 and 0
    _case("fsdp", "fsdp", 4, 4, foreign_init=True),
    _case("2bw", "2bw", 4, 4, optimizer="adam"),
    _case("cdp-v2", "cdp", 4, 4, options={"rule": "cdp_v2"}),
    # backwards twice the forwards: each replica starts a quarter of a pass (three actions) after the previous
    _case("cdp-dp-v2-cued-by-time", "cdp", 4, 4, options={"form": "dp", "stage_durations": ([1.0] * 4, [2.0] * 4)}),
    _case("cdp-dp-v1-adam", "cdp", 4, 4, steps=5, optimizer="adam", options={"rule": "cdp_v1", "form": "dp"}),
    _case("cdp-dp-v2-3-stages-uneven", "cdp", 3, 4, rows=11, options={"rule": "cdp_v2", "form": "dp"}),
    _case("cdp-zero-v2", "cdp", 4, 4, options={"rule": "cdp_v2", "form": "zero"}),
    _case("cdp-zero-v1-adam", "cdp", 4, 4, steps=5, optimizer="adam", options={"rule": "cdp_v1", "form": "zero"}),
    _case("cdp-zero-v2-3-stages-uneven", "cdp", 3, 4, rows=11, options={"rule": "cdp_v2", "form": "zero"}),
    _case("1f1b_star", "1f1b_star", 4, 4, options={"period": 6.0}),
    _case("gpipe-uneven-all-ahead", "gpipe", 4, 3, rows=11, post_ahead_bytes=0, shared_memory_bytes=0),
    _case("interleaved-small-ring", "interleaved", 8, 4, options={"virtual_stages": 2}, shared_memory_bytes=512),
    _case("2bw-slack", "2bw", 4, 6, options={"slack": 1}),
    _case("cdp-zero-v2-drains", "cdp", 4, 4, steps=7, runs=(1, 3, 3), options={"rule": "cdp_v2", "form": "zero"}),
    _case(
        "cdp-zero-v1-3-stages-drains",
        "cdp",
        3,
        4,
        steps=7,
        runs=(3, 1, 3),
        rows=11,
        optimizer="adam",
        options={"rule": "cdp_v1", "form": "zero"},
    ),
    _case("cdp-dp-v2-drains", "cdp", 4, 4, steps=7, runs=(3, 1, 3), options={"rule": "cdp_v2", "form": "dp"}),
    _case("2bw-drains", "2bw", 4, 4, steps=7, runs=(3, 1, 3)),
]


@pytest.mark.timeout(300)
def test_two_workers_equal_the_references() -> None:
    _check(TWO_WORKERS, 2)


@pytest.mark.timeout(300)
def test_four_workers_equal_the_references() -> None:
    _check(FOUR_WORKERS, 4)


@pytest.mark.timeout(120)
def test_accumulation_over_calls_equals_the_reference() -> None:
    """Flushing schedules with ``step(update=False)``: every ``accumulate``-th step of a run and its
    last update with the sum of the steps' gradients, each loss divided by ``accumulate``. Through
    replicated stages (DDP: summed over the replicas once, at the update), lent ones (FSDP: the
    borrowers' gradients added before each carry) and split backwards (ZB-H1's ``W`` adding into the
    carried buffer), over runs separated by drains (a carried gradient survives none: every run ends
    with an update)."""
    _check(
        [
            _case("1f1b-accumulate-drains", "1f1b", 2, 2, steps=7, runs=(5, 2), accumulate=2),
            _case("gpipe-accumulate-uneven", "gpipe", 2, 3, steps=5, rows=11, accumulate=3),
            _case("zb_h1-adam-accumulate", "zb_h1", 2, 3, steps=5, optimizer="adam", accumulate=2),
            _case("ddp-accumulate", "ddp", 2, 2, steps=5, accumulate=2),
            _case("fsdp-accumulate", "fsdp", 2, 2, steps=5, accumulate=2, foreign_init=True),
        ],
        2,
    )


@pytest.mark.timeout(120)
def test_cdp_on_one_device_equals_its_references() -> None:
    """CDP's single-device form (Fournier & Oyallon 2024, §4.1): every micro-batch's stages in the
    cyclic timeline's order on one worker, with both rules."""
    _check(
        [
            _case("cdp-single-v2", "cdp", 4, 4, options={"rule": "cdp_v2", "form": "single"}),
            _case("cdp-single-v1-adam", "cdp", 3, 3, optimizer="adam", options={"rule": "cdp_v1", "form": "single"}),
        ],
        1,
    )


@pytest.mark.timeout(120)
def test_synchronous_families_on_one_device_equal_the_reference() -> None:
    """Every stage of a synchronous family on one worker (``form="single"``: its workers' programs
    in one) trains as the synchronous reference: GPipe, 1F1B, zero bubble (split backwards),
    interleaved (two workers' stages), 1F1B*, k-periodic and Rahimi's pp, with an uneven last
    micro-batch and Adam."""
    single = {"form": "single"}
    _check(
        [
            _case("gpipe-single", "gpipe", 3, 4, options=single),
            _case("1f1b-single", "1f1b", 4, 3, rows=11, options=single),
            _case("zb_h1-single", "zb_h1", 3, 4, options=single),
            _case("interleaved-single", "interleaved", 4, 4, optimizer="adam", options=single),
            _case("1f1b_star-single", "1f1b_star", 3, 3, options={**single, "period": 3.0}),
            _case("kperiodic-single", "kperiodic", 3, 4, options={**single, "k": 1}),
            _case("pp-single", "pp", 3, 2, options=single),
        ],
        1,
    )


@pytest.mark.timeout(300)
def test_replicated_stages_reduce_their_gradients() -> None:
    # stage 0 on two workers that reduce its gradient, stage 1 on one: three processes
    _check(
        [
            _case("cdp-pyramid", "cdp", 2, 2, options={"rule": "cdp_v2", "form": "pyramid"}),
            _case(
                "cdp-pyramid-v1-drains",
                "cdp",
                2,
                2,
                steps=7,
                runs=(3, 1, 3),
                options={"rule": "cdp_v1", "form": "pyramid"},
            ),
            _case("1f1b-rr", "1f1b_rr", 2, 4, options={"stage_replicas": [2, 1]}),
            _case("1f1b-rr-adam", "1f1b_rr", 2, 5, optimizer="adam", rows=11, options={"stage_replicas": [2, 1]}),
            _case("1f1b-rr-frozen", "1f1b_rr", 2, 4, frozen=((0, "0.bias"),), options={"stage_replicas": [2, 1]}),
            # 11 rows in 4 micro-batches: only the last (2 rows, on replica 1) reaches the gated weight
            _case("1f1b-rr-gated", "1f1b_rr", 2, 4, rows=11, gated=True, options={"stage_replicas": [2, 1]}),
        ],
        3,
    )
