"""Shared fixtures: where the shared PipeDream profiles live (tests using them skip when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

PROFILES = Path(__file__).resolve().parents[2] / "shared" / "data" / "pipedream-profiles"


@pytest.fixture
def pipedream_profiles() -> Path:
    if not PROFILES.is_dir():
        pytest.skip(f"PipeDream profiles not found at {PROFILES}")
    return PROFILES
