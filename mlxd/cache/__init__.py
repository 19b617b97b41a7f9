"""Prefix caching: reuse the model state of prompts seen before, for attention and hybrid (recurrent) models.

``PrefixCache`` is what the engine uses; ``PrefixIndex`` (plain Python) and ``SnapshotStore`` (MLX arrays) are
its two halves. Names are loaded on first use, so that importing the index does not import MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Match": "mlxd.cache.index",
    "PrefixIndex": "mlxd.cache.index",
    "MISS": "mlxd.cache.prefix_cache",
    "Hit": "mlxd.cache.prefix_cache",
    "PrefixCache": "mlxd.cache.prefix_cache",
    "checkpoint_length": "mlxd.cache.prefix_cache",
    "Snapshot": "mlxd.cache.store",
    "SnapshotStore": "mlxd.cache.store",
    "restore": "mlxd.cache.store",
    "take_snapshot": "mlxd.cache.store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlxd.cache' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
