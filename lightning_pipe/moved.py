"""The modules' earlier import paths, kept for one release.

``lightning_pipe.costs``, ``lightning_pipe.profiler``, ``lightning_pipe.models`` and the other
modules that sat at the package's top now live in packages named after what they do
(``lightning_pipe.cost``, ``lightning_pipe.zoo``, ``lightning_pipe.util``, ...), and modules whose
names collided now say what they hold (``strategy.relay`` is ``strategy.log_relay``,
``runtime.relays`` is ``runtime.stage_relays``, ``runtime.rings`` is ``runtime.gradient_rings``,
...). Importing an earlier path gives the module at its new one, with a ``DeprecationWarning``
naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    f"lightning_pipe.{old}": f"lightning_pipe.{new}"
    for old, new in {
        "costs": "cost.records",
        "profiler": "cost.profiler",
        "profile_file": "cost.profile_file",
        "pipedream_graph": "cost.pipedream_graph",
        "saved_bytes": "cost.saved_bytes",
        "memory": "cost.memory",
        "network": "cost.network",
        "plan_file": "partition.plan_file",
        "models": "zoo.models",
        "classifier": "zoo.classifier",
        "data": "zoo.data",
        "nested": "util.nested",
        "units": "util.units",
        "files": "util.files",
        "strategy.relay": "strategy.log_relay",
        "runtime.relays": "runtime.stage_relays",
        "runtime.rings": "runtime.gradient_rings",
        "runtime.ring_sizes": "runtime.shared_memory_sizes",
        "strategy.report": "strategy.fit_report",
        "strategy.planning": "planning",
        "strategy.profile_cache": "cost.profile_cache",
    }.items()
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an earlier path and loads it as the module at its new one."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module is the one at the new path, already executed."""


def install() -> None:
    """Let the earlier paths be imported (once per interpreter)."""
    if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
        sys.meta_path.append(_Moved())
