"""Sharded checkpoints: each rank writes the state of its own stages, and any run reads back, by
parameter name, only the entries it holds.

``PipelineStrategy(state_dict_type="sharded")`` saves a checkpoint as a directory, as Lightning's
``FSDPStrategy`` and ``ModelParallelStrategy`` do:

- ``torch.distributed.checkpoint`` (DCP) files, one per rank, with three trees keyed by name:
  ``state_dict`` (the module's entries, by their names in ``module.state_dict()``), ``optimizer`` (each
  parameter's optimizer state, by the parameter's name) and ``carried`` (per stage, the weight
  versions and gradients a non-flushing schedule carries between steps);
- ``meta.pt``, written by global rank 0: everything else of Lightning's checkpoint (loops, callbacks,
  LR schedulers, hyper-parameters), the optimizer's parameter groups with parameter names in place of
  indices, and the plan.

Every part carries the stamp of the save that wrote it (a random id and the step): each rank's under
the ``stamp`` tree, ``meta.pt``'s under its key ``"lightning_pipe"``. :func:`check_sharded`, which every
reader calls first, refuses a directory whose parts disagree (a shard of another save beside them) or
that lacks a part (``meta.pt``, DCP's ``.metadata``, a rank's file, or the end of one), naming them.
The strategy writes the directory under a temporary name and renames it once every rank has written
its part (:mod:`.atomic`), so that a save stopped half-way leaves the previous checkpoint as it was.

No rank ever holds the whole model to write or read it: a resume on another split, another number of
stages or another schedule reads the entries of its own stages by name (DCP's ``no_dist`` load of the
keys asked for). :func:`consolidate` (command: ``lightning-pipe consolidate DIR FILE``) turns the
directory into the single-file checkpoint in Lightning's own layout, which ``load_from_checkpoint``,
plain Lightning and DDP read.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.cloud_io import _load
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_pipe.errors import CheckpointError, IncompleteCheckpoint
from lightning_pipe.strategy.atomic import write_file
from lightning_pipe.strategy.pipeline_state import PipelineState

__all__ = [
    "DCP_METADATA",
    "METADATA",
    "STAMP",
    "ShardedEntries",
    "check_sharded",
    "consolidate",
    "is_sharded",
    "load_sharded",
    "read_entries",
    "save_sharded",
]

METADATA = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA = ".metadata"  # DCP's index of every rank's entries
STAMP = "lightning_pipe"  # meta.pt's key for the stamp of the save that wrote it
TREES = ("state_dict", "optimizer", "carried", "stamp")


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory, complete or not (it has any of ``meta.pt``,
    DCP's index or a rank's file)."""
    path = Path(path)
    if not path.is_dir():
        return False
    return (path / METADATA).is_file() or (path / DCP_METADATA).is_file() or any(path.glob("*.distcp"))


