"""Profiles kept from run to run: the same model on the same machine is planned from the same profile,
unless it was measured under load or a run found it wrong."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pipe import planning
from lightning_pipe.cost.machine_load import CpuReading
from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.profile_cache import (
    KEPT_IN,
    cached_profile,
    default_directory,
    forget_profile,
    kept_here,
    profile_disagrees,
    profile_key,
)
from lightning_pipe.cost.profile_file import load_profile, save_profile
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.planning import PlanOptions, plan_stages
from lightning_pipe.strategy.strategy import PipelineStrategy

CPU = torch.device("cpu")


def _layers() -> list[nn.Module]:
    return [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)]


def _jittered(times: list[list[float]]):
    """A profiler whose measured times change from call to call, as a loaded machine's do."""
    calls = iter(times)

    def profile(layers, sample, **_: object) -> ChainCosts:
        seconds = next(calls)
        return ChainCosts.from_lists(seconds, [0.0] * len(seconds), params=[1.0] * len(seconds))

    return profile


def test_a_second_run_plans_from_the_kept_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same layers, micro-batch and device: the second planning reads the first's profile, so its
    split is the first's though the (jittered) profiler would have moved it; without the cache the
    split follows the jitter."""
    monkeypatch.setattr(planning, "profile_layers", _jittered([[5, 1, 1, 1, 1], [1, 1, 1, 1, 5]] * 2))
    sample = torch.randn(4, 8)
    options = PlanOptions(cache=tmp_path)
    first = plan_stages(_layers(), sample, 2, options, MemoryModel(), CPU)
    second = plan_stages(_layers(), sample, 2, options, MemoryModel(), CPU)
    assert first.bounds == second.bounds == ((0, 0), (1, 4))
    assert len(list(tmp_path.glob("*.json"))) == 1
    uncached = replace(options, cache=None)
    assert plan_stages(_layers(), sample, 2, uncached, MemoryModel(), CPU).bounds == ((0, 3), (4, 4))
    assert plan_stages(_layers(), sample, 2, uncached, MemoryModel(), CPU).bounds == ((0, 0), (1, 4))


def test_only_a_profile_another_process_measured_is_announced_as_reused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that profiles its layers twice (for their order, then for the plan) reads its own profile
    back without saying it was "reused"; one another process kept (the same file, where this process
    did not write it) is announced."""
    sample = torch.randn(4, 8)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    with caplog.at_level("INFO"):
        planning.profile_costs(_layers(), sample, PlanOptions(cache=mine), CPU)
        again = planning.profile_costs(_layers(), sample, PlanOptions(cache=mine), CPU)
    (path,) = mine.glob("*.json")
    assert again.meta[KEPT_IN] == str(path) and kept_here(path)
    assert "reused from" not in caplog.text
    theirs.mkdir()
    (theirs / path.name).write_text(path.read_text())  # as an earlier run left it
    assert not kept_here(theirs / path.name)
    with caplog.at_level("INFO"):
        planning.profile_costs(_layers(), sample, PlanOptions(cache=theirs), CPU)
    assert "reused from" in caplog.text


def test_what_changes_the_costs_changes_the_key() -> None:
    """Another batch size, dtype, layer hyper-parameter, layer name, device or repeat count is measured
    anew; the same model built again (other weights, same shapes) is not."""
    sample = torch.randn(4, 8)
    key = profile_key(_layers(), None, sample, CPU, 3)
    assert profile_key(_layers(), None, torch.randn(4, 8), CPU, 3) == key
    others = [
        profile_key(_layers(), None, torch.randn(16, 8), CPU, 3),
        profile_key(_layers(), None, sample.double(), CPU, 3),
        profile_key([*_layers()[:-1], nn.Linear(8, 4, bias=False)], None, sample, CPU, 3),
        profile_key([*_layers()[:1], nn.GELU(), *_layers()[2:]], None, sample, CPU, 3),
        profile_key(_layers(), ["a", "b", "c", "d", "e"], sample, CPU, 3),
        profile_key(_layers(), None, sample, torch.device("meta"), 3),
        profile_key(_layers(), None, sample, CPU, 5),
    ]
    assert len({key, *others}) == len(others) + 1


