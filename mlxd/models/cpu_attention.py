"""Attention on MLX's CPU backend, computed by numpy in cache-sized blocks.

On Linux, MLX 0.32's CPU backend runs each elementwise operation on one thread without vector instructions: its
``exp`` costs about 24 ns an element on an Intel Xeon host (12 ns on an AMD EPYC), numpy's about 0.5 ns. A vision
tower's whole-image attention is then almost all softmax: four 1,024-patch images with 2 heads of 32 took 226 ms
in ``mx.fast.scaled_dot_product_attention``, its score and value products about 50 ms of it.

:func:`cpu_attention` evaluates ``q``, ``k`` and ``v`` and reads them in place through the buffer protocol (no
copy for float32), then computes each block of query rows, its scores no larger than :data:`BLOCK_SCORES`
elements so that they stay in the core's cache, with numpy: its matrix products go to the BLAS numpy ships with,
and its ``exp`` is vectorised. The same four images: 25 ms, against 124-139 ms for MLX's own operations spread
over two threads with a power-of-two softmax (this module's previous form) and 226 ms for MLX's fused call;
results equal to float tolerance. Scores are never held for more than one block, so memory does not grow with
the square of the patch count.

This is for the CPU only (a Mac serves from its GPU; GPU backends keep MLX's fused kernel), and it is a point
where the graph is evaluated: the tower is evaluated right after its call anyway.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

BLOCK_SCORES = 1 << 18  # float32 scores computed at once: 1 MiB, about a core's L2 cache


def cpu_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None) -> mx.array:
    """``softmax(q kᵀ · scale) v`` over (B, H, L, D) ``q``, ``k``, ``v``; ``mask`` is None or boolean (True: attend),
    broadcastable to (B, H, L, L) (a keys mask is (B, 1, 1, L)). Computed in float32; returned in ``q``'s dtype."""
    batch, heads, length, _ = q.shape
    keys = k.shape[2]
    count = batch * heads
    mx.eval(q, k, v, *(() if mask is None else (mask,)))
    qs, ks, vs = (_float32(t).reshape(count, t.shape[2], t.shape[3]) for t in (q, k, v))
    qs = qs * np.float32(scale)
    allowed = None
    if mask is not None:
        mask_rows = mask.shape[-2] if mask.ndim > 1 else 1  # 1: the same keys for every query row
        allowed = np.broadcast_to(np.asarray(mask), (batch, heads, mask_rows, keys)).reshape(count, mask_rows, keys)
    out = np.empty((count, length, vs.shape[-1]), np.float32)
    for slices, rows in _blocks(count, length, keys):
        block_mask = None
        if allowed is not None:
            block_mask = allowed[slices] if allowed.shape[1] == 1 else allowed[slices, rows]
        _attend(qs[slices, rows], ks[slices], vs[slices], block_mask, out[slices, rows])
    result = mx.array(out.reshape(batch, heads, length, -1))
    return result if q.dtype == mx.float32 else result.astype(q.dtype)


def _float32(t: mx.array) -> np.ndarray:
    if t.dtype != mx.float32:
        t = t.astype(mx.float32)
    return np.asarray(t)


def _blocks(count: int, length: int, keys: int):
    """(slices, rows) index pairs covering (count, length) query rows, each with at most :data:`BLOCK_SCORES`
    scores: several whole slices together when one slice's scores fit, else row ranges of one slice."""
    per_slice = length * keys
    if per_slice <= BLOCK_SCORES:
        group = BLOCK_SCORES // per_slice
        for start in range(0, count, group):
            yield slice(start, min(start + group, count)), slice(None)
        return
    rows = max(1, BLOCK_SCORES // keys)
    for index in range(count):
        for start in range(0, length, rows):
            yield slice(index, index + 1), slice(start, min(start + rows, length))


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, out: np.ndarray) -> None:
    scores = q @ k.swapaxes(-1, -2)
    if mask is not None:
        np.copyto(scores, -math.inf, where=~mask)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    np.matmul(scores, v, out=out)
    out /= scores.sum(axis=-1, keepdims=True)
