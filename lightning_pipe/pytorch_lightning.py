"""``PipelineStrategy`` for the standalone ``pytorch_lightning`` package.

``lightning.pytorch`` (the ``lightning`` package) and ``pytorch_lightning`` hold the same code under two
names, with two class hierarchies: a ``pytorch_lightning.Trainer`` takes only strategies derived from
``pytorch_lightning``'s ``Strategy``. This module is :mod:`lightning_pipe.strategy.strategy` built
against ``pytorch_lightning`` (its imports of ``lightning.pytorch`` and ``lightning.fabric`` read as
``pytorch_lightning`` and ``lightning_fabric``, as the ``lightning`` package itself is generated), so
both packages run the same strategy. Importing :mod:`lightning_pipe` registers its names
(``strategy="pipe_2bw"``, ...) with ``pytorch_lightning`` too when that package is installed; an
instance comes from here::

    import pytorch_lightning as pl
    from lightning_pipe.pytorch_lightning import PipelineStrategy

    pl.Trainer(strategy=PipelineStrategy("2bw", microbatches=8), devices=2)
"""

from pathlib import Path

from lightning_pipe.strategy import strategy as _lightning

_RENAMED = (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric"))


def _standalone_source() -> str:
    source = Path(_lightning.__file__).read_text()
    for old, new in _RENAMED:
        source = source.replace(f"from {old}", f"from {new}").replace(f"import {old}", f"import {new}")
    return source


exec(compile(_standalone_source(), _lightning.__file__, "exec"), globals())
