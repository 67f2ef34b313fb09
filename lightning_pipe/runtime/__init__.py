"""The multi-process runtime: one process per worker runs its part of any schedule of the IR with its
update rule, with or without Lightning (:class:`PipelineExecutor` in :mod:`.executor`; docs/runtime.md).
Its modules, by what they do:

- **what a worker runs**: :mod:`.program` (each worker's calls, from a schedule), :mod:`.routing`
  (where each action runs and where its messages go), :mod:`.forward_backward` (one micro-batch's
  forward and backward on a stage; :mod:`.split_backward`, a backward in two halves) over the
  micro-batches of :mod:`.batches`, and :mod:`.step_output` (what a call returns);
- **weights and updates**: :mod:`.weights` (a stage's weight versions, its accumulated gradients and
  the replicas' all-reduce of them), :mod:`.versions_kept` (which versions an update keeps),
  :mod:`.updates` (a stage's update, with :mod:`.ties`, :mod:`.loss_scaling` and :mod:`.clipping`),
  :mod:`.out_of_place` (an SGD step that leaves the old weights in place), :mod:`.batch_norm` (batch
  norm's running statistics over the whole mini-batch);
- **the families that move weights or gradients**: :mod:`.borrowing` (FSDP and FSLPP lend a stage's
  weights), :mod:`.gradient_rings` and :mod:`.stage_relays` (CDP's dp and ZeRO forms);
- **messages**: :mod:`.transport` (point to point), :mod:`.shared_memory` and
  :mod:`.shared_memory_sizes` (rings between the CPU processes of one host), :mod:`.groups` (process
  groups);
- **processes**: :mod:`.launch` (local processes joined by gloo; :mod:`.frozen_preload`),
  :mod:`.failure` (every rank stops when one fails), :mod:`.garbage` (collections at the same call on
  every rank), :mod:`.affinity` (threads pinned to cores), :mod:`.allocator` (glibc's heap);
- **measured for the prediction**: :mod:`.timeline` (the actions run, kept out of the garbage
  collector's way), :mod:`.calibration` (stage costs in a running pipeline from it),
  :mod:`.activation_memory`, :mod:`.contention`, :mod:`.link_speed`.
"""

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.failure import PipelineAborted
from lightning_pipe.runtime.launch import LocalRunError, run_local
from lightning_pipe.runtime.step_output import StepOutput

__all__ = ["LocalRunError", "PipelineAborted", "PipelineExecutor", "StepOutput", "run_local"]