class ShardedEntries(Mapping[str, Any]):
    """One tree of a sharded checkpoint (``state_dict``, ``optimizer`` or ``carried``) as a mapping
    from name to value, read from the files on demand: :meth:`read` reads several entries at once."""

    def __init__(self, path: str | Path, tree: str, metadata: Metadata) -> None:
        self.path = Path(path)
        self.tree = tree
        self._storage = metadata.state_dict_metadata
        self._paths: dict[str, tuple[Any, ...]] = {
            flat: tuple(steps) for flat, steps in (metadata.planner_data or {}).items() if steps[0] == tree
        }
        self._names = sorted({str(steps[1]) for steps in self._paths.values()})
        self._known = frozenset(self._names)

    def __contains__(self, name: object) -> bool:  # from the metadata: Mapping's would read the entry
        return name in self._known

    def __getitem__(self, name: str) -> Any:
        if name not in self._known:
            raise KeyError(name)
        return self.read([name])[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shapes(self) -> dict[str, torch.Size]:
        """Each tensor entry's shape, from the index (nothing is read)."""
        return {
            str(steps[1]): self._storage[flat].size
            for flat, steps in self._paths.items()
            if len(steps) == 2 and isinstance(self._storage[flat], TensorStorageMetadata)
        }

    def read(self, names: Iterable[str]) -> dict[str, Any]:
        """The entries ``names``, on the CPU (tensors as saved, other values as saved)."""
        wanted = set(names)
        flat = {key: _placeholder(self._storage[key]) for key, steps in self._paths.items() if steps[1] in wanted}
        if flat:
            # the keys asked for are DCP's flat ones; objects are read into this very dictionary
            planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
            with warnings.catch_warnings():  # DCP warns that it reads in one process: what no_dist asks
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(flat, checkpoint_id=str(self.path), planner=planner, no_dist=True)
        entries: dict[str, Any] = {}
        for key, value in flat.items():
            _put(entries, self._paths[key][1:], value)
        return entries


def read_entries(entries: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``{name: entries[name]}`` for the ``names`` present, read at once from a sharded checkpoint."""
    present = [name for name in names if name in entries]
    if isinstance(entries, ShardedEntries):
        return entries.read(present)
    return {name: entries[name] for name in present}


def save_sharded(
    path: str | Path,
    checkpoint: dict[str, Any],
    trees: dict[str, dict[str, Any]],
    stamp: dict[str, Any],
    write_metadata: bool,
    group: Any,
) -> None:
    """Write this rank's ``trees`` (``{tree: {name: value}}``) and ``stamp`` (``{"save": id, "step":
    global step}``, the same on every rank) with DCP into the existing directory ``path``, a collective
    over ``group``; ``write_metadata``: this rank also writes ``checkpoint`` (the rest, the same on every
    rank) with the stamp and the number of ranks."""
    path = Path(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    parts = {**trees, "stamp": {str(rank): stamp}}
    dcp.save({tree: parts.get(tree, {}) for tree in TREES}, checkpoint_id=str(path), process_group=group)
    if write_metadata:
        stamped = {**checkpoint, STAMP: {**stamp, "ranks": ranks}}
        write_file(path / METADATA, lambda handle: torch.save(stamped, handle))


def check_sharded(path: str | Path, weights_only: bool | None = None) -> tuple[Metadata, dict[str, Any]]:
    """DCP's index and ``meta.pt``'s content of the sharded checkpoint ``path``, once every part is
    there and from the same save.

    Raises:
        IncompleteCheckpoint: a part is missing or cut short (named).
        CheckpointError: the parts come from different saves (each named with its step).
    """
    path = Path(path)
    if not (path / METADATA).is_file():
        raise _incomplete(path, f"it has no {METADATA} (the loop state)")
    if not (path / DCP_METADATA).is_file():
        raise _incomplete(path, f"it has no {DCP_METADATA} (DCP's index of the ranks' files)")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        meta = _load(path / METADATA, map_location="cpu", weights_only=weights_only)
    except Exception as error:
        raise _incomplete(path, f"its index cannot be read ({type(error).__name__}: {error})") from error
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise _incomplete(path, f"{_part(name)} ({name}) is missing")
        if file.stat().st_size < size:
            raise _incomplete(path, f"{_part(name)} ({name}) is cut short: {file.stat().st_size} of {size} bytes")
    _check_stamps(path, metadata, meta.pop(STAMP, None))
    return metadata, meta


def _incomplete(path: Path, reason: str) -> IncompleteCheckpoint:
    return IncompleteCheckpoint(
        f"{path} is incomplete: {reason}; a save that did not finish leaves this (its process was stopped, or the "
        "disk filled)"
    )


def _check_stamps(path: Path, metadata: Metadata, expected: dict[str, Any] | None) -> None:
    """Every rank's stamp is ``meta.pt``'s, and every rank wrote one (a directory written before
    stamps existed has none to compare)."""
    if expected is None:
        return
    entries = ShardedEntries(path, "stamp", metadata)
    try:
        stamps = entries.read(entries)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(
            f"{path} is damaged: the ranks' stamps cannot be read from its files ({type(error).__name__}); a file "
            "of another save may have been copied in. Resume from another checkpoint"
        ) from None
    files = {
        str(metadata.planner_data[index.fqn][1]): info.relative_path
        for index, info in metadata.storage_data.items()
        if metadata.planner_data[index.fqn][0] == "stamp"
    }
    parts = [(f"{METADATA} (the loop state)", expected)]
    parts += [(f"{_part(files[rank])} ({files[rank]})", stamps[rank]) for rank in sorted(stamps, key=int)]
    missing = sorted(set(range(expected["ranks"])) - {int(rank) for rank in stamps})
    if missing or any(stamp["save"] != expected["save"] for _, stamp in parts):
        described = "; ".join(f"{name}: step {stamp['step']}, save {stamp['save']}" for name, stamp in parts)
        absent = f"; no part of rank(s) {missing}" if missing else ""
        raise CheckpointError(
            f"{path} mixes parts of different saves, which cannot be resumed together: {described}{absent}. Resume "
            "from another checkpoint (a directory written in place by an older version, or files copied between "
            "checkpoints, can do this)"
        )


def _part(file: str) -> str:
    """What a DCP file of a sharded checkpoint holds (``__<rank>_<n>.distcp``)."""
    rank = file.removeprefix("__").split("_")[0]
    return f"rank {rank}'s stages" if rank.isdigit() else "a rank's stages"


def load_sharded(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` with its trees as :class:`ShardedEntries` read on demand:
    ``state_dict``, ``optimizer_states[0]["state"]`` and ``optimizer_states[0]["pipeline"]["carried"]``,
    once :func:`check_sharded` found every part there and from the same save."""
    metadata, checkpoint = check_sharded(path, weights_only)
    checkpoint["state_dict"] = ShardedEntries(path, "state_dict", metadata)
    for state in checkpoint.get("optimizer_states", []):
        state["state"] = ShardedEntries(path, "optimizer", metadata)
        pipeline = PipelineState.read(state, str(path))
        if pipeline is not None:
            pipeline.with_carried(ShardedEntries(path, "carried", metadata)).write(state)
    return checkpoint


