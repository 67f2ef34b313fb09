"""How the strategy starts its processes when Lightning starts them (not torchrun or SLURM).

- ``popen``: Lightning's :class:`_SubprocessScriptLauncher`, re-running the user's script for every
  other process, as ``ddp`` does.
- ``spawn``: Lightning's :class:`_MultiProcessingLauncher` (notebooks; Hydra multiruns, whose jobs
  run inside one process).
- ``forkserver``: the same launcher and the same semantics as ``spawn``, but each process is forked
  from a server that imported torch, Lightning and this package once
  (:func:`lightning_pipe.runtime.launch.preloading_forkserver`): a spawned process spends about 10 s
  of CPU importing them (2026-11-28, 2 cores), a forked one milliseconds: a multirun of N jobs, each
  fitting and testing on 2 processes, imports them once in the server instead of 4N times.
  Lightning treats a forkserver child like a forked one, but it starts from the server's state, not
  the caller's, so this launcher hands each child what a spawned one gets: the caller's environment
  as it is at the launch (``MASTER_PORT``, the seed Lightning keeps in ``PL_GLOBAL_SEED``, anything
  the user set after the server started), the random generators and deterministic flags, and CPU
  modules not shared with the other processes.

Both launchers first resolve ``ckpt_path="last"`` to the newest complete checkpoint (:mod:`.resume`),
and the multiprocessing one hands the main process the full trained model.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing,
    _GlobalStateSnapshot,
)
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipe.runtime.launch import adopt_environment, preloading_forkserver
from lightning_pipe.strategy.atomic import write_file
from lightning_pipe.strategy.resume import complete_last

__all__ = ["ProcessLauncher", "ScriptLauncher"]


def _global_states() -> _GlobalStateSnapshot:
    """What Lightning hands a spawned process (deterministic flags, random states), without the CUDA
    generators' states where this process has not initialised CUDA: reading them would create a CUDA
    context here, in a process that trains on no device, and the processes make their own."""
    return _GlobalStateSnapshot(
        use_deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        use_deterministic_algorithms_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn_benchmark=torch.backends.cudnn.benchmark,
        rng_states=_collect_rng_states(include_cuda=torch.cuda.is_initialized()),
    )


def _check_main_guard() -> None:
    """Refuse, with what to do, a script that starts its fit again in each process: a forkserver's
    processes, as spawned ones, import the script first (multiprocessing's ``_inheriting``: this
    process is still being set up), and Python's own error does not say why."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(
            "start_method='forkserver' starts each process by importing your script, which then reached "
            'Trainer.fit again: put the code that trains under `if __name__ == "__main__":` (as spawn needs), '
            "or use start_method='popen', which re-runs the script as Lightning's ddp does"
        )


class _ResumesFromComplete:
    """A launcher that resolves ``ckpt_path="last"`` to the newest complete checkpoint before
    Lightning does (:mod:`.resume`)."""

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            args, kwargs = complete_last(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class ScriptLauncher(_ResumesFromComplete, _SubprocessScriptLauncher):
    """Lightning's launcher that re-runs the script."""


class ProcessLauncher(_ResumesFromComplete, _MultiProcessingLauncher):
    """Lightning's multiprocessing launcher (``spawn`` or ``forkserver``), handing the main process
    the full trained model: its rank 0 holds only its own stages, so the weights it sends are gathered
    from every rank (and written atomically)."""

    _environment: dict[str, str] | None = None
    _global_states: _GlobalStateSnapshot | None = None

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if self._start_method == "forkserver":
            _check_main_guard()
            preloading_forkserver()
            assert self._strategy.cluster_environment is not None
            os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)  # as Lightning's launch
            self._environment = dict(os.environ)  # travels with this launcher to every process
            self._global_states = _global_states()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(
        self,
        process_idx: int,
        trainer: Trainer | None,
        function: Callable[..., Any],
        args: Any,
        kwargs: Any,
        return_queue: Any,
        global_states: _GlobalStateSnapshot | None = None,
    ) -> None:
        if self._environment is not None:  # a forkserver child: start from the caller's state, as spawn does
            adopt_environment(self._environment)
            global_states = self._global_states
            if isinstance(self._strategy.accelerator, CPUAccelerator):  # pickled tensors come in shared memory
                args, kwargs = _disable_module_memory_sharing((args, kwargs))
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        fitted = trainer.state.fn == TrainerFn.FITTING  # Lightning sends weights back only after fit
        full = self._strategy.full_state_dict() if fitted else None  # a collective: every rank
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            write_file(output.weights_path, lambda handle: torch.save(full, handle))
        return output
