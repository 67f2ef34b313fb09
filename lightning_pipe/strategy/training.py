"""The training step: one pipeline step per batch inside Lightning's closure, the last stage's
logs relayed to every rank, and the drains of a non-flushing schedule (end of epoch, validation,
end of fit).

:class:`TrainingHooks` holds Lightning's training hooks of
:class:`~lightning_pipe.strategy.PipelineStrategy` (one of the parts the strategy's class is
assembled from, each a module of its own).
"""

from __future__ import annotations

import dis
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_pipe.runtime.batches import split_batch
from lightning_pipe.strategy.after_fit import HOW_TO_GET_IT
from lightning_pipe.strategy.batches import check_batches
from lightning_pipe.strategy.effects import metric_modules, replay
from lightning_pipe.strategy.fit_report import STEPS_SHOWN, FitReport, last_steps, run_directory
from lightning_pipe.strategy.logs import Record, combine, logged_metrics
from lightning_pipe.strategy.random_states import RandomStates
from lightning_pipe.strategy.stop_iteration import no_stop_iteration
from lightning_pipe.util.nested import concatenate, map_tensors

if TYPE_CHECKING:  # annotations only: the class differs under the standalone pytorch_lightning
    from lightning.pytorch import Trainer

__all__ = ["TrainingHooks"]


