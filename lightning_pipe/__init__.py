"""lightning_pipe: pipeline-parallel training for PyTorch Lightning.

Importing the package registers the strategy's names with Lightning (``Trainer(strategy="pipe_2bw")``),
with both ``lightning.pytorch`` and, when it is installed, the standalone ``pytorch_lightning``
(whose instances come from :mod:`lightning_pipe.pytorch_lightning`).
"""

import importlib.util

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.capture import pipe_split
from lightning_pipe.cost.records import ChainCosts, LayerCost
from lightning_pipe.errors import PipelineRuntimeError, PlanningError
from lightning_pipe.moved import install as _install_moved_paths
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.strategy.sharded import consolidate

_install_moved_paths()
PipelineStrategy.register_strategies(StrategyRegistry)
if importlib.util.find_spec("pytorch_lightning") is not None:
    from pytorch_lightning.strategies import StrategyRegistry as _StandaloneRegistry

    from lightning_pipe.pytorch_lightning import PipelineStrategy as _Standalone

    _Standalone.register_strategies(_StandaloneRegistry)

__all__ = [
    "ChainCosts",
    "LayerCost",
    "PipelineRuntimeError",
    "PipelineStrategy",
    "PlanningError",
    "consolidate",
    "pipe_split",
]
__version__ = "0.1.0"
