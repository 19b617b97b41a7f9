"""Attention of a prompt pass on MLX's CPU backend: numpy over blocks of queries and keys, a running softmax.

A prompt pass attends many query positions to every cached key. ``mx.fast.scaled_dot_product_attention`` on the CPU
computes the whole score matrix and its softmax with MLX's single-threaded, unvectorised ``exp`` (15 ns an element
on this project's AMD EPYC host against numpy's 0.5 ns), so one layer of SmolLM2-135M (9 heads of 64) for a 2,048-
token chunk after 18,432 cached tokens took 38.5 s, and its scores alone are 1.5 GB.

:func:`prompt_attention` evaluates ``q``, ``k`` and ``v`` and reads them in place through the buffer protocol, then
works through blocks of :data:`BLOCK_QUERIES` query rows and :data:`BLOCK_KEYS` keys with numpy, its products going
to the BLAS numpy ships with: the query heads that share a key head (grouped-query attention) are stacked into one
block, so each key block is read once for all of them, and the softmax is kept running over key blocks (maximum,
sum and weighted values rescaled as a larger maximum appears, as flash attention does), so the scores of a block
stay in the core's cache and memory does not grow with the square of the prompt. Key blocks that no query row of the
block may see (later positions under the causal mask, a row's left padding) are skipped: a whole causal prompt costs
about half its square.

The mask is what mlx-lm's models pass: ``None``, ``"causal"`` (queries are the last positions of the keys) or a
boolean array (True: attend) broadcastable to (B, 1, L, K). A query row that may see no key gets the mean of all
values, as MLX's kernel gives. Results equal MLX's to float tolerance (``tests/test_prompt_attention.py``).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

BLOCK_QUERIES = 3072  # stacked query rows (heads sharing a key head x positions) a block
BLOCK_KEYS = 1024  # keys a block: 3,072 x 1,024 float32 scores, 12 MiB


def supports(q: mx.array, k: mx.array, mask: mx.array | str | None) -> bool:
    """Whether :func:`prompt_attention` takes these arguments: heads a multiple of the key heads, and a mask that is
    ``None``, ``"causal"`` or a boolean array without a per-head axis."""
    if q.shape[1] % k.shape[1]:
        return False
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    return isinstance(mask, mx.array) and mask.dtype == mx.bool_ and (mask.ndim < 4 or mask.shape[1] == 1)


def prompt_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                     mask: mx.array | str | None = None) -> mx.array:
    """``softmax(q kᵀ · scale) v`` for (B, H, L, D) ``q`` and (B, H_kv, K, D) ``k``, ``v`` (H a multiple of H_kv),
    under ``mask`` (see :func:`supports`). Computed in float32; returned (B, H, L, D) in ``q``'s dtype."""
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    arrays = (q, k, v) if not isinstance(mask, mx.array) else (q, k, v, mask)
    mx.eval(*arrays)
    qs = _float32(q).transpose(0, 2, 1, 3)  # (B, L, H, D): a position's heads of one group lie together
    ks, vs = _float32(k), _float32(v)
    allowed = _allowed(mask, batch, length, keys)
    out = np.empty((batch, length, heads, v.shape[-1]), np.float32)
    rows = max(1, BLOCK_QUERIES // group)
    causal = keys - length if isinstance(mask, str) else None
    for b in range(batch):
        for g in range(kv_heads):
            heads_g = slice(g * group, (g + 1) * group)
            stacked = qs[b, :, heads_g].reshape(length * group, dim) * np.float32(scale)
            for start in range(0, length, rows):
                end = min(start + rows, length)
                block_mask = None if allowed is None else allowed[min(b, allowed.shape[0] - 1), start:end]
                result = _attend_rows(stacked[start * group : end * group], ks[b, g], vs[b, g], group,
                                      _Rows(start, end, causal, block_mask))
                out[b, start:end, heads_g] = result.reshape(end - start, group, -1)
    result = mx.array(out).transpose(0, 2, 1, 3)
    return result if q.dtype == mx.float32 else result.astype(q.dtype)


class _Rows:
    """Which keys a block of query positions ``[start, end)`` may see: causally, ``offset`` keys lying before the
    first query (None: not causal), and as ``mask`` ((end - start) rows of K booleans, or None) allows."""

    __slots__ = ("start", "end", "offset", "mask")

    def __init__(self, start: int, end: int, offset: int | None, mask: np.ndarray | None) -> None:
        self.start, self.end, self.offset, self.mask = start, end, offset, mask

    def key_blocks(self, keys: int):
        """(first, last, mask) of each key block some row may see; mask None where every row sees every key."""
        limit = keys if self.offset is None else min(keys, self.offset + self.end)
        first_seen = 0
        if self.mask is not None:
            seen = np.flatnonzero(self.mask.any(axis=0))
            if not seen.size:
                return
            first_seen, limit = int(seen[0]), int(seen[-1]) + 1
        for first in range(first_seen - first_seen % BLOCK_KEYS, limit, BLOCK_KEYS):
            last = min(first + BLOCK_KEYS, limit)
            yield first, last, self._block_mask(first, last)

    def _block_mask(self, first: int, last: int) -> np.ndarray | None:
        if self.mask is not None:
            block = self.mask[:, first:last]
            return None if block.all() else block
        if self.offset is None or last <= self.offset + self.start + 1:
            return None
        positions = np.arange(self.start, self.end)[:, None] + self.offset
        return positions >= np.arange(first, last)[None, :]


def _attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int, rows: _Rows) -> np.ndarray:
    """Attention of stacked query rows (positions x ``group`` heads) over one key head, the softmax running over
    the key blocks ``rows`` lets them see."""
    count = q.shape[0]
    top = np.full(count, -math.inf, np.float32)
    total = np.zeros(count, np.float32)
    acc = np.zeros((count, v.shape[-1]), np.float32)
    for first, last, mask in rows.key_blocks(k.shape[0]):
        scores = q @ k[first:last].T
        if mask is not None:
            np.copyto(scores, -math.inf, where=~np.repeat(mask, group, axis=0))
        new_top = np.maximum(top, scores.max(axis=1))
        shift = np.where(new_top == -math.inf, np.float32(0), new_top)
        scores -= shift[:, None]
        np.exp(scores, out=scores)
        rescale = np.exp(top - shift)
        total *= rescale
        total += scores.sum(axis=1)
        acc *= rescale[:, None]
        acc += scores @ v[first:last]
        top = new_top
    unseen = total == 0
    if unseen.any():  # rows that may see no key: MLX's kernel gives the mean of all values
        acc[unseen], total[unseen] = v.mean(axis=0), 1
    acc /= total[:, None]
    return acc


def _allowed(mask: mx.array | str | None, batch: int, length: int, keys: int) -> np.ndarray | None:
    """A boolean mask as (B or 1, L or 1, K) numpy; None for no mask or the causal one (handled per block)."""
    if not isinstance(mask, mx.array):
        return None
    allowed = np.asarray(mask)
    if allowed.ndim == 4:
        allowed = allowed[:, 0]
    allowed = allowed.reshape((1,) * (3 - allowed.ndim) + allowed.shape)
    return np.broadcast_to(allowed, (allowed.shape[0], length, keys))


def _float32(t: mx.array) -> np.ndarray:
    if t.dtype != mx.float32:
        t = t.astype(mx.float32)
    return np.asarray(t)
