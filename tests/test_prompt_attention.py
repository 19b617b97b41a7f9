"""mlxd.models.prompt_attention against MLX's own attention (the oracle) on random tensors: causal prompts with and
without cached keys before them, grouped-query heads, boolean masks with left padding (rows that see nothing
included), in many blocks and in one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from mlxd.models import prompt_attention as module
from mlxd.models.prompt_attention import prompt_attention, supports


def qkv(batch: int, heads: int, kv_heads: int, length: int, keys: int, dim: int, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    shapes = [(batch, heads, length, dim), (batch, kv_heads, keys, dim), (batch, kv_heads, keys, dim)]
    return [mx.array(2 * rng.standard_normal(shape).astype(np.float32)) for shape in shapes]


def assert_equals_mlx(q, k, v, scale, mask):
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = prompt_attention(q, k, v, scale, mask)
    assert got.shape == want.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-5)


@pytest.fixture(params=["small blocks", "default blocks"])
def blocks(request, monkeypatch):
    if request.param == "small blocks":  # 7 positions x 3 heads a query block, 16 keys a key block
        monkeypatch.setattr(module, "BLOCK_QUERIES", 21)
        monkeypatch.setattr(module, "BLOCK_KEYS", 16)


@pytest.mark.parametrize(("length", "keys"), [(40, 40), (40, 100), (1, 57), (33, 33)])
@pytest.mark.parametrize("mask", ["causal", None])
def test_causal_and_unmasked_with_grouped_heads(blocks, length, keys, mask):
    """9 query heads over 3 key heads (SmolLM2's grouping); ``keys > length``: a chunk after cached positions."""
    q, k, v = qkv(2, 9, 3, length, keys, 16, seed=length + keys)
    assert_equals_mlx(q, k, v, 0.25, mask)


@pytest.mark.parametrize(("length", "keys"), [(40, 40), (24, 70)])
def test_left_padded_batch_mask(blocks, length, keys):
    """The mask a left-padded batch's cache makes: causal, each row's padding hidden; row 2's first query
    positions see no key at all (MLX gives the mean of all values there, and so must this)."""
    q, k, v = qkv(3, 4, 2, length, keys, 8, seed=keys)
    mask = create_causal_mask(length, keys - length, left_padding=mx.array([0, 5, keys - length + 10]))
    assert mask.shape == (3, 1, length, keys)
    assert_equals_mlx(q, k, v, 0.35, mask)


def test_arbitrary_boolean_masks(blocks):
    q, k, v = qkv(2, 6, 2, 30, 50, 8, seed=1)
    rng = np.random.default_rng(2)
    assert_equals_mlx(q, k, v, 0.3, mx.array(rng.random((2, 1, 30, 50)) > 0.6))
    assert_equals_mlx(q, k, v, 0.3, mx.array(rng.random((30, 50)) > 0.95))  # (L, K): the same for every row


def test_large_scores_stay_finite_across_key_blocks(monkeypatch):
    """Scores in the hundreds, their maximum growing from key block to key block: the running softmax rescales."""
    monkeypatch.setattr(module, "BLOCK_KEYS", 8)
    q, k, v = qkv(1, 2, 1, 20, 64, 8, seed=5)
    k = k * mx.linspace(0.1, 10, 64)[None, None, :, None]
    want = np.array(mx.fast.scaled_dot_product_attention(q * 10, k, v, scale=1.0, mask="causal"))
    got = np.array(prompt_attention(q * 10, k, v, 1.0, "causal"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_other_dtypes_come_back_in_their_own():
    q, k, v = (t.astype(mx.bfloat16) for t in qkv(1, 4, 2, 24, 24, 16, seed=11))
    got = prompt_attention(q, k, v, 0.25, "causal")
    assert got.dtype == mx.bfloat16
    want = mx.fast.scaled_dot_product_attention(*(t.astype(mx.float32) for t in (q, k, v)), scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), rtol=2e-2, atol=2e-2)


def test_supports_what_it_computes_only():
    q, k, _ = qkv(1, 6, 4, 4, 4, 8, seed=0)
    assert not supports(q, k, None)  # 6 heads over 4 key heads: not a grouping
    q, k, _ = qkv(1, 4, 2, 4, 4, 8, seed=0)
    assert supports(q, k, None) and supports(q, k, "causal") and supports(q, k, mx.ones((1, 1, 4, 4), mx.bool_))
    assert not supports(q, k, mx.zeros((4, 4)))  # additive masks stay with MLX
    assert not supports(q, k, mx.ones((1, 4, 4, 4), mx.bool_))  # a mask per head
