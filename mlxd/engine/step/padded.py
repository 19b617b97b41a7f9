"""Verify passes whose attention shapes repeat: keys padded to a bucket of positions, masked past the filled ones.

MLX's CUDA backend runs attention over several query positions through cuDNN, which builds an execution plan per
shape and caches it. A verify pass of a speculative step attends over the whole cache, whose length grows with
every step, so each one paid a new plan: about 75 ms on an H100, against 12 ms for a one-token decode step (a
3-token pass at a shape seen before: 19.5 ms). Seen through :class:`PaddedLayer`, an attention layer's cache hands
the model its keys and values rounded up to :data:`BUCKET` positions (a view of its buffer where that holds them,
else a zero-padded copy) and a mask that hides the positions past the filled ones, so the shape changes once
every :data:`BUCKET` positions; warm-up builds the plans of the first buckets (:func:`.warmup.warm_up_verify`).
A verify pass attends over at most ``BUCKET - 1`` masked positions more, a few microseconds beside reading the
weights. The state written is the cache's own; only what the model reads is padded. Quantized layers
(``[engine] kv_bits``) are left as they are: their attention is two ``quantized_matmul`` calls, not cuDNN's kernel,
so it builds no plan per shape.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.runtime.cuda import cudnn_attention

BUCKET = 1024


def pad_verify() -> bool:
    """Only where attention plans are built per shape (cuDNN attention, which mlxd turns off unless the operator
    turns it on: :mod:`mlxd.runtime.cuda`); elsewhere padding would only add work."""
    return cudnn_attention()


def bucket(length: int) -> int:
    return -(-length // BUCKET) * BUCKET


def padded(cache: list[Any]) -> list[Any]:
    """The layers as a verify pass should see them: attention caches padded (see the module docstring), other
    layers (rotating, recurrent) as they are."""
    return [PaddedLayer(layer) if type(layer) in (KVCache, BatchKVCache) else layer for layer in cache]


class PaddedLayer:
    """One attention layer's cache (``KVCache`` or ``BatchKVCache``) for one forward pass of several positions."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def _filled(self) -> int:
        return self.layer._idx if isinstance(self.layer, BatchKVCache) else self.layer.offset

    def make_mask(self, num_positions: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: Any) -> mx.array:
        start = self._filled()
        left = self.layer.left_padding if isinstance(self.layer, BatchKVCache) else None
        mask = create_causal_mask(num_positions, start, window_size=window_size, left_padding=left)
        extra = bucket(start + num_positions) - (start + num_positions)
        return mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, extra)], constant_values=False) if extra else mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        filled_keys, filled_values = self.layer.update_and_fetch(keys, values)
        length = bucket(filled_keys.shape[2])
        if self.layer.keys.shape[2] >= length:
            return self.layer.keys[..., :length, :], self.layer.values[..., :length, :]
        extra = [(0, 0), (0, 0), (0, length - filled_keys.shape[2]), (0, 0)]
        return mx.pad(filled_keys, extra), mx.pad(filled_values, extra)
