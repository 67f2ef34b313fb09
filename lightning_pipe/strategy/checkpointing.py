"""Checkpoints in Lightning's own layout: the module's and the optimizer's state gathered by name
(``full``) or written by each rank (``sharded``, :mod:`.sharded`), saved atomically by every rank
together (:mod:`.saving`), and read back by name on any split (:mod:`.checkpoint_files`).

:class:`CheckpointHooks` holds Lightning's checkpoint hooks of
:class:`~lightning_pipe.strategy.PipelineStrategy` (one of the parts the strategy's class is
assembled from, each a module of its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.errors import CheckpointError, PipelineRuntimeError, PlanningError
from lightning_pipe.strategy.after_fit import fill, named_tensors, unsaved_buffers
from lightning_pipe.strategy.atomic import remove, sweep, write_file
from lightning_pipe.strategy.checkpoint_files import check_same_model, load_checkpoint
from lightning_pipe.strategy.ownership import group_names, parameter_names
from lightning_pipe.strategy.pipeline_state import PipelineState, SavedPlan, StageSummary
from lightning_pipe.strategy.saving import SaveRanks, save_together
from lightning_pipe.strategy.sharded import read_entries, save_sharded
from lightning_pipe.util.nested import to_cpu

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """Lightning's checkpoint hooks of :class:`~lightning_pipe.strategy.PipelineStrategy`."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of the module: ``full``: :meth:`full_state_dict`; ``sharded``: the
        entries this rank writes (a collective: drains first)."""
        if self.state_dict_type == "full":
            return self.full_state_dict()
        return self._written_state()

    def full_state_dict(self) -> dict[str, Any]:
        """The whole module's state on global rank 0 (on the CPU), gathered by name from the ranks
        holding each entry (a collective: drains first); ``{}`` on the other ranks, which hold only
        their stages."""
        return self._gathered_whole(unsaved=False)

    def full_tensors(self) -> dict[str, Any]:
        """:meth:`full_state_dict` with the buffers the state dict leaves out
        (:func:`~lightning_pipe.strategy.after_fit.unsaved_buffers`), each from a rank holding its
        value: what the module computes with, whole (a collective; ``{}`` on the other ranks)."""
        return self._gathered_whole(unsaved=True)

    def _gathered_whole(self, unsaved: bool) -> dict[str, Any]:
        """Every state-dict entry from the rank that writes it, in the state dict's order, and with
        ``unsaved`` the buffers the state dict leaves out from the ranks holding them: one gather to
        global rank 0 (``{}`` on the other ranks)."""
        module = self.lightning_module
        part = self._written_state()
        if unsaved:
            part |= {name: b for name, b in unsaved_buffers(module).items() if not b.is_meta}
        merged = self._merged_on_zero(part)
        if merged is None:
            return {}
        return {**{name: merged[name] for name in module.state_dict(keep_vars=True)}, **merged}

    def whole_again(self) -> None:
        """Give the module every rank's tensors back (a collective), where an earlier fit left each
        rank holding only its stages (:func:`~lightning_pipe.strategy.after_fit.guard`): this fit
        captures and splits it anew, and a capture runs the whole model. Each rank held the whole
        model when the earlier fit set up, so this takes no more memory than that did. A checkpoint
        restored meanwhile (before set-up, into the tensors this rank held) keeps its values."""
        module = self.lightning_module
        merged = self._merged_on_zero({name: t for name, t in named_tensors(module).items() if not t.is_meta})
        fill([module], module, self.broadcast(merged or {}))
        self._load_deferred()
        rank_zero_info(
            f"{type(module).__name__} held only each rank's stages since an earlier fit: the other ranks' tensors "
            "were gathered back into it before it is split anew"
        )

    def _merged_on_zero(self, part: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank's ``part`` (tensors by name, copied to the CPU) merged on global rank 0, an
        entry several ranks hold taken from the lowest of them (``None`` on the other ranks)."""
        parts = self._gather_to_zero(to_cpu(part))
        if parts is None:
            return None
        merged: dict[str, Any] = {}
        for each in parts:
            for name, value in each.items():
                merged.setdefault(name, value)
        return merged

    def _written_state(self) -> dict[str, Any]:
        """The state-dict entries this rank writes, after the steps in flight are finished."""
        self.drain()
        self._keep_loss_scale()  # Lightning saves the precision plugin's state after the module's
        return {name: value for name, value in self.lightning_module.state_dict().items() if self._written(name)}

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Load the entries this rank holds (every entry before the stages are placed; those of a
        model on the meta device once its stages are materialised); with ``strict`` the checkpoint
        must name every entry of the module and no other, with the module's shapes."""
        self._reopen_for_restore()
        module = self.lightning_module
        held = module.state_dict(keep_vars=True)
        state: Mapping[str, Any] = checkpoint["state_dict"]
        source = getattr(self, "_checkpoint_path", None) or "the checkpoint"
        if strict:
            check_same_model(source, type(module).__name__, held, state)
        present = [name for name in held if name in state]
        try:
            module.load_state_dict(read_entries(state, [n for n in present if not held[n].is_meta]), strict=False)
        except RuntimeError as error:
            raise CheckpointError(f"{source} does not fit {type(module).__name__}: {error}") from error
        later = [name for name in present if held[name].is_meta]
        self._deferred = (state, later) if later and self.executor is None else None

    def _reopen_for_restore(self) -> None:
        """A checkpoint restored after the pipeline ran (Lightning's learning-rate finder and batch-size
        scaler restore the one they saved before their trial steps): the pipeline is drained and
        closed, and the next batch builds it again on the same split from the restored values (its
        weight versions, gradients and optimizer states the checkpoint's)."""
        if self.executor is not None:
            self.drain()
            self._close_executor()

    def _load_deferred(self) -> None:
        """The resumed checkpoint's entries for the tensors this rank has just materialised."""
        if self._deferred is None:
            return
        (state, names), self._deferred = self._deferred, None
        held = self.lightning_module.state_dict(keep_vars=True)
        real = [name for name in names if not held[name].is_meta]
        self.lightning_module.load_state_dict(read_entries(state, real), strict=False)

    def optimizer_state(self, optimizer: Any, whole: bool = False) -> dict[str, Any]:
        """The user's optimizer's state by parameter, with the pipeline's entry (``["pipeline"]``,
        :class:`~.pipeline_state.PipelineState`): the plan and each stage's carried state (step count,
        weight versions). ``full``: on global rank 0, in Lightning's layout, every parameter's state
        gathered by name from the stage optimizers (a collective), so that any run resumes it: plain
        Lightning, DDP, or a pipeline on another split; ``{}`` on the other ranks. ``sharded``: this
        rank's parameters' states and carried state, by name. ``whole``: as ``full`` whatever the
        checkpoints are (a switch of configuration gathers it so, :mod:`.calibrating`)."""
        sharded = self.state_dict_type == "sharded" and not whole
        first = self.pipeline_index == 0
        states = self._parameter_states() if first else {}
        carried = self._carried_state() if first else {}
        stages: dict[int, Any] = carried.get("stages", {})
        summary = {s: StageSummary.of(e) for s, e in stages.items()}
        part = {"states": states, "carried": stages} if not sharded else {"states": {}, "carried": {}}
        parts = self._gather_to_zero({**part, "summary": summary})
        if sharded:
            state = {"state": states, "param_groups": self._named_groups(optimizer)}
        elif parts is None:
            return {}
        else:
            by_name = {name: value for part in parts for name, value in part["states"].items()}
            state = dict(optimizer.state_dict())
            state["state"] = {i: by_name[name] for i, name in enumerate(self._template_names) if name in by_name}
            stages = {stage: entry for part in parts for stage, entry in part["carried"].items()}
        if stages:
            assert self.stage_plan is not None
            PipelineState(
                plan=SavedPlan.of(self.stage_plan),
                schedule=self.schedule_options.family,
                calls=carried["calls"],
                origin=carried["origin"],
                stages={s: e for part in parts or [] for s, e in part["summary"].items()},
                carried={str(stage): entry for stage, entry in stages.items()},
            ).write(state)
        return state

    def _named_groups(self, optimizer: Any) -> list[dict[str, Any]]:
        """The optimizer's parameter groups with each parameter's name in place of its position."""
        groups = optimizer.state_dict()["param_groups"]
        return [{**group, "params": [self._template_names[i] for i in group["params"]]} for group in groups]

    def _parameter_states(self) -> dict[str, Any]:
        """The optimizer state of each parameter this rank writes, by name, on the CPU: its stage
        optimizers' (or, once they are closed, the user's optimizer's, which holds them then)."""
        if self.executor is not None:
            sources = [optimizer.state for optimizer in self.executor.stage_optimizers]
        else:
            sources = [optimizer.state for optimizer in self.optimizers]
        names = parameter_names(self.lightning_module)
        return {
            names[id(p)]: to_cpu(value)
            for source in sources
            for p, value in source.items()
            if id(p) in names and self._written(names[id(p)])
        }

    def _carried_state(self) -> dict[str, Any]:
        """Step count and, per stage of this rank, its carried state (weight versions and gradients of
        a non-flushing schedule; the first worker of a replicated stage gives it). A flushing schedule's
        gradient accumulated over the batches since the last update (``accumulate_grad_batches``, a
        checkpoint written mid-accumulation) is left out, as Lightning saves no gradients: a resumed run
        accumulates from zero the batches left before the update, as plain Lightning's does."""
        if self.executor is None:
            return self._carried or {}
        state = self.executor.state_dict(weights=False)
        if self.executor.schedule.flush:
            for entry in state["stages"].values():
                entry["gradients"] = {}
        state = to_cpu(state)
        state["stages"] = {s: e for s, e in state["stages"].items() if self.executor.is_first_owner(s)}
        return state

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """The user's optimizer takes the hyper-parameters; each parameter's state (found by name)
        waits for the stage optimizers, and the plan and carried state for the first batch."""
        (state,) = checkpoint["optimizer_states"]
        self._reopen_for_restore()
        template = self.optimizers[0]
        groups = state["param_groups"]
        saved_sizes = [len(group["params"]) for group in groups]
        sizes = [len(group["params"]) for group in template.param_groups]
        if saved_sizes != sizes:
            raise PlanningError(
                f"the checkpoint's optimizer has parameter groups of {saved_sizes} parameters, configure_optimizers "
                f"gives {sizes}: resume with the optimizer the checkpoint was written with"
            )
        named = any(isinstance(p, str) for group in groups for p in group["params"])
        if named:  # a sharded checkpoint: by name already
            self._saved_states = state["state"]
        else:
            names = self._template_names
            self._saved_states = {names[i]: value for i, value in state["state"].items() if names[i] is not None}
        start, positions = 0, []
        for size in sizes:
            positions.append(list(range(start, start + size)))
            start += size
        template.load_state_dict(
            {"state": {}, "param_groups": [{**g, "params": p} for g, p in zip(groups, positions, strict=True)]}
        )
        self._saved = PipelineState.read(state, getattr(self, "_checkpoint_path", None) or "the checkpoint")

    def _restore_optimizer_states(self) -> None:
        """Each stage optimizer takes its parameters' states from the resumed checkpoint, by name."""
        states, self._saved_states = self._saved_states, None
        if states is None or self.executor is None:
            return
        names = parameter_names(self.lightning_module)
        for optimizer in self.executor.stage_optimizers:
            params = group_names(optimizer, names)
            found = read_entries(states, [name for name in params if name is not None])
            own = optimizer.state_dict()
            own["state"] = {i: found[name] for i, name in enumerate(params) if name in found}
            optimizer.load_state_dict(own)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Save on every rank (a collective, :mod:`.saving`): ``full``, global rank 0 writes the file;
        ``sharded``, every rank writes its trees into the directory ``filepath`` (:mod:`.sharded`),
        global rank 0 the rest of the checkpoint. The checkpoint appears under its name only once
        complete (:mod:`.atomic`); a save that fails anywhere raises on every rank. Every rank writes to
        global rank 0's ``filepath``."""
        path = str(filepath)
        if not _is_local_file_protocol(path):
            if self.state_dict_type == "sharded":
                raise PipelineRuntimeError(
                    f"state_dict_type='sharded' writes to a local or mounted filesystem, not {path}"
                )
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if self.state_dict_type == "full":
            save_together(path, lambda _, __: self._write_file(checkpoint, path, storage_options), False, self._ranks)
            return
        if storage_options is not None:
            raise TypeError(f"state_dict_type='sharded' takes no storage_options (got {storage_options!r})")
        trees = {"state_dict": checkpoint.pop("state_dict")}
        if checkpoint.get("optimizer_states"):
            (state,) = checkpoint["optimizer_states"]
            trees["optimizer"] = state.pop("state")
            pipeline = PipelineState.read(state, path)
            if pipeline is not None:  # its carried state goes into the rank files, the rest into meta.pt
                trees["carried"] = pipeline.carried
                pipeline.with_carried(None).write(state)

        def write(directory: Path | None, save: str) -> None:
            assert directory is not None
            stamp = {"save": save, "step": checkpoint.get("global_step")}
            save_sharded(directory, checkpoint, trees, stamp, self.is_global_zero, self._objects)

        save_together(path, write, True, self._ranks)

    def _write_file(self, checkpoint: dict[str, Any], path: str, storage_options: Any | None) -> None:
        """Global rank 0 writes the full checkpoint: atomically with Lightning's default checkpoint
        IO (a temporary beside it, renamed), or through the ``CheckpointIO`` the user gave."""
        if not self.is_global_zero:
            return
        if type(self.checkpoint_io) is self.plain_checkpoint_io and storage_options is None:
            write_file(path, lambda handle: torch.save(checkpoint, handle))
        else:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)

    @property
    def _ranks(self) -> SaveRanks:
        """Every rank of the job, as a save sees them."""
        if not hasattr(self, "_objects") or self.world_size == 1:
            return SaveRanks(self.global_rank)
        return SaveRanks(self.global_rank, self._objects, self._failures.aborted)

    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Global rank 0 deletes a checkpoint file or directory; a directory is renamed first, so no
        half-deleted checkpoint is ever seen under its name."""
        if not self.is_global_zero:
            return
        if _is_local_file_protocol(filepath) and type(self.checkpoint_io) is self.plain_checkpoint_io:
            remove(filepath)
        else:
            self.checkpoint_io.remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint directory is read on demand (each rank reads its own entries once
        its stages are placed); a single file as Lightning reads it. Either is refused, named, when
        it is incomplete, damaged or mixes parts of several saves (:mod:`.checkpoint_files`)."""
        if not _is_local_file_protocol(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        sweep(Path(checkpoint_path).parent)
        self._checkpoint_path = str(checkpoint_path)
        read = super().load_checkpoint
        return load_checkpoint(checkpoint_path, lambda: read(checkpoint_path, weights_only), weights_only)

    def _gather_to_zero(self, part: Any) -> list[Any] | None:
        """Every rank's ``part`` on global rank 0 (``None`` on the others)."""
        if not hasattr(self, "_objects"):  # the ranks never connected (a failure at start-up): this one's
            return [part] if self.global_rank == 0 else None
        gathered: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        try:  # to rank 0 only, which writes the checkpoint: the other ranks need no copy of every stage
            dist.gather_object(part, gathered, dst=0, group=self._objects)
        except RuntimeError as error:
            raise self._failures.aborted() from error
        return gathered
