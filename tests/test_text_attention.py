"""mlxd.models.text_attention: a tiny Llama and Qwen2 give the same logits with prompt passes through numpy's blocked
attention as through mlx-lm's own modules (the oracle): a long prompt in one pass, the same prompt continued after a
cached prefix, a left-padded batch, and the decode steps after them."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxd.models import prompt_attention
from mlxd.models.text_attention import MIN_QUERIES, CpuTextAttention, use_cpu_text_attention


def tiny(family: str, seed: int = 0):
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs(model_type=family, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                            num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                            rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


def swapped(family: str):
    model = tiny(family)
    assert use_cpu_text_attention(model) == 2
    assert all(isinstance(layer.self_attn, CpuTextAttention) for layer in model.model.layers)
    return model


def tokens(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 97, length).tolist()


def run(model, chunks: list[list[int]], steps: int = 3) -> list[np.ndarray]:
    """Logits of each prompt chunk in turn on one cache, then of ``steps`` greedy decode steps."""
    cache = make_prompt_cache(model)
    out = []
    for chunk in chunks:
        logits = model(mx.array([chunk]), cache=cache)
        out.append(np.array(logits))
    for _ in range(steps):
        logits = model(mx.array([[int(np.argmax(out[-1][0, -1]))]]), cache=cache)
        out.append(np.array(logits))
    return out


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several query and key blocks per pass, so that block edges, skipped blocks and rescaling are exercised."""
    monkeypatch.setattr(prompt_attention, "BLOCK_QUERIES", 30)
    monkeypatch.setattr(prompt_attention, "BLOCK_KEYS", 64)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("split", [None, 100, 7], ids=["one pass", "after 100 cached", "after 7 cached"])
def test_long_prompt_logits_equal_mlx_lm(family, split):
    prompt = tokens(300, seed=1)
    chunks = [prompt] if split is None else [prompt[:split], prompt[split:]]
    want, got = run(tiny(family), chunks), run(swapped(family), chunks)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("min_keys", [4096, 100], ids=["decode by MLX", "decode blocked"])
def test_left_padded_batch_logits_equal_mlx_lm(monkeypatch, min_keys):
    """Two prompts of 150 and 90 tokens in one left-padded pass (as the engine batches prompts), then decode."""
    monkeypatch.setattr("mlxd.models.text_attention.MIN_KEYS", min_keys)
    prompts = [tokens(150, seed=2), tokens(90, seed=3)]
    padding = [0, 60]

    def batch(model):
        cache = [BatchKVCache(left_padding=padding) for _ in model.layers]
        inputs = mx.array([[0] * pad + p for p, pad in zip(prompts, padding, strict=True)])
        logits = [np.array(model(inputs, cache=cache))]
        logits.append(np.array(model(mx.array([[5], [6]]), cache=cache)))
        return logits

    want, got = batch(tiny("llama")), batch(swapped("llama"))
    np.testing.assert_allclose(got[0][0], want[0][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[0][1, 60:], want[0][1, 60:], rtol=1e-4, atol=1e-4)  # the padding's own rows
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_only_prompt_passes_and_long_decode_steps_take_the_blocked_path(monkeypatch):
    calls = []
    real = prompt_attention.prompt_attention
    monkeypatch.setattr("mlxd.models.text_attention.prompt_attention",
                        lambda *a, **k: calls.append(a[0].shape[2]) or real(*a, **k))
    run(swapped("llama"), [tokens(MIN_QUERIES - 1, seed=4), tokens(MIN_QUERIES, seed=5)], steps=2)
    assert calls == [MIN_QUERIES, MIN_QUERIES]  # the 16-token chunk, in each of 2 layers; not 15 nor decode
    calls.clear()
    monkeypatch.setattr("mlxd.models.text_attention.MIN_KEYS", 40)
    run(swapped("llama"), [tokens(MIN_QUERIES - 1, seed=4), tokens(24, seed=5)], steps=2)
    assert calls == [24, 24, 1, 1, 1, 1]  # decode steps over 40 and 41 keys: blocked; the 15-token chunk not


def test_long_decode_steps_equal_mlx_lm(monkeypatch):
    monkeypatch.setattr("mlxd.models.text_attention.MIN_KEYS", 100)
    chunks = [tokens(120, seed=6)]
    for a, b in zip(run(swapped("llama"), chunks, steps=4), run(tiny("llama"), chunks, steps=4), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_weights_keep_their_names():
    """The swapped modules hold the same arrays under the same parameter names (state dicts, sharing unchanged)."""
    from mlx.utils import tree_flatten

    before = dict(tree_flatten(tiny("llama").parameters()))
    after = dict(tree_flatten(swapped("llama").parameters()))
    assert before.keys() == after.keys()
    assert all(np.array_equal(np.array(before[n]), np.array(after[n])) for n in before)


def test_other_families_are_left_alone():
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=32, num_hidden_layers=1, intermediate_size=48,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
                           max_position_embeddings=128, rope_theta=10000.0, head_dim=8, tie_word_embeddings=True)
    assert use_cpu_text_attention(qwen3.Model(args)) == 0


def test_load_swaps_them_on_the_cpu(tiny_model_dir):
    """mlxd's load of a Llama folder on the CPU serves prompt passes through the blocked attention."""
    from mlxd.config.schema import ModelConfig
    from mlxd.models.load import load

    assert mx.default_device() == mx.cpu
    model = load(ModelConfig(source=str(tiny_model_dir))).model
    assert all(isinstance(layer.self_attn, CpuTextAttention) for layer in model.model.layers)
