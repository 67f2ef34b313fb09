"""Profiles kept from run to run: the same model on the same machine is profiled once.

Measured layer times jitter from run to run (other processes, the clock, the allocator), and layers
of near-equal cost then swap sides of a cut: two identical runs could get different splits. The
profile the strategy measures is therefore saved under a key of everything that decides the layers'
costs — the layers (their names and ``repr``: types and hyper-parameters), their parameters' and
buffers' shapes and dtypes, the micro-batch's shapes and dtypes, the device, the timed runs per layer,
the versions of torch and of this package, what a layer's record holds, and on the CPU the state
of the C library's heap it was measured in (:func:`~lightning_pipe.runtime.allocator.settle_heap`) —
and a later run with the same key plans from it, deterministically (autotuning caches work this way: cuDNN's benchmark
mode, Triton's). A layer, batch size, device or torch of another kind gives another key; an edited
``forward`` body that keeps the layers' shapes does not: delete the file, or pass
``profile_cache=False``, to measure afresh.

A kept profile is only as good as the run that measured it, so it is measured anew (and the file
replaced, with a warning saying why) when

- it was measured on a loaded machine: the share of the processors other processes kept busy while
  it was measured (:mod:`.machine_load`) is kept in its ``meta.load``, and a profile measured at
  :data:`~lightning_pipe.cost.machine_load.LOADED` or more is measured again by the first run that
  finds the machine quieter than that (while the machine stays loaded the kept one is used: one
  measured now would be no better). A profile measured under load says so when it is measured.
- a run found that its own stages' times disagree with it (:func:`profile_disagrees`) and marked it
  stale (:func:`forget_profile`; ``meta.stale`` holds the reason).

Files written before the load was recorded (no ``meta.load``) are used as they are.

The directory is ``$LIGHTNING_PIPE_CACHE`` when set, else ``$XDG_CACHE_HOME/lightning_pipe/profiles``
(``~/.cache`` without it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.cost.machine_load import LOADED, CpuReading, current_load, load_between, read_cpu
from lightning_pipe.cost.profile_file import load_profile, save_profile
from lightning_pipe.cost.records import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.files import kept_document, replace_json
from lightning_pipe.util.nested import tensors

__all__ = [
    "KEPT_IN",
    "cached_profile",
    "default_directory",
    "forget_profile",
    "kept_here",
    "model_key",
    "profile_directory",
    "profile_disagrees",
    "profile_key",
]

KEPT_IN = "kept_in"
"""The key of a profile's ``meta`` naming the file :func:`cached_profile` read it from or kept it in
(not saved in the file itself); :func:`forget_profile` marks that file."""

_KEPT_HERE: set[Path] = set()  # the files this process measured and kept (.kept_here)


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
    package = _package_version()
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
        "measures": [field.name for field in fields(LayerCost)],  # a profile kept before a field was measured lacks it
        "heap": "settled" if device.type == "cpu" else None,  # glibc's heap as the steps find it (runtime/allocator.py)
    }
    return _digest(described)


def model_key(layers: Sequence[nn.Module], device: torch.device) -> str:
    """A digest of the model ``layers`` make up, however it is cut into layers: the shapes and dtypes
    of its tensors (parameters and buffers, each once, in sorted order), the device and the versions
    of torch and this package. Two cuts of one model share it (a capture cuts finer to have layers
    for more stages); two models of the same tensors share it too."""
    unique = {id(t): t for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    described = {
        "tensors": sorted((list(t.shape), str(t.dtype)) for t in unique.values()),
        "device": _device_name(device),
        "torch": torch.__version__,
        "lightning_pipe": _package_version(),
    }
    return _digest(described)


def _digest(described: dict[str, Any]) -> str:
    """A key of what ``described`` holds (its JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def _package_version() -> str:
    try:
        return version("lightning_pipe")
    except PackageNotFoundError:  # run from a source tree without installing it
        return "source"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu:{os.cpu_count()}:{torch.get_num_threads()}"
    return device.type


def cached_profile(
    directory: Path,
    key: str,
    measure: Callable[[], ChainCosts],
    layers: int,
    read: Callable[[], CpuReading] = read_cpu,
) -> tuple[ChainCosts, Path, bool]:
    """The profile kept under ``key`` in ``directory``, or a fresh one (``measure()``) kept there;
    with the file and whether it was reused. The profile's ``meta`` holds the load the machine had
    while it was measured (``load``, read with ``read``) and the file (:data:`KEPT_IN`).

    An unreadable or mismatched file, one marked stale, and one measured under load when the machine
    is quieter now (module docstring) are measured anew and replaced, with a warning naming the
    reason; a directory that cannot be written only loses the keeping."""
    path = directory / f"{key}.json"
    if path.exists():
        try:
            kept = load_profile(path)
            problem = _distrusted(kept, path, layers, read)
            if problem is None:
                return _located(kept, path), path, True
        except PlanningError as error:
            problem = str(error)
        warnings.warn(f"kept profile not used: {problem}; measured anew and replaced", stacklevel=2)
    start = read()
    costs = measure()
    load = load_between(start, read())
    costs = replace(costs, meta={**costs.meta, "load": load})
    if load is not None and load >= LOADED:
        warnings.warn(
            f"the profile was measured while other processes kept {load:.0%} of the processors busy: its times may "
            f"be long and uneven. It is kept in {path} and measured anew by the first later run that finds the "
            f"machine quieter (under {LOADED:.0%})",
            stacklevel=2,
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
    except OSError:
        return costs, path, False
    try:
        save_profile(costs, temporary)
        os.replace(temporary, path)  # atomic: a concurrent run reads the old file or the new one
        _KEPT_HERE.add(path)
    except OSError:
        temporary.unlink(missing_ok=True)
        return costs, path, False
    return _located(costs, path), path, False


def kept_here(path: Path) -> bool:
    """Whether this process measured the profile kept in ``path`` (a run reading back the profile it
    measured moments before, for its layers' order, has no earlier run's profile to announce)."""
    return path in _KEPT_HERE


def _distrusted(kept: ChainCosts, path: Path, layers: int, read: Callable[[], CpuReading]) -> str | None:
    """Why the kept profile ``kept`` (read from ``path``) is not used for a model of ``layers``
    layers, or ``None``: it is."""
    if len(kept) != layers:
        return f"{path} describes {len(kept)} layers, not these {layers}"
    stale = kept.meta.get("stale")
    if stale is not None:
        return f"{path} was marked stale: {stale}"
    then = kept.meta.get("load")
    if isinstance(then, int | float) and then >= LOADED:
        now = current_load(read)
        if now is not None and now < LOADED:
            return (
                f"{path} was measured while other processes kept {then:.0%} of the processors busy, and the machine "
                f"is quieter now ({now:.0%})"
            )
    return None


def _located(costs: ChainCosts, path: Path) -> ChainCosts:
    """``costs`` with the file it is kept in (:data:`KEPT_IN`) in its ``meta``."""
    return replace(costs, meta={**costs.meta, KEPT_IN: str(path)})


def forget_profile(costs: ChainCosts, reason: str) -> Path | None:
    """Mark the kept file ``costs`` came from (:data:`KEPT_IN`) stale, saying ``reason``: the next
    :func:`cached_profile` of its key measures anew and says why. Returns the file marked, or
    ``None`` where there is none to mark: ``costs`` was not kept (measured without a cache, loaded
    from a file given by the user, profiled on the meta device), or its file is gone or cannot be
    written. The rest of the file is left as it was."""
    kept = costs.meta.get(KEPT_IN)
    if not isinstance(kept, str):
        return None
    path = Path(kept)
    document = kept_document(path)
    meta = document.get("meta", {})
    if not document or not isinstance(meta, dict):
        return None
    document["meta"] = {**meta, "stale": reason}
    return path if replace_json(path, document) else None


def profile_disagrees(
    profile_stage_seconds: Sequence[float], measured_stage_seconds: Sequence[float], tolerance: float = 0.15
) -> bool:
    """Whether a stage's measured seconds differ from the profile's by more than ``tolerance`` of the
    profile's: the signal to :func:`forget_profile` a kept profile after a run's first steps.

    Both give each stage's forward plus backward seconds per micro-batch, in stage order: the
    profile's summed over the stage's layers, the run's from its timeline with the slowdown of the
    other workers computing beside it taken out
    (:func:`~lightning_pipe.runtime.calibration.alone_costs`), or any shared slowdown of the run would
    read as a wrong profile.

    Raises:
        PlanningError: the lists differ in length or are empty, a value is not a finite number >= 0, a
            profile's stage is 0 s, or ``tolerance`` is not a finite number > 0.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 < tolerance < math.inf:
        raise PlanningError(f"tolerance must be a finite fraction > 0 (0.15: 15%), got {tolerance!r}")
    if len(profile_stage_seconds) != len(measured_stage_seconds) or not profile_stage_seconds:
        raise PlanningError(
            f"{len(profile_stage_seconds)} profiled and {len(measured_stage_seconds)} measured stage times: give one "
            "of each per stage, in stage order"
        )
    for name, values in (("profile", profile_stage_seconds), ("measured", measured_stage_seconds)):
        for stage, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise PlanningError(f"{name} seconds of stage {stage} must be a finite number >= 0, got {value!r}")
    if 0 in profile_stage_seconds:
        raise PlanningError(
            f"profile seconds of stage {list(profile_stage_seconds).index(0)} are 0: nothing to compare a run with"
        )
    return any(
        abs(measured - profiled) > tolerance * profiled
        for profiled, measured in zip(profile_stage_seconds, measured_stage_seconds, strict=True)
    )
