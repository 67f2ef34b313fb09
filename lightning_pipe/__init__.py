"""lightning_pipe: pipeline-parallel training for PyTorch Lightning.

Importing the package registers the strategy's names with Lightning (``Trainer(strategy="pipe_2bw")``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.costs import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError
from lightning_pipe.strategy import PipelineStrategy

PipelineStrategy.register_strategies(StrategyRegistry)

__all__ = ["ChainCosts", "LayerCost", "PipelineStrategy", "PlanningError"]
__version__ = "0.1.0"
