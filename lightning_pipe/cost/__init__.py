"""What a model costs, layer by layer: the planner's input.

The profiler measures each captured layer on the device (:mod:`.profiler`, the bytes autograd keeps
for the backward from :mod:`.saved_bytes`; a meta-device model's times from its FLOPs at the matmul
rate of :mod:`.flop_rate`) into cost records (:mod:`.records`), which profile files save and load
(:mod:`.profile_file`, PipeDream's ``graph.txt`` through :mod:`.pipedream_graph`) and runs keep
(:mod:`.profile_cache`, with the load of :mod:`.machine_load` they were measured under). The
memory model of a stage under a schedule (:mod:`.memory`, a layer's backward from
:mod:`.backward_bytes`) and the network between devices (:mod:`.network`) complete what a partitioner
weighs; :mod:`.allocated` measures what a run allocates on any device, against which the memory
model is checked. The printed prediction also prices each stage's optimizer update (:mod:`.update_rate`), what
earlier runs of the model measured beyond the profile (:mod:`.calibrated`), and, for a model's first
fit, the training loop's own time earlier fits of any model measured (:mod:`.loop_time`) and the rate
of the actions fits of other models measured (:mod:`.machine_rate`).
"""

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts, LayerCost

__all__ = ["ChainCosts", "LayerCost", "MemoryModel", "Network"]
