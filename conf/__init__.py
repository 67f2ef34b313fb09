"""The configuration of ``lightning-pipe-train`` (Hydra config groups; schemas in
:mod:`lightning_pipe.train.config`). Packaged as ``lightning_pipe.conf``."""
