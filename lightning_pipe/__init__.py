"""lightning_pipe: pipeline-parallel training for PyTorch Lightning."""

from lightning_pipe.costs import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError

__all__ = ["ChainCosts", "LayerCost", "PlanningError"]
__version__ = "0.1.0"
