"""Profiles kept from run to run: the same model on the same machine is profiled once.

Measured layer times jitter from run to run (other processes, the clock, the allocator), and layers
of near-equal cost then swap sides of a cut: two identical runs could get different splits. The
profile the strategy measures is therefore saved under a key of everything that decides the layers'
costs — the layers (their names and ``repr``: types and hyper-parameters), their parameters' and
buffers' shapes and dtypes, the micro-batch's shapes and dtypes, the device, the timed runs per layer
and the versions of torch and of this package — and a later run with the same key plans from it,
deterministically (autotuning caches work this way: cuDNN's benchmark mode, Triton's). A layer, batch
size, device or torch of another kind gives another key; an edited ``forward`` body that keeps the
layers' shapes does not: delete the file, or pass ``profile_cache=False``, to measure afresh.

The directory is ``$LIGHTNING_PIPE_CACHE`` when set, else ``$XDG_CACHE_HOME/lightning_pipe/profiles``
(``~/.cache`` without it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.cost.profile_file import load_profile, save_profile
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.nested import tensors

__all__ = ["cached_profile", "default_directory", "profile_directory", "profile_key"]


def profile_directory(cache: bool | str | os.PathLike[str]) -> Path | None:
    """The directory the strategy's ``profile_cache`` option names (``True``: :func:`default_directory`),
    or ``None`` (``False``: measure every run)."""
    if cache is True:
        return default_directory()
    if cache is False:
        return None
    if isinstance(cache, str | os.PathLike):
        return Path(cache).expanduser()
    raise PlanningError(f"profile_cache must be True, False or a directory, got {cache!r}")


def default_directory() -> Path:
    """Where profiles are kept unless the strategy is given a directory."""
    if "LIGHTNING_PIPE_CACHE" in os.environ:
        return Path(os.environ["LIGHTNING_PIPE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_pipe" / "profiles"


def profile_key(
    layers: Sequence[nn.Module], names: Sequence[str] | None, sample: Any, device: torch.device, repeats: int
) -> str:
    """A digest of what decides the layers' measured costs (the module docstring lists it)."""
    try:
        package = version("lightning_pipe")
    except PackageNotFoundError:  # run from a source tree without installing it
        package = "source"
    described = {
        "layers": [
            {
                "name": names[i] if names is not None else str(i),
                "module": repr(layer),
                "tensors": [
                    (name, list(t.shape), str(t.dtype))
                    for name, t in (*layer.named_parameters(), *layer.named_buffers())
                ],
            }
            for i, layer in enumerate(layers)
        ],
        "sample": [(list(t.shape), str(t.dtype), t.requires_grad) for t in tensors(sample)],
        "device": _device_name(device),
        "repeats": repeats,
        "torch": torch.__version__,
        "lightning_pipe": package,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu:{os.cpu_count()}:{torch.get_num_threads()}"
    return device.type


def cached_profile(
    directory: Path, key: str, measure: Callable[[], ChainCosts], layers: int
) -> tuple[ChainCosts, Path, bool]:
    """The profile kept under ``key`` in ``directory``, or a fresh one (``measure()``) kept there;
    with the file and whether it was reused. An unreadable or mismatched file is measured anew and
    replaced, with a warning naming it; a directory that cannot be written only loses the keeping."""
    path = directory / f"{key}.json"
    if path.exists():
        try:
            costs = load_profile(path)
            if len(costs) == layers:
                return costs, path, True
            problem = f"{path} describes {len(costs)} layers, not these {layers}"
        except PlanningError as error:
            problem = str(error)
        warnings.warn(f"kept profile not used: {problem}; measured anew and replaced", stacklevel=2)
    costs = measure()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
    except OSError:
        return costs, path, False
    try:
        save_profile(costs, temporary)
        os.replace(temporary, path)  # atomic: a concurrent run reads the old file or the new one
    except OSError:
        temporary.unlink(missing_ok=True)
    return costs, path, False
