"""Validation, test and predict: a forward-only pipeline over the stages, the step code run once on
the whole batch on the last stage, its logs and results given to every rank.

:class:`EvaluationHooks` holds Lightning's evaluation hooks of
:class:`~lightning_pipe.strategy.PipelineStrategy` (one of the parts the strategy's class is
assembled from, each a module of its own).
"""

from __future__ import annotations

import contextlib
from typing import Any

from lightning_pipe.runtime.batches import part_rows, rows_of
from lightning_pipe.strategy.effects import replay
from lightning_pipe.strategy.logs import Record, recording
from lightning_pipe.strategy.random_states import RandomStates, replayed
from lightning_pipe.strategy.stop_iteration import no_stop_iteration
from lightning_pipe.util.nested import concatenate, map_tensors, to_cpu

__all__ = ["EvaluationHooks"]


class EvaluationHooks:
    """Lightning's evaluation hooks of :class:`~lightning_pipe.strategy.PipelineStrategy`."""

    def _evaluate(self, hook: str, args: tuple[Any, ...]) -> tuple[Record | None, Any]:
        """A forward-only pipeline for ``hook`` (``validation_step``, ...): the batch flows through the
        stages in micro-batches, and on the last stage the step code runs once on the whole batch with
        the joined outputs, so what it logs or returns is what the unsplit step gives (exactly: no
        combination of micro-batches). Returns the step's record and result (``None`` elsewhere)."""
        module = self.lightning_module
        step_code = getattr(module, hook)
        # the step's code before forward runs once per batch, on the ranks that need its arguments
        call, random = None, None
        if self.executor is None or self._evaluates(0):
            # a rerun of the step below (on this rank if it evaluates the last stage) draws what this run draws
            random = RandomStates.now() if self.executor is None or self._evaluates(-1) else RandomStates({})
            call = self._entry.capture(step_code, *args)
            random = random.drawn_since()
        executor = self._pipeline(call, args[0]) if call is not None else self.executor
        assert executor is not None
        self.drain()
        self._chain.follow_mode(module.training)
        parts = 1 if self._chain.batch_reduced else min(self.microbatches, rows_of(args[0]))
        outputs: list[Any] = []
        inputs = self._chain.inputs(call) if self._evaluates(0) else None
        executor.evaluate(inputs, parts, lambda mb, output: outputs.append(output))
        if not self._evaluates(-1):
            return None, None
        record = Record(rows_of(args[0]))
        rerun = replayed(random) if random is not None else contextlib.nullcontext()
        with (
            rerun,
            self._entry.inject(concatenate(outputs, part_rows(rows_of(args[0]), parts))),
            recording(module, record),
        ):
            result = step_code(*args)
        return record, result

    def _replay(self, record: Record | None, result: Any) -> Any:
        """Make the last stage's evaluation step seen on every rank: its logs, its other effects
        (:mod:`.effects`) and its result."""
        gathered = self._gather((record, to_cpu(result)) if record is not None else None)
        source = next(i for i, part in enumerate(gathered) if part is not None)
        record, result = gathered[source]
        if self.pipelines[self.pipeline_index][source] != self.global_rank:
            replay(self.lightning_module, record.effects, self.root_device)
            result = map_tensors(lambda t: t.to(self.root_device), result)
        self._log([record])
        return result

    @no_stop_iteration
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            record, result = self._evaluate("validation_step", (*args, *kwargs.values()))
        return self._replay(record, result)

    @no_stop_iteration
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            record, result = self._evaluate("test_step", (*args, *kwargs.values()))
        return self._replay(record, result)

    @no_stop_iteration
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's predictions, on every rank (from the last stage)."""
        with self.precision_plugin.predict_step_context():
            _, result = self._evaluate("predict_step", (*args, *kwargs.values()))
        gathered = self._gather((self._evaluates(-1), to_cpu(result)))
        return next(value for last, value in gathered if last)
