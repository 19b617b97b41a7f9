"""Rows of a batched cache taken out or re-arranged with as few reads from the device as mlx-lm's cache protocol
allows: its ``filter`` and ``extract`` read each attention layer's left padding back (a wait for the device per layer),
where every attention layer of a batch holds the same padding. Attention layers are mlx-lm's ``BatchKVCache`` and,
with ``[engine] kv_bits``, :class:`~mlxd.cache.quantized.BatchQuantizedKVCache` (keys and values as quantized
triples, the same layout)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.cache.quantized import BatchQuantizedKVCache

_ATTENTION = (BatchKVCache, BatchQuantizedKVCache)


def gather_rows(cache: list[Any], rows: mx.array, trim: bool) -> None:
    """Keep the batched cache's ``rows`` (in that order, repeats allowed), as mlx-lm's ``filter`` does, and with
    ``trim`` drop the left padding they all have. ``filter`` reads that padding back from the device in every layer
    (36 waits for the device per change of rows with an 8B model); attention layers hold equal paddings, since every
    layer's rows are merged, extended and filtered alike, so here it is read once, and only when ``trim`` asks.
    Other layers (recurrent, rotating) go through their own ``filter``."""
    shift = None
    for layer in cache:
        if type(layer) not in _ATTENTION:
            layer.filter(rows)
            continue
        if shift is None:
            shift = min(layer.left_padding[rows].tolist()) if trim else 0
        if type(layer) is BatchQuantizedKVCache:
            layer.take_rows(rows, shift)
            continue
        keys, values, offset, left_padding, filled = layer.state
        keys = keys[rows] if keys is not None else None
        values = values[rows] if values is not None else None
        left_padding = left_padding[rows]
        if shift > 0:
            if keys is not None:
                keys, values = keys[..., shift:, :], values[..., shift:, :]
            filled, left_padding = filled - shift, left_padding - shift
        layer.state = (keys, values, offset[rows], left_padding, filled)


def extract_row(cache: list[Any], index: int) -> list[Any]:
    """Row ``index`` of the batched cache as a lone cache, as mlx-lm's ``extract`` gives it, with the attention
    layers' left padding (equal in every one of them, see :func:`gather_rows`) read back once rather than once a
    layer: a finished request's cache is taken out for the prefix cache, and 64 rows finishing together cost
    2,304 waits for the device with an 8B model."""
    padding, lone = None, []
    for layer in cache:
        if type(layer) not in _ATTENTION:
            lone.append(layer.extract(index))
            continue
        if padding is None:
            padding = layer.left_padding[index].item()
        if type(layer) is BatchQuantizedKVCache:
            lone.append(layer.extract_at(index, padding))
            continue
        keys, values, _, _, filled = layer.state
        row = KVCache()
        keys = mx.contiguous(keys[index : index + 1, :, padding:filled])
        row.state = (keys, mx.contiguous(values[index : index + 1, :, padding:filled]), keys.shape[2])
        lone.append(row)
    return lone


def fill_rows(cache: list[Any], start: int, joining: list[Any], count: int) -> bool:
    """Write the first ``count`` rows of ``joining`` (per layer a ``BatchKVCache``, or a lone ``KVCache`` when
    ``count`` is 1) into rows ``start``.. of the batched ``cache``, in place: the rows a padded batch holds as filler
    (:mod:`mlxd.engine.step.buckets`). mlx-lm's ``extend`` followed by a gather of the rows into order would copy
    every layer of the batch twice and dispatch some 17 operations a layer; this writes the joining rows' keys and
    values right-aligned at the batch's length (their left padding grows by the difference, as ``extend`` pads
    them) in 4. Returns False, touching nothing, unless every layer is a plain ``BatchKVCache`` and the joining rows
    are no longer than the batch."""
    parts = []
    for layer, other in zip(cache, joining, strict=True):
        if type(layer) is not BatchKVCache or layer.keys is None or type(other) not in (BatchKVCache, KVCache):
            return False
        length = other._idx if type(other) is BatchKVCache else other.offset
        if length > layer._idx or other.keys is None or layer.keys.shape[0] < start + count:
            return False
        parts.append((layer, other, length))
    for layer, other, length in parts:
        shift, end = layer._idx - length, layer._idx
        layer.keys[start : start + count, :, shift:end, :] = other.keys[:count, :, :length, :]
        layer.values[start : start + count, :, shift:end, :] = other.values[:count, :, :length, :]
        if type(other) is BatchKVCache:
            layer.left_padding[start : start + count] = other.left_padding[:count] + shift
            layer.offset[start : start + count] = other.offset[:count]
        else:
            layer.left_padding[start : start + count] = shift
            layer.offset[start : start + count] = length
    return True