def consolidate(path: str | Path, output: str | Path | None = None) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as one checkpoint in Lightning's own layout: the full
    ``state_dict``, and ``optimizer_states`` indexed by parameter position as ``Optimizer.state_dict()``
    gives them (plain Lightning, DDP, ``load_from_checkpoint`` and a pipeline on any split read it).
    With ``output``, it is also written there with ``torch.save``."""
    checkpoint = load_sharded(path, weights_only=False)
    entries: ShardedEntries = checkpoint["state_dict"]
    checkpoint["state_dict"] = entries.read(entries)
    for state in checkpoint.get("optimizer_states", []):
        states: ShardedEntries = state["state"]
        by_name = states.read(states)
        order = [name for group in state["param_groups"] for name in group["params"]]
        index = {name: i for i, name in enumerate(order)}
        state["state"] = {index[name]: value for name, value in by_name.items() if name in index}
        start = 0
        for group in state["param_groups"]:
            group["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
        pipeline = PipelineState.read(state, str(path))
        if pipeline is not None and pipeline.carried is not None:  # by stage, as a string: the full format's keys
            pipeline.with_carried(read_entries(pipeline.carried, pipeline.carried)).write(state)
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint


def _placeholder(storage: Any) -> Any:
    """Where DCP reads an entry: a tensor of the saved shape and type, or ``None`` for an object."""
    if isinstance(storage, TensorStorageMetadata):
        return torch.empty(storage.size, dtype=storage.properties.dtype)
    return None


def _put(root: dict[str, Any], steps: tuple[Any, ...], value: Any) -> None:
    """Set ``value`` at ``steps`` under ``root``, making the dictionaries (string steps) and lists
    (integer steps: DCP's list positions) on the way."""
    node: Any = root
    for step, following in itertools.pairwise(steps):
        child = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (step + 1 - len(node)))
            if node[step] is None:
                node[step] = child
            node = node[step]
        else:
            node = node.setdefault(step, child)
    last = steps[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value