def test_an_unreadable_or_mismatched_file_is_measured_anew(tmp_path: Path) -> None:
    calls = []

    def measure() -> ChainCosts:
        calls.append(1)
        return ChainCosts.from_lists([1.0, 2.0])

    (tmp_path / "k.json").write_text("{not json")
    with pytest.warns(UserWarning, match=r"kept profile not used: .*k.json: invalid JSON at line 1: .*measured anew"):
        _, path, reused = cached_profile(tmp_path, "k", measure, layers=2)
    assert not reused and len(calls) == 1 and path == tmp_path / "k.json"
    assert cached_profile(tmp_path, "k", measure, layers=2)[2] and len(calls) == 1
    with pytest.warns(UserWarning, match=r"kept profile not used: .*k.json describes 2 layers, not these 3; measured"):
        assert not cached_profile(tmp_path, "k", measure, layers=3)[2] and len(calls) == 2  # other layer count
    assert not list(tmp_path.glob("*.tmp"))


def test_a_directory_that_cannot_be_written_only_loses_the_keeping(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    costs, _, reused = cached_profile(blocked / "profiles", "k", lambda: ChainCosts.from_lists([1.0]), layers=1)
    assert len(costs) == 1 and not reused


def test_the_directory_is_the_environments_or_the_users_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_PIPE_CACHE", "/somewhere/profiles")
    assert default_directory() == Path("/somewhere/profiles")
    assert PipelineStrategy("1f1b").plan_options.cache == Path("/somewhere/profiles")
    monkeypatch.delenv("LIGHTNING_PIPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert default_directory() == Path("/cache/lightning_pipe/profiles")
    assert PipelineStrategy("1f1b", profile_cache=False).plan_options.cache is None
    assert PipelineStrategy("1f1b", profile_cache="~/p").plan_options.cache == Path("~/p").expanduser()
    with pytest.raises(PlanningError, match="profile_cache must be True, False or a directory"):
        PipelineStrategy("1f1b", profile_cache=3)  # type: ignore[arg-type]


def _machine(loads: list[float]) -> Callable[[], CpuReading]:
    """A reader of a 2-processor machine that other processes keep ``loads[i]`` busy over the ``i``-th
    window between two readings (0.2 s each; this process computes nothing of it)."""
    clock = {"wall": 0.0, "busy": 0.0, "window": 0}

    def read() -> CpuReading:
        if clock["window"] % 2:
            clock["wall"] += 0.2
            clock["busy"] += loads[clock["window"] // 2] * 0.2 * 2
        clock["window"] += 1
        return CpuReading(clock["wall"], 0.0, clock["busy"], None, 2)

    return read


def _counting() -> tuple[list[int], Callable[[], ChainCosts]]:
    calls: list[int] = []

    def measure() -> ChainCosts:
        calls.append(1)
        return ChainCosts.from_lists([float(len(calls)), 2.0])

    return calls, measure


def test_the_load_is_kept_with_the_profile(tmp_path: Path) -> None:
    """The profile's ``meta.load`` is the load over its measurement, in the file too; a quiet
    measurement says nothing, a loaded one says so."""
    _, measure = _counting()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        costs, path, reused = cached_profile(tmp_path, "k", measure, 2, read=_machine([0.1]))
    assert not reused and costs.meta["load"] == 0.1 and load_profile(path).meta["load"] == 0.1
    assert costs.meta[KEPT_IN] == str(path) and KEPT_IN not in load_profile(path).meta
    with pytest.warns(UserWarning, match=r"^the profile was measured while other processes kept 60% of the processors"):
        costs, _, _ = cached_profile(tmp_path / "loaded", "k", measure, 2, read=_machine([0.6]))
    assert costs.meta["load"] == 0.6


def test_a_profile_measured_under_load_is_measured_anew_once_the_machine_is_quiet(tmp_path: Path) -> None:
    """Kept at a load of 0.6: reused while the machine is as loaded (a new one would be no better),
    measured anew and replaced, saying why, by the first run that finds it quiet; kept from then on."""
    calls, measure = _counting()
    with pytest.warns(UserWarning, match="measured while other processes kept 60%"):
        cached_profile(tmp_path, "k", measure, 2, read=_machine([0.6]))
    costs, _, reused = cached_profile(tmp_path, "k", measure, 2, read=_machine([0.5]))
    assert reused and len(calls) == 1 and costs.meta["load"] == 0.6
    with pytest.warns(
        UserWarning,
        match=r"kept profile not used: .*k.json was measured while other processes kept 60% of the processors busy, "
        r"and the machine is quieter now \(5%\); measured anew and replaced$",
    ):
        costs, path, reused = cached_profile(tmp_path, "k", measure, 2, read=_machine([0.05, 0.0]))
    assert not reused and len(calls) == 2 and costs.meta["load"] == 0.0 and load_profile(path).meta["load"] == 0.0
    assert cached_profile(tmp_path, "k", measure, 2, read=_machine([0.0]))[2] and len(calls) == 2


def test_a_file_without_a_load_is_used_as_it_is(tmp_path: Path) -> None:
    """Written before the load was kept (no ``meta.load``), or over too short a window to tell: used,
    without watching the machine."""

    def unread() -> CpuReading:
        raise AssertionError("the machine was watched")

    save_profile(ChainCosts.from_lists([1.0, 2.0]), tmp_path / "old.json")
    save_profile(replace(ChainCosts.from_lists([1.0, 2.0]), meta={"load": None}), tmp_path / "unknown.json")
    for key in ("old", "unknown"):
        costs, path, reused = cached_profile(tmp_path, key, lambda: pytest.fail("measured"), 2, read=unread)
        assert reused and costs.meta[KEPT_IN] == str(path)


def test_a_profile_a_run_found_wrong_is_measured_anew(tmp_path: Path) -> None:
    """:func:`forget_profile` marks the kept file stale with the reason, leaving the rest of it; the
    next run measures anew, saying the reason, and keeps the new one. Costs that were not kept have
    no file to mark."""
    calls, measure = _counting()
    costs, path, _ = cached_profile(tmp_path, "k", measure, 2, read=_machine([0.0]))
    before = json.loads(path.read_text())
    assert forget_profile(costs, "stage 1 ran 1.40x its profile") == path
    after = json.loads(path.read_text())
    assert after["meta"].pop("stale") == "stage 1 ran 1.40x its profile" and after == before
    with pytest.warns(UserWarning, match=r"k.json was marked stale: stage 1 ran 1.40x its profile; measured anew"):
        costs, _, reused = cached_profile(tmp_path, "k", measure, 2, read=_machine([0.0]))
    assert not reused and len(calls) == 2 and "stale" not in load_profile(path).meta
    assert cached_profile(tmp_path, "k", measure, 2, read=_machine([0.0]))[2]
    assert forget_profile(ChainCosts.from_lists([1.0]), "unkept") is None
    path.unlink()
    assert forget_profile(costs, "gone") is None


@pytest.mark.parametrize(
    ("measured", "disagrees"),
    [([1.0, 2.0], False), ([1.14, 1.71], False), ([1.0, 2.31], True), ([0.8, 2.0], True), ([0.0, 2.0], True)],
)
def test_a_run_disagrees_with_its_profile_beyond_the_tolerance(measured: list[float], disagrees: bool) -> None:
    """Stages of 1 and 2 s profiled: any stage measured more than 15% above or below them disagrees."""
    assert profile_disagrees([1.0, 2.0], measured) is disagrees
    assert profile_disagrees([1.0, 2.0], measured, tolerance=1.0) is False


@pytest.mark.parametrize(
    ("profiled", "measured", "tolerance", "message"),
    [
        ([1.0], [1.0, 2.0], 0.15, r"^1 profiled and 2 measured stage times: give one of each per stage"),
        ([], [], 0.15, r"^0 profiled and 0 measured"),
        ([1.0, math.nan], [1.0, 2.0], 0.15, r"^profile seconds of stage 1 must be a finite number >= 0, got nan$"),
        ([1.0, 2.0], [-1.0, 2.0], 0.15, r"^measured seconds of stage 0 must be a finite number >= 0, got -1.0$"),
        ([1.0, 0.0], [1.0, 2.0], 0.15, r"^profile seconds of stage 1 are 0: nothing to compare a run with$"),
        ([1.0], [1.0], 0.0, r"^tolerance must be a finite fraction > 0 \(0.15: 15%\), got 0.0$"),
    ],
)
def test_disagreement_refuses_what_cannot_be_compared(
    profiled: list[float], measured: list[float], tolerance: float, message: str
) -> None:
    with pytest.raises(PlanningError, match=message):
        profile_disagrees(profiled, measured, tolerance)
