"""An experiment, not part of mlxd: a compiled batched decode forward pass, traced once per batch shape.

On a GPU a decode step of a batch is bound by the host (``docs/benchmarks/engine.md``). ``mx.compile`` replays a
traced graph without running the model's Python again and fuses its elementwise work, but only for a pure function
of arrays, and mlx-lm's ``BatchKVCache`` writes each new position at a Python index (``_idx``) that a trace would
freeze. So the step here is a function of the cache's arrays: each layer's keys and values of fixed capacity, the
write position and each row's offsets as arrays. Inside the trace a :class:`_Slot` stands in for each layer's cache;
it writes at the position array (``mx.slice_update``) and masks what no row has written (left padding, the capacity
beyond the position). Outside it the caller keeps mlx-lm's own ``BatchKVCache`` objects, updated through their
public ``state``. A trace is kept per (rows, capacity).

``benchmarks/step_breakdown.py`` times it beside mlx-lm's own call ("forward floor, compiled BatchKVCache"). On an
H100 (Qwen3-8B shape) it cut the host's Python time a step from 2.3-2.8 ms to 1.4-1.6 ms, but MLX's own dispatch
(9-11 ms a step) did not shrink, so the step as a whole did not get faster; mlxd does not use it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


class _Slot:
    """One layer's batched cache inside the traced step (mlx-lm's cache protocol, as much as a forward pass uses)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, index: mx.array,
                 left_padding: mx.array) -> None:
        self.keys, self.values = keys, values
        self.offset, self.index, self.left_padding = offset, index, left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.index, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.index, axes=(2,))
        return self.keys, self.values

    def make_mask(self, num_queries: int, **kwargs: Any) -> mx.array:
        positions = mx.arange(self.keys.shape[2])
        written = (positions[None] >= self.left_padding[:, None]) & (positions[None] <= self.index)
        return written[:, None, None, :]


def _decode(model: Any, tokens: mx.array, keys: list[mx.array], values: list[mx.array], offset: mx.array,
            index: mx.array, left_padding: mx.array) -> tuple[mx.array, list[mx.array], list[mx.array]]:
    slots = [_Slot(k, v, offset, index, left_padding) for k, v in zip(keys, values, strict=True)]
    logits = model(tokens[:, None], cache=slots)[:, -1, :]
    return logits, [s.keys for s in slots], [s.values for s in slots]


def can_compile(cache: list[Any]) -> bool:
    """Whether a batch's cache is what the compiled step takes: mlx-lm's ``BatchKVCache`` in every layer, filled."""
    return bool(cache) and all(type(c) is BatchKVCache and c.keys is not None for c in cache)


class CompiledDecode:
    """``model``'s one-token decode forward over a batch of ``BatchKVCache`` layers, compiled.

    ``__call__(tokens (B,), cache)`` returns the logits ``(B, V)`` of the last position and advances every layer of
    ``cache`` by one position, as ``model(tokens[:, None], cache=cache)[:, -1]`` would.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._step = mx.compile(lambda *arrays: _decode(model, *arrays))

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        first = cache[0]
        index = first.state[4]
        if index + 1 > first.keys.shape[2]:
            for layer in cache:
                _grow(layer, index)
        keys = [layer.keys for layer in cache]
        values = [layer.values for layer in cache]
        logits, keys, values = self._step(tokens, keys, values, first.offset, mx.array([index]), first.left_padding)
        for layer, k, v in zip(cache, keys, values, strict=True):
            layer.state = (k, v, layer.offset + 1, layer.left_padding, index + 1)
        return logits


def _grow(layer: BatchKVCache, index: int) -> None:
    """Room for at least one more position, in ``BatchKVCache.step`` positions, as ``update_and_fetch`` grows it."""
    keys, values, offset, left_padding, _ = layer.state
    batch, heads, _, dim = keys.shape
    extra = layer.step
    keys = mx.concatenate([keys[..., :index, :], mx.zeros((batch, heads, extra, dim), keys.dtype)], axis=2)
    values = mx.concatenate([values[..., :index, :], mx.zeros((batch, heads, extra, values.shape[3]), values.dtype)],
                            axis=2)
    layer.state = (keys, values, offset, left_padding, index)
