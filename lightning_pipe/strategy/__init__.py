"""The Lightning strategy (:class:`PipelineStrategy` in :mod:`.strategy`; docs/strategy.md) and what it
builds on (planning at set-up is :mod:`lightning_pipe.planning`). Its modules, by what they do:

- **set-up**: :mod:`.arguments` (checked when the strategy is made), :mod:`.launchers` (the processes),
  :mod:`.topology` (where each pipeline sits among the ranks), :mod:`.connection` (the default
  process group, opened again after a failed fit), :mod:`.refusals` (the Trainer's settings it cannot
  run), :mod:`.contract` (the model contract),
  :mod:`.building` (the pipeline, built on the first batch), with :mod:`.materialise` (a model built on
  the meta device), :mod:`.ownership` (each rank holds only its stages), :mod:`.optimizers`,
  :mod:`.compiling`, :mod:`.recomputation`, :mod:`.batches` (batches that cannot be cut) and
  :mod:`.differences` (what differs from plain Lightning, said at set-up);
- **the prediction and the choice**: :mod:`.step_prices` and :mod:`.profile_basis` (what the printed
  prediction prices beyond the profile), :mod:`.choosing` (``schedule="auto"``'s first choice),
  :mod:`.calibrating` and :mod:`.trials` (what the first steps measure, and the switch);
- **training**: :mod:`.training` (the step), :mod:`.gradient_hooks` (the hooks that read the
  gradients before the update), :mod:`.logs` and :mod:`.log_relay` (``self.log`` from the last stage),
  :mod:`.effects`, :mod:`.random_states`, :mod:`.collectives`,
  :mod:`.stop_iteration`, :mod:`.signals` (preemption), :mod:`.parent_watch`;
- **evaluation and after fit**: :mod:`.evaluation`, :mod:`.after_fit`, :mod:`.fit_report`;
- **checkpoints**: :mod:`.checkpointing`, :mod:`.sharded`, :mod:`.saving`, :mod:`.atomic`,
  :mod:`.checkpoint_files`, :mod:`.resume`, :mod:`.pipeline_state`.
"""

from lightning_pipe.strategy.strategy import PipelineStrategy

__all__ = ["PipelineStrategy"]
