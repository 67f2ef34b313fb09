"""Each package's ``__init__`` docstring is the map a newcomer reads first: it names every module of
the package (``:mod:`.name```), and only modules that exist."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PACKAGES = ("capture", "cost", "partition", "runtime", "schedule", "strategy")


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_docstring_names_every_module(package: str) -> None:
    module = importlib.import_module(f"lightning_pipe.{package}")
    named = set(re.findall(r":mod:`\.(\w+)`", module.__doc__ or ""))
    files = {path.stem for path in Path(module.__file__).parent.glob("*.py") if path.stem != "__init__"}
    assert named - files == set(), f"{package}'s docstring names modules that do not exist"
    assert files - named == set(), f"{package}'s docstring leaves these modules out"
