"""The modules' earlier import paths (``lightning_pipe/moved.py``) give the module at its new path,
with a ``DeprecationWarning`` naming it, in a fresh interpreter as a user's script imports them."""

from __future__ import annotations

import subprocess
import sys

from lightning_pipe.moved import MOVED

_SCRIPT = """
import importlib, sys, warnings
import lightning_pipe
moved = eval(sys.argv[1])
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new), (old, module)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
"""


def test_every_earlier_path_imports_the_module_at_its_new_one() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, repr(MOVED)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
