"""Verify passes over padded attention caches (mlxd/engine/padded.py) compute what unpadded ones compute."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxd.engine.step.padded import BUCKET, PaddedLayer, bucket, padded


@pytest.fixture(scope="module")
def model(tiny_qwen3_dir):
    return load(str(tiny_qwen3_dir))[0]


def prefilled(model, prompt: list[int], batch: bool) -> list:
    cache = [BatchKVCache(left_padding=[0]) for _ in model.layers] if batch else make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    return cache


@pytest.mark.parametrize("batch", [False, True], ids=["KVCache", "BatchKVCache"])
@pytest.mark.parametrize("length", [37, 253, 256, 300, 1030])
def test_a_padded_multi_token_pass_equals_the_plain_one(model, batch, length):
    prompt = [(7 * i) % 900 + 3 for i in range(length)]
    block = [11, 12, 13, 14]
    plain_cache, padded_cache = prefilled(model, prompt, batch), prefilled(model, prompt, batch)
    expected = model(mx.array([block]), cache=plain_cache)
    seen = padded(padded_cache)
    assert all(isinstance(layer, PaddedLayer) for layer in seen)
    got = model(mx.array([block]), cache=seen)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
    # The caches hold the same state afterwards: only what the model read was padded.
    for mine, theirs in zip(padded_cache, plain_cache, strict=True):
        mine_keys, theirs_keys = (c.keys[..., : length + len(block), :] for c in (mine, theirs))
        assert mx.array_equal(mine_keys, theirs_keys).item()
    # What the model attended over: a whole bucket.
    keys, _ = PaddedLayer(prefilled(model, prompt, batch)[0]).update_and_fetch(
        mx.zeros((1, 2, 2, 16)), mx.zeros((1, 2, 2, 16)))
    assert keys.shape[2] == bucket(length + 2) and keys.shape[2] % BUCKET == 0


def test_the_mask_hides_the_padding_and_keeps_causality():
    layer = PaddedLayer(make_prompt_cache_stub(offset=5))
    mask = layer.make_mask(3)
    assert mask.shape == (3, BUCKET)
    assert mask[0, :6].all().item() and not mask[0, 6:].any().item()
    assert mask[2, :8].all().item() and not mask[2, 8:].any().item()


def make_prompt_cache_stub(offset: int):
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, offset, 4)), mx.zeros((1, 1, offset, 4)))
    return cache
