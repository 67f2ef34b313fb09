"""``transformers``' generation cache, off while ``forward`` is captured and checked.

A ``transformers`` model called as its documentation shows builds a key/value cache in ``forward``
when its config's ``use_cache`` is on (the default of most decoders): a ``DynamicCache`` that every
attention layer appends to, and that ``forward`` returns as ``past_key_values``. It serves generation
(the next call reads it); while training nothing reads it, and a pipeline would have to carry it
through every cut. So the capture runs with ``use_cache`` off on every config in the module tree, as
``transformers`` itself does while training with gradient checkpointing: the graph computes what
``forward`` computes but the cache, and the output's ``past_key_values`` is ``None``. The configs
are left as they were after the capture (generation after ``fit`` caches as usual).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["CACHE_OFF", "generation_cache_off"]

CACHE_OFF = (
    "transformers' generation cache (config.use_cache) is off in the captured forward of {modules}: it serves "
    "generation, and no stage needs it while training (the configs are left as they were)"
)


@contextmanager
def generation_cache_off(module: nn.Module) -> Iterator[list[str]]:
    """Within the block, ``config.use_cache`` is ``False`` on every config of ``module``'s tree that had
    it on; yields the paths of the modules holding them (``[]``: none)."""
    found: dict[int, tuple[object, str]] = {}
    for path, sub in module.named_modules():
        config = vars(sub).get("config")  # an attribute, not a submodule or parameter
        if config is not None and getattr(config, "use_cache", None) is True and id(config) not in found:
            found[id(config)] = (config, path or type(module).__name__)
    for config, _ in found.values():
        config.use_cache = False
    try:
        yield [path for _, path in found.values()]
    finally:
        for config, _ in found.values():
            config.use_cache = True