class TrainingHooks:
    """Lightning's training hooks of :class:`~lightning_pipe.strategy.PipelineStrategy`."""

    @no_stop_iteration
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One pipeline step for the batch (inside Lightning's closure), its logs replayed. Under
        ``accumulate_grad_batches=k`` the step updates on the batches Lightning steps the optimizer
        after (every ``k``-th of an epoch, and its last), and otherwise keeps its gradient for the next
        step; each micro-batch's loss is divided by ``k`` for the backward, as Lightning's closure
        divides the loss (not the losses logged and returned: Lightning divides the returned one itself)."""
        module = self.lightning_module
        args = (*args, *kwargs.values())
        self._step_starts.append(time.perf_counter())
        with self.precision_plugin.train_step_context():
            # every rank runs the step's code before forward, once: what it changes in the modules
            # (a gate's scale, a temperature) is then in place on every stage before any computes
            # the last stage's reruns of the step draw what this run draws (no other rank reruns it)
            random = RandomStates.now() if self.executor is None or self._last else RandomStates({})
            try:
                call = self._entry.capture(module.training_step, *args)
                random = random.drawn_since()
                if self.executor is not None:  # a built pipeline: the capture's graph holds the attributes
                    self._chain.refuse_changed_attributes()
            except Exception as error:  # the other ranks wait in the pipeline: they stop with it
                if self.executor is not None:
                    self.executor.stop(error)
                raise
            executor = self._pipeline(call, args[0])
            step = executor.next_step
            assert self._hyper is not None
            self._hyper.record(step)
            # the last stage reruns the step per micro-batch: forward must then get these rows (.contract),
            # exactly where the code before forward draws no random numbers (a draw per micro-batch differs)
            checked = self._last and not random.kept
            rows = split_batch(self._chain.inputs(call), executor.schedule.microbatches) if checked else None
            self._step_args[step] = (args[1:], random, rows)
            self._chain.follow_mode(module.training)
            inputs = self._chain.inputs(call) if self._first else None
            # a rank with no last stage has nothing to add after the step: its part leaves now, so
            # the gather is complete as soon as the last stage's part arrives
            posted = None if self._last else self._post_logs({})
            trainer = module.trainer
            update, accumulation = not trainer.fit_loop._should_accumulate(), trainer.accumulate_grad_batches
            start = time.perf_counter()
            output = executor.step(inputs, args[0] if self._last else None, update=update, accumulation=accumulation)
            self._step_seconds.append(time.perf_counter() - start)
            drained = self._drain_after_this_batch()
            if drained:
                output.microbatch_losses.update(executor.drain().microbatch_losses)
        if posted is None:
            posted = self._post_logs(output.microbatch_losses)
        self._relay_training_logs(posted, wait=drained or executor.schedule.flush or self._outputs_read)
        if not drained:  # schedule="auto": the in-run costs may choose another configuration (.calibrating)
            self._recalibrate()
        return map_tensors(lambda t: t.to(self.root_device), self._last_output)

    def _drain_after_this_batch(self) -> bool:
        trainer = self.lightning_module.trainer
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return True
        return 0 < trainer.max_steps <= trainer.global_step + 1

    def _post_logs(self, microbatch_losses: dict[tuple[int, int], float]) -> Any:
        """Start sending this call's micro-batch records (none but on a last stage) and this rank's
        signal notes to every rank."""
        assert self._signals is not None
        return self._log_relay.post(
            {
                "pipeline": self.pipeline_index,
                "rank": self.global_rank,
                "records": {key: (self._records.pop(key), loss) for key, loss in microbatch_losses.items()},
                "signals": self._signals.outgoing(),
            }
        )

    def _relay_training_logs(self, posted: Any, wait: bool) -> None:
        """Receive the records of ``posted`` (this call's gather) and log every step whose
        micro-batches are all in. A flushing schedule (and a drain) waits for them: the step's values
        are logged with the step. A non-flushing one collects them during the next call instead, so
        no rank waits for the last stage at a step boundary (the values are logged one step later)."""
        self._collect_relayed()
        if wait:
            self._collect(self._log_relay.wait(posted))
        else:
            self._posted = posted
        for step in sorted(s for s, parts in self._pending.items() if len(parts) == self.microbatches):
            parts = self._pending.pop(step)
            self._step_args.pop(step, None)
            records = [parts[mb][0] for mb in sorted(parts)]
            self._last_output = _step_output(math.fsum(loss for _, loss, _ in parts.values()), records)
            if any(sender != self.global_rank for _, _, sender in parts.values()):
                for record in records:
                    replay(self.lightning_module, record.effects, self.root_device)
            self._log(records)

    def _log(self, records: list[Record]) -> None:
        """Call the real ``self.log`` with what ``records`` logged, combined (every rank does)."""
        module = self.lightning_module
        for name, value, options in combine(records):
            module.log(name, torch.tensor(value), **options)
        metrics = metric_modules(module)
        for name, path, options in logged_metrics(records):
            module.log(name, metrics[path], **options)

    def _collect_relayed(self) -> None:
        """Receive the records left in flight by the last call (before any other collective)."""
        if self._posted is not None:
            posted, self._posted = self._posted, None
            self._collect(self._log_relay.wait(posted))

    def _collect(self, payloads: list[dict[str, Any]]) -> None:
        for payload in payloads:
            self._signals.collect(payload["signals"])
            if payload["pipeline"] == self.pipeline_index:
                for (step, mb), (record, loss) in payload["records"].items():
                    self._pending.setdefault(step, {})[mb] = (record, loss, payload["rank"])

    def on_train_start(self) -> None:
        """Refuse, before the first step, training batches too small to cut into micro-batches."""
        trainer = self.lightning_module.trainer
        loaders = getattr(trainer.fit_loop._combined_loader, "flattened", [])
        check_batches(loaders, self.microbatches, trainer.num_training_batches)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Act on the signals the relay has brought every rank (:mod:`.signals`): all ranks at the
        same batch."""
        assert self._signals is not None
        self._signals.act()

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The backward already ran in the pipeline step; only the hooks around it run here,
        ``on_after_backward`` with the step's gradients where it holds its updates (:mod:`.gradient_hooks`)."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self._gradients_shown():
            return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (the pipeline step, updates included, or held for ``on_before_optimizer_step``:
        :mod:`.gradient_hooks`). The user's optimizer then steps with no gradient, which changes
        nothing and tells its LR schedulers that the step happened."""
        result = closure()
        self._before_optimizer_step(optimizer)
        optimizer.step()
        return result

    def drain(self) -> None:
        """Finish the steps in flight (a collective; nothing for a flushing schedule), then receive the
        logs the last call left in flight; their logs are kept for the next training step. In that
        order: a rank may still be inside its last call, waiting for a collective this rank makes only
        in its drain (a tied weight's gradient sum), before it posts the logs this rank waits for (a
        fit stopped between epochs' ends, by ``EarlyStopping`` or ``trainer.should_stop``, hung so)."""
        if self.executor is None:
            return
        if self.executor.calls:
            self.executor.drain()
        self._collect_relayed()

    def on_validation_start(self) -> None:
        self.drain()

    def on_train_end(self) -> None:
        self.drain()
        self._keep_loss_scale()
        self._report_fit()
        if self._writers is None:  # nothing was released: every rank holds the whole model
            return
        if self.gather_after_fit:
            self._full_after_fit = self.broadcast(self.full_tensors())  # put in place at teardown
        else:
            rank_zero_info(f"After fit, {HOW_TO_GET_IT}")

    def _report_fit(self) -> None:
        """The end-of-fit report (:mod:`.fit_report`): a collective; written and logged by global rank 0."""
        self._keep_calibration()
        executor = self.executor
        if executor is None or executor.origin < STEPS_SHOWN:
            return
        since = executor.origin - STEPS_SHOWN
        in_run = executor.measured_costs(since_step=since)
        timelines = self._gather([i for i in executor.timeline.since(since) if i.action.step >= since])
        trainer = self.lightning_module.trainer
        logged = trainer.log_dir  # a collective (broadcast): every rank asks
        if self.global_rank != 0:
            return
        # the logger's directory; without one, a directory of this run's own (never the working directory)
        directory = Path(logged) if trainer.loggers and logged else run_directory(Path(trainer.default_root_dir))
        fit = FitReport(
            last_steps([i for part in timelines for i in part]),
            self._step_seconds[2:],
            in_run,
            self._schedule_maker(self.stage_plan)(STEPS_SHOWN),
            self._prediction,
        )
        picture, trace = fit.write(directory)
        for logger in trainer.loggers:
            logger.log_metrics(fit.metrics, step=trainer.global_step)
        rank_zero_info(f"{fit.summary()}; timeline {picture}, trace {trace}")


def reads_step_outputs(trainer: Trainer) -> bool:
    """Whether the module or a callback of the user's reads ``outputs`` in ``on_train_batch_end``
    (what ``training_step`` returned): a non-flushing schedule then waits, at the end of each batch,
    for the batch's loss instead of reporting it with the next batch."""
    hooks = [type(trainer.lightning_module).on_train_batch_end]
    hooks += [
        type(callback).on_train_batch_end
        for callback in trainer.callbacks
        if not type(callback).__module__.startswith(("lightning.", "pytorch_lightning."))
    ]
    return any(_reads_argument(hook, "outputs") for hook in hooks)


def _reads_argument(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function``'s body reads its parameter ``name``."""
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
        return False
    return any(i.opname.startswith("LOAD_FAST") and name in str(i.argval) for i in dis.get_instructions(code))


def _step_output(loss: float, records: list[Record]) -> Any:
    """What a step returns to Lightning (``outputs`` of ``on_train_batch_end``): the batch's loss, and
    the other keys of the dict ``training_step`` returned, its micro-batches' values joined."""
    kept = [record for record in records if record.extras is not None]
    if not kept:
        return torch.tensor(loss)
    return {"loss": torch.tensor(loss), **concatenate([r.extras for r in kept], [r.rows for r in kept])}
