"""Attention on MLX's CPU backend, spread over the cores and with a cheaper exponential.

On Linux, MLX 0.32's CPU backend runs each elementwise operation on one thread, and its ``exp`` costs about 12 ns
an element (float32, float16 and bfloat16 alike; numpy's costs 1-2 ns). A vision tower's whole-image attention is
then almost all softmax: for one 1,024-patch image with 2 heads, ``mx.fast.scaled_dot_product_attention`` took
39 ms, its softmax 26 ms, the matrix products about 1.5 ms (``docs/benchmarks/vision.md``). :func:`cpu_attention`
computes the same thing two ways cheaper:

- the softmax as ``2 ** (s - max s)`` over scores already scaled by ``log2(e)`` (folded into the query's scale):
  ``mx.power(2, x)`` costs about half of ``mx.exp(x)`` on this backend;
- the independent (batch, head) slices go to as many CPU streams as the process may use cores, at most
  :data:`MAX_STREAMS`: MLX runs each stream's work on a thread of its own. Each calling thread gets its own
  streams (an engine's encoder thread evaluates beside the engine thread).

For four 1,024-patch images with 2 heads of 32 on 2 cores: 44 ms against 124 ms for MLX's attention; results equal
to float tolerance (4e-7). Measured on Linux x86-64 only (a Mac serves from its GPU). GPU backends keep MLX's fused
kernel.
"""

from __future__ import annotations

import math
import os
import threading

import mlx.core as mx

LOG2_E = math.log2(math.e)
MAX_STREAMS = 16

_local = threading.local()


def cpu_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None) -> mx.array:
    """``softmax(q kᵀ · scale) v`` over (B, H, L, D) ``q``, ``k``, ``v``; ``mask`` is None or boolean (True: attend),
    broadcastable to (B, H, L, L) (a keys mask is (B, 1, 1, L)). The (B, H) slices are split over CPU streams."""
    batch, heads, length, dim = q.shape
    count = batch * heads
    q, k, v = (t.reshape(count, t.shape[2], t.shape[3]) for t in (q, k, v))
    if mask is not None:
        rows, cols = mask.shape[-2:]
        mask = mx.broadcast_to(mask, (batch, heads, rows, cols)).reshape(count, rows, cols)
    streams = _streams(min(count, _num_cores(), MAX_STREAMS))
    cuts = [count * i // len(streams) for i in range(len(streams) + 1)]
    outs = []
    for stream, lo, hi in zip(streams, cuts, cuts[1:], strict=False):
        with mx.stream(stream):
            outs.append(_attend(q[lo:hi], k[lo:hi], v[lo:hi], scale, None if mask is None else mask[lo:hi]))
    return mx.concatenate(outs).reshape(batch, heads, length, v.shape[-1])


def _attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    scores = (q * (scale * LOG2_E)) @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-math.inf, scores.dtype))
    weights = mx.power(2.0, scores - scores.max(axis=-1, keepdims=True))
    return (weights @ v) / weights.sum(axis=-1, keepdims=True)


def _streams(count: int) -> list[mx.Stream]:
    """``count`` CPU streams of the calling thread: its default one first, then streams made once per thread."""
    extra: list[mx.Stream] = getattr(_local, "streams", [])
    while len(extra) < count - 1:
        extra.append(mx.new_stream(mx.cpu))
    _local.streams = extra
    return [mx.default_stream(mx.cpu), *extra[: count - 1]]


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity mask
        return os.cpu_count() or 1
