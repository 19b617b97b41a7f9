"""Quantized attention caches that stay quantized in the decode batch (``[engine] kv_bits``).

mlx-lm 0.32 quantizes a lone request's keys and values as they arrive (``QuantizedKVCache``: each position's head
vector in groups of ``group_size`` features, ``bits`` per feature plus a scale and a bias per group, packed by
``mx.quantize`` into a ``(packed, scales, biases)`` triple), and its attention reads them through
``quantized_matmul`` wherever the cache has ``bits`` (``mlx_lm.models.base.scaled_dot_product_attention``). It has
no batched form: ``QuantizedKVCache`` has no ``merge`` and ``BatchKVCache`` holds plain arrays. (mlx-vlm 0.7 has a
``BatchQuantizedKVCache`` tied to its own single-row class, with no ``merge`` either.)

:class:`QuantizedLayer` is a request's own layer: mlx-lm's class with ``merge`` and a ``state`` that holds only the
filled positions, so that a prefix-cache snapshot counts and keeps what the row holds. :class:`BatchQuantizedKVCache`
is the batch's: the same triples, left-padded, with ``BatchKVCache``'s protocol (``merge``, ``extend``, ``filter``,
``extract``, ``trim``, ``prepare``/``finalize`` for right padding and a speculative step's ragged rollback,
``make_mask``). A row's keys are quantized once, when they are written, and never return to 16 bits: alone or in a
batch, a row attends over the same quantized values, and a finished row leaves as a :class:`QuantizedLayer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, dynamic_roll

from mlxd.config.schema import EngineConfig
from mlxd.errors import ConfigError

Triple = tuple[mx.array, mx.array, mx.array]  # (packed uint32 features, scales, biases), each (B, H, L, ...)


@dataclass(frozen=True, slots=True)
class KVQuantization:
    """How attention layers hold keys and values: ``bits`` per feature, one scale and bias per ``group_size``."""

    bits: int
    group_size: int


def kv_quantization(config: EngineConfig) -> KVQuantization | None:
    """The engine config's ``kv_bits`` / ``kv_group_size``; None when keys and values stay in the model's dtype."""
    return KVQuantization(config.kv_bits, config.kv_group_size) if config.kv_bits else None


def quantize_layers(layers: list[Any], kv: KVQuantization) -> list[Any]:
    """A fresh request cache with its attention layers (mlx-lm's ``KVCache``) quantized; recurrent layers
    (``ArraysCache``: a hybrid model's linear attention, a fixed-size state) stay as they are. Any other layer is a
    :class:`ConfigError`: mlx-lm has no quantized form of a sliding window (``RotatingKVCache``), and mlx-vlm's
    caches are not mlx-lm's."""
    out = []
    for layer in layers:
        if type(layer) is KVCache:
            out.append(QuantizedLayer(group_size=kv.group_size, bits=kv.bits))
        elif isinstance(layer, ArraysCache):
            out.append(layer)
        else:
            raise ConfigError(f"[engine] kv_bits = {kv.bits}: this model's {type(layer).__module__}."
                              f"{type(layer).__name__} layers have no quantized form (only mlx-lm's full-attention "
                              "KVCache layers are quantized, beside recurrent ones); unset kv_bits")
    return out


# What the device probe runs quantized attention at, over PROBE_KEYS keys: (rows, query positions) of a lone decode
# step, a batched one (a mask array) and a prompt pass (causal). MLX's CUDA backend has no quantized_matmul for some
# (bits, group size, dtype, shape): bfloat16 heads of 128 at 8 bits in groups of 64 raised "No implementation for
# problem shape" in a 128-token pass on an H200, where groups of 32 ran.
PROBE_SHAPES = ((1, 1), (2, 1), (1, 128))
PROBE_KEYS = 256

Attend = Callable[..., mx.array]


def probe_attention(kv: KVQuantization, head_dim: int, kv_heads: int, dtype: mx.Dtype,
                    attend: Attend = quantized_scaled_dot_product_attention) -> str | None:
    """None when this device computes ``attend`` (mlx-lm's quantized attention) at ``kv`` for these heads at each of
    :data:`PROBE_SHAPES`, else MLX's message."""
    try:
        for rows, length in PROBE_SHAPES:
            queries = mx.zeros((rows, 2 * kv_heads, length, head_dim), dtype=dtype)
            keys = mx.quantize(mx.ones((rows, kv_heads, PROBE_KEYS, head_dim), dtype=dtype),
                               group_size=kv.group_size, bits=kv.bits)
            mask = "causal" if length > 1 else mx.ones((rows, 1, 1, PROBE_KEYS), dtype=mx.bool_)
            mx.eval(attend(queries, keys, keys, scale=head_dim**-0.5, mask=mask, group_size=kv.group_size,
                           bits=kv.bits))
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def on_cuda() -> bool:
    """Whether arrays are computed by MLX's CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def check_quantized_attention(model: Any, make_cache: Callable[[], list[Any]], kv: KVQuantization,
                              attend: Attend = quantized_scaled_dot_product_attention,
                              cuda: Callable[[], bool] = on_cuda) -> None:
    """Refuse, at start-up, a model that cannot attend over quantized keys and values: MLX's CUDA backend (``cuda``:
    its quantized_matmul lacks kernels for shapes no probe can cover in advance), a vision-language model,
    layers with no quantized form (:func:`quantize_layers`), head sizes that are not a multiple of ``group_size``,
    attention sinks (one position's graph is built through ``make_cache``'s fresh request cache, not evaluated), and
    a device with no quantized attention for these heads (:func:`probe_attention`; the error names the settings that
    work here)."""
    where = f"[engine] kv_bits = {kv.bits}, kv_group_size = {kv.group_size}"
    if hasattr(model, "encode"):
        raise ConfigError(f"{where}: vision-language models are refused: image rows' prompt passes (mlx-vlm's "
                          "language models and mlxd's vision prefill) are not verified on quantized caches; unset "
                          "kv_bits for this model")
    if cuda():
        raise ConfigError(f"{where}: refused on MLX's CUDA backend: its quantized_matmul has no kernel for some "
                          "prompt-pass shapes (on an H200, MLX 0.32.4: a 128-token pass over 128 keys at 8 bits in "
                          "groups of 32 or 64, bfloat16 heads of 128, raised 'No implementation for problem shape', "
                          "where 256 keys ran), so a request could fail in the middle of its prompt; kv_bits runs on "
                          "Apple silicon (Metal) and the CPU; unset kv_bits")
    layers = make_cache()
    try:
        model(mx.zeros((1, 1), dtype=mx.uint32), cache=layers)
    except ValueError as e:
        raise ConfigError(f"{where}: this model's attention cannot run on quantized keys and values ({e}); "
                          "unset kv_bits or choose a kv_group_size that divides the head size") from e
    heads = _heads(layers, kv)
    failure = probe_attention(kv, *heads, attend) if heads is not None else None
    if failure is not None:
        others = [KVQuantization(bits, size) for bits in (8, 4) for size in (32, 64, 128)
                  if (bits, size) != (kv.bits, kv.group_size) and heads[0] % size == 0]
        works = [f"kv_bits = {o.bits}, kv_group_size = {o.group_size}" for o in others
                 if probe_attention(o, *heads, attend) is None]
        raise ConfigError(f"{where}: {mx.default_device()} has no quantized attention for heads of {heads[0]} in "
                          f"{heads[2]} ({failure}); " + (f"what works here: {'; '.join(works)}" if works else
                                                         "no other kv_bits and kv_group_size works here either; "
                                                         "unset kv_bits"))


def _heads(layers: list[Any], kv: KVQuantization) -> tuple[int, int, mx.Dtype] | None:
    """(head size, key-value heads, dtype) of the first quantized layer that holds keys."""
    for layer in layers:
        if type(layer) is QuantizedLayer and layer.keys is not None:
            scales = layer.keys[1]
            return scales.shape[-1] * kv.group_size, scales.shape[1], scales.dtype
    return None


def each_part(fn: Callable[[mx.array], mx.array], keys: Any) -> Any:
    """``fn`` over a layer's keys (or values): one array, or each array of a quantized triple."""
    return tuple(fn(part) for part in keys) if isinstance(keys, tuple) else fn(keys)


def _positions(triple: Triple, start: int, end: int) -> Triple:
    return each_part(lambda x: x[..., start:end, :], triple)


def _zeros(like: Triple, batch: int, length: int) -> Triple:
    return tuple(mx.zeros((batch, x.shape[1], length, x.shape[3]), dtype=x.dtype) for x in like)


def _fresh(shape: tuple[int, int, int], features: int, dtype: mx.Dtype, bits: int, group_size: int) -> Triple:
    """An all-zero quantized buffer (zero scales and biases read back as zeros) for ``features`` per position."""
    groups = features // group_size
    return (mx.zeros((*shape, features * bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, groups), dtype=dtype), mx.zeros((*shape, groups), dtype=dtype))


class QuantizedLayer(QuantizedKVCache):
    """One request's quantized attention layer: mlx-lm's, joinable to a batch (``merge``), with a compact state."""

    def size(self) -> int:
        return self.offset

    @property
    def state(self) -> tuple[Any, Any, int, int, int]:
        keys, values = self.keys, self.values
        if keys is not None and self.offset < keys[0].shape[2]:
            keys, values = _positions(keys, 0, self.offset), _positions(values, 0, self.offset)
        return keys, values, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple[Any, Any, int, int, int]) -> None:
        self.keys, self.values, self.offset, self.group_size, self.bits = v

    @classmethod
    def merge(cls, caches: list[QuantizedLayer]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache:
    """Quantized keys and values of several rows, left-padded to a common length (``BatchKVCache``'s layout).

    ``_idx`` is the number of positions filled (padding included), as in ``BatchKVCache``: mlx-vlm's speculative
    transaction and :mod:`mlxd.engine.step.padded` read a batched layer's position from it."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, num = self._idx, keys.shape[2]
        if self.keys is None or prev + num > self.keys[0].shape[2]:
            self._grow(keys, values)
        self.offset = self.offset + num
        self._idx += num
        for mine, new in ((self.keys, mx.quantize(keys, group_size=self.group_size, bits=self.bits)),
                          (self.values, mx.quantize(values, group_size=self.group_size, bits=self.bits))):
            for part, written in zip(mine, new, strict=True):
                part[..., prev : self._idx, :] = written
        return self.keys_and_values()

    def _grow(self, keys: mx.array, values: mx.array) -> None:
        shape = (keys.shape[0], keys.shape[1], -(-keys.shape[2] // self.step) * self.step)
        new_keys = _fresh(shape, keys.shape[3], keys.dtype, self.bits, self.group_size)
        new_values = _fresh(shape, values.shape[3], values.dtype, self.bits, self.group_size)
        if self.keys is None:
            self.keys, self.values = new_keys, new_values
            return
        def grown(old: Triple, new: Triple) -> Triple:
            return tuple(mx.concatenate([x[..., : self._idx, :], z], axis=2) for x, z in zip(old, new, strict=True))

        self.keys, self.values = grown(self.keys, new_keys), grown(self.values, new_values)

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return _positions(self.keys, 0, self._idx), _positions(self.values, 0, self._idx)

    def prepare(self, *, left_padding: list[int] | None = None, lengths: Any = None,
                right_padding: list[int] | None = None) -> None:
        """As ``BatchKVCache.prepare``: left padding before the first pass; right padding rolled by ``finalize``."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty BatchQuantizedKVCache")
            padding = mx.array(left_padding)
            self.left_padding = self.left_padding + padding
            self.offset = self.offset - padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """Roll each row's right padding (a shorter prompt, a speculative row's rejected tail) to its left."""
        if self._right_padding is None:
            return
        padding = self._right_padding
        if self.keys is not None:
            self.keys = each_part(lambda x: dynamic_roll(x, padding[:, None], axis=2), self.keys)
            self.values = each_part(lambda x: dynamic_roll(x, padding[:, None], axis=2), self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, Any, mx.array, mx.array, int]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, Any, mx.array, mx.array, int]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803 - mlx-lm's name
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: mx.array) -> None:
        """Keep the rows ``batch_indices`` (in that order), then drop the left padding they all have."""
        left_padding = self.left_padding[batch_indices]
        self.take_rows(batch_indices, min(left_padding.tolist()))

    def take_rows(self, rows: mx.array, shift: int) -> None:
        """Keep ``rows`` and drop ``shift`` leading positions (at most the smallest left padding of those rows)."""
        if self.keys is not None:
            self.keys = each_part(lambda x: x[rows][..., shift:, :], self.keys)
            self.values = each_part(lambda x: x[rows][..., shift:, :], self.values)
        self.offset = self.offset[rows]
        self.left_padding = self.left_padding[rows] - shift
        self._idx -= shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows, right-aligning both at the longer filled length (``BatchKVCache.extend``)."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        filled = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other
        parts = [_aligned(c, like, filled, size) for c in (self, other)]
        self.keys = tuple(mx.concatenate(pair) for pair in zip(parts[0][0], parts[1][0], strict=True))
        self.values = tuple(mx.concatenate(pair) for pair in zip(parts[0][1], parts[1][1], strict=True))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([parts[0][2], parts[1][2]])
        self._idx = filled

    def extract(self, idx: int) -> QuantizedLayer:
        return self.extract_at(idx, self.left_padding[idx].item())

    def extract_at(self, idx: int, padding: int) -> QuantizedLayer:
        """Row ``idx`` as a lone layer, its left padding (``padding``, read by the caller) dropped."""
        layer = QuantizedLayer(group_size=self.group_size, bits=self.bits)
        if self.keys is None:
            return layer
        layer.keys = each_part(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), self.keys)
        layer.values = each_part(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), self.values)
        layer.offset = self._idx - padding
        return layer

    @classmethod
    def merge(cls, caches: list[QuantizedLayer]) -> BatchQuantizedKVCache:
        """Lone layers as one batch, each row left-padded to the longest."""
        group_size, bits = caches[0].group_size, caches[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):
            raise ValueError("cannot merge quantized caches of different bits or group sizes")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        like = next(c for c in caches if c.keys is not None)
        padding = [longest - n for n in lengths]

        def rows(get: Callable[[QuantizedLayer], Triple | None]) -> Triple:
            stacked = []
            for c, pad in zip(caches, padding, strict=True):
                part = get(c)
                if part is None:
                    stacked.append(_zeros(get(like), 1, longest))
                else:
                    stacked.append(each_part(lambda x, n=c.offset, pad=pad: mx.pad(
                        x[..., :n, :], [(0, 0), (0, 0), (pad, 0), (0, 0)]), part))
            return tuple(mx.concatenate(column) for column in zip(*stacked, strict=True))

        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = rows(lambda c: c.keys), rows(lambda c: c.values)
        cache.offset = cache.offset + longest
        cache._idx = longest
        return cache

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def _aligned(cache: BatchQuantizedKVCache, like: BatchQuantizedKVCache, filled: int,
             size: int) -> tuple[Triple, Triple, mx.array]:
    """``cache``'s keys, values and left padding, its filled positions ending at ``filled`` in ``size`` positions."""
    batch = cache.offset.shape[0]
    keys = cache.keys if cache.keys is not None else _zeros(like.keys, batch, 0)
    values = cache.values if cache.values is not None else _zeros(like.values, batch, 0)
    left = filled - cache._idx
    right = size - keys[0].shape[2] - left
    if right < 0:
        keys, values = _positions(keys, 0, keys[0].shape[2] + right), _positions(values, 0, values[0].shape[2] + right)
        right = 0
    if left or right:
        widths = [(0, 0), (0, 0), (left, right), (0, 0)]
        keys = each_part(lambda x: mx.pad(x, widths), keys)
        values = each_part(lambda x: mx.pad(x, widths), values)
    return keys, values, cache.left_padding + left
