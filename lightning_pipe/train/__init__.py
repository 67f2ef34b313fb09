"""``lightning-pipe-train`` (also ``python -m lightning_pipe.train``): training from the command line
with Hydra. The configuration is composed from the groups in ``conf/`` (schemas in
:mod:`~lightning_pipe.train.config`), the objects built by :mod:`~lightning_pipe.train.build` and
the job run by :mod:`~lightning_pipe.train.app`."""

from lightning_pipe.train.app import main

__all__ = ["main"]
