"""Shared fixtures: the PipeDream profiles (``graph.txt`` of the PipeDream repository, MIT licence,
kept in ``tests/data/pipedream-profiles``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import Phase, settings

if "MUTANT_UNDER_TEST" in os.environ:  # under mutmut (docs/mutation.md): a failure is enough, no need to shrink it
    settings.register_profile("mutation", phases=[Phase.explicit, Phase.generate], database=None)
    settings.load_profile("mutation")

PROFILES = Path(__file__).resolve().parent / "data" / "pipedream-profiles"


@pytest.fixture
def pipedream_profiles() -> Path:
    return PROFILES


@pytest.fixture(autouse=True)
def _own_profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test keeps its profiles apart (``$LIGHTNING_PIPE_CACHE``, read when a strategy is made and
    inherited by the processes it starts): a profile kept by one test must not plan another's model."""
    monkeypatch.setenv("LIGHTNING_PIPE_CACHE", str(tmp_path_factory.mktemp("profiles")))
