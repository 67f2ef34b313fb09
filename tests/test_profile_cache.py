"""Profiles kept from run to run: the same model on the same machine is planned from the same profile."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pipe import planning
from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.profile_cache import cached_profile, default_directory, profile_key
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
