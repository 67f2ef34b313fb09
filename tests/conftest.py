"""Shared fixtures: the PipeDream profiles (``graph.txt`` of the PipeDream repository, MIT licence,
kept in ``tests/data/pipedream-profiles``)."""

from __future__ import annotations

from pathlib import Path

import pytest

PROFILES = Path(__file__).resolve().parent / "data" / "pipedream-profiles"


@pytest.fixture
def pipedream_profiles() -> Path:
    return PROFILES
