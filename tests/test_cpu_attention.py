"""mlxd.models.cpu_attention against MLX's own attention (the oracle): with and without a keys mask, split over one
stream or several, and called from a thread of its own as an engine's encoder thread does."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from mlxd.models import cpu_attention as module
from mlxd.models.cpu_attention import cpu_attention


def qkv(batch: int, heads: int, length: int, dim: int, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    return [mx.array(3 * rng.standard_normal((batch, heads, length, dim)).astype(np.float32)) for _ in range(3)]


@pytest.mark.parametrize("cores", [1, 2, 3, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_mlx_attention(monkeypatch, cores, masked):
    monkeypatch.setattr(module, "_num_cores", lambda: cores)
    q, k, v = qkv(3, 2, 40, 16, seed=cores)
    mask = None
    if masked:  # each row of the batch attends to its first 40 - 9 * row keys
        mask = mx.array(np.arange(40)[None, :] < np.array([40, 31, 22])[:, None])[:, None, None, :]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    got = cpu_attention(q, k, v, 0.3, mask)
    assert got.shape == want.shape == (3, 2, 40, 16)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow():
    """Scores in the hundreds: the maximum is taken out before the power, as softmax does."""
    q, k, v = (t * 10 for t in qkv(1, 2, 16, 8, seed=5))
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0))
    got = np.array(cpu_attention(q, k, v, 1.0))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_each_thread_uses_streams_of_its_own(monkeypatch):
    monkeypatch.setattr(module, "_num_cores", lambda: 2)
    q, k, v = qkv(2, 2, 24, 8, seed=9)
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5))
    mine = module._streams(2)
    results: dict[str, object] = {}

    def other() -> None:
        with mx.stream(mx.new_stream(mx.cpu)):
            results["streams"] = module._streams(2)
            results["out"] = np.array(cpu_attention(q, k, v, 0.5))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    np.testing.assert_allclose(results["out"], want, rtol=1e-5, atol=1e-5)
    assert not any(a == b for a in mine for b in results["streams"])
    assert module._streams(2) == mine  # made once per thread
