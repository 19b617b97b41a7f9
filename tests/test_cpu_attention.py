"""mlxd.models.cpu_attention against MLX's own attention (the oracle): with and without a keys mask, in blocks of
whole slices or of query rows, on transposed views and in other dtypes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxd.models import cpu_attention as module
from mlxd.models.cpu_attention import cpu_attention


def qkv(batch: int, heads: int, length: int, dim: int, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    return [mx.array(3 * rng.standard_normal((batch, heads, length, dim)).astype(np.float32)) for _ in range(3)]


def keys_mask(lengths: list[int], size: int) -> mx.array:
    """(B, 1, 1, size): row b attends to its first lengths[b] keys."""
    return mx.array(np.arange(size)[None, :] < np.array(lengths)[:, None])[:, None, None, :]


# 40 x 40 scores a slice: blocks of 6 slices (default), of 1 slice, of 7 rows, of 1 row.
@pytest.mark.parametrize("block", [module.BLOCK_SCORES, 1600, 280, 40])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_mlx_attention(monkeypatch, block, masked):
    monkeypatch.setattr(module, "BLOCK_SCORES", block)
    q, k, v = qkv(3, 2, 40, 16, seed=block)
    mask = keys_mask([40, 31, 22], 40) if masked else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    got = cpu_attention(q, k, v, 0.3, mask)
    assert got.shape == want.shape == (3, 2, 40, 16)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)


def test_full_mask_per_head_and_row(monkeypatch):
    """A (B, H, L, L) mask (causal, different per head) is applied block by block, rows included."""
    monkeypatch.setattr(module, "BLOCK_SCORES", 24 * 5)
    q, k, v = qkv(2, 3, 24, 8, seed=3)
    causal = np.tril(np.ones((24, 24), bool))
    per_head = np.stack([np.roll(causal, h, axis=1) | np.eye(24, dtype=bool) for h in range(3)])
    mask = mx.array(np.broadcast_to(per_head, (2, 3, 24, 24)).copy())
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
    np.testing.assert_allclose(np.array(cpu_attention(q, k, v, 0.5, mask)), np.array(want), rtol=1e-5, atol=1e-5)


def test_transposed_views_as_the_tower_passes_them():
    """(N, H, D) tensors transposed to (S, H, L, D): strided inputs are read correctly."""
    q, k, v = (t.reshape(4, 16, 2, 8).transpose(0, 2, 1, 3) for t in qkv(1, 1, 64, 16, seed=7))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.4)
    np.testing.assert_allclose(np.array(cpu_attention(q, k, v, 0.4)), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_other_dtypes_come_back_in_their_own(dtype):
    q, k, v = (t.astype(dtype) for t in qkv(2, 2, 32, 16, seed=11))
    got = cpu_attention(q, k, v, 0.25)
    assert got.dtype == dtype
    want = mx.fast.scaled_dot_product_attention(*(t.astype(mx.float32) for t in (q, k, v)), scale=0.25)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), rtol=2e-2, atol=2e-2)


def test_large_scores_do_not_overflow():
    """Scores in the hundreds: the maximum is taken out before the exponential, as softmax does."""
    q, k, v = (t * 10 for t in qkv(1, 2, 16, 8, seed=5))
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0))
    got = np.array(cpu_attention(q, k, v, 1.0))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_blocks_cover_every_row_once(monkeypatch):
    monkeypatch.setattr(module, "BLOCK_SCORES", 100)
    seen = np.zeros((5, 37), int)
    for slices, rows in module._blocks(5, 37, 30):
        seen[slices, rows] += 1
        assert seen[slices, rows].size * 30 <= 100 or seen[slices, rows].shape[-1] == 1
    assert (seen == 1).all()


def test_one_dimensional_keys_mask():
    """A (L,) mask, broadcastable like any other: the same keys for every slice and query row."""
    q, k, v = qkv(2, 2, 12, 8, seed=13)
    mask = mx.array(np.arange(12) < 9)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
    np.testing.assert_allclose(np.array(cpu_attention(q, k, v, 0.5, mask)), np.array(want), rtol=1e-5, atol=1e-5)
