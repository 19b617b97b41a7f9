"""The tiny test models load and generate with mlx-lm, are deterministic, and carry a usable chat tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.tiny import (
    ADDED_TOKENS,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tokenizer,
    tiny_model_cached,
)

ASCII_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # double\n",
    '  two  spaces, a\ttab, 3.14159, -42, 1e-3 and {"json": [1, 2]}',
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
]


@pytest.fixture(params=["tiny_model_dir", "tiny_qwen3_dir", "tiny_qwen3_next_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def _greedy(model, tokenizer, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    from mlx_lm import stream_generate

    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))
    return [r.token for r in responses], "".join(r.text for r in responses)


def test_generates_greedily_with_variety(model_dir: Path) -> None:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    tokens, streamed = _greedy(model, tokenizer, "Hello, world!", max_tokens=20)
    assert (tokens, streamed) == _greedy(model, tokenizer, "Hello, world!", max_tokens=20)
    assert len(tokens) == 20
    assert len(set(tokens)) >= 10, f"greedy output collapsed: {tokens}"

    text = mlx_lm.generate(model, tokenizer, "Hello, world!", max_tokens=20)
    assert text == streamed
    assert text.strip() == tokenizer.decode(tokens).strip()  # the streaming detokenizer drops a leading space
    assert text.isascii() and text.strip()
    assert not any(token in text for token in ADDED_TOKENS + ["<|im_start|>"]), text


def test_builds_are_byte_identical(tmp_path: Path) -> None:
    for arch in ("llama", "qwen3_next"):
        first = build_tiny_model(tmp_path / f"{arch}-a", arch, seed=7)
        second = build_tiny_model(tmp_path / f"{arch}-b", arch, seed=7)
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
        for name in names:
            assert (first / name).read_bytes() == (second / name).read_bytes(), f"{arch}: {name} differs"

    other_seed = build_tiny_model(tmp_path / "llama-c", "llama", seed=8)
    weights = (tmp_path / "llama-a" / "model.safetensors").read_bytes()
    assert (other_seed / "model.safetensors").read_bytes() != weights


def test_tiny_model_cached_reuses_the_folder(tmp_path: Path) -> None:
    path = tiny_model_cached(tmp_path, "llama", hidden_size=32)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_cached(tmp_path, "llama", hidden_size=32) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert tiny_model_cached(tmp_path, "llama", hidden_size=32, seed=1) != path
    staging_left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert staging_left == []


def test_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model arch 'gpt9'"):
        build_tiny_model(tmp_path, "gpt9")


def test_tokenizer_round_trips_and_knows_its_special_tokens(tmp_path: Path, tiny_model_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    wrapped = load_tokenizer(tmp_path)
    assert 900 <= len(hf) <= 1000
    for text in ASCII_TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == text
        assert wrapped.decode(wrapped.encode(text)) == text
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        assert len(hf.encode(token, add_special_tokens=False)) == 1, token
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and hf.bos_token is None

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(hf)
    assert hf.convert_tokens_to_ids("<|im_end|>") in config["eos_token_id"]


def test_chat_template_renders_roles_tools_and_tool_calls(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    build_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '{"name": "get_weather"' in text.split("\n</tools>")[0]
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<|im_start|>assistant\n<tool_call>\n{call_text}\n</tool_call><|im_end|>" in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    assert "<|im_start|>assistant\nIt is 21 degrees.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")

    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"


def test_qwen3_next_has_recurrent_and_attention_caches(tiny_qwen3_next_dir: Path) -> None:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import ArraysCache, KVCache, can_trim_prompt_cache, make_prompt_cache

    model, tokenizer = mlx_lm.load(str(tiny_qwen3_next_dir))
    cache = make_prompt_cache(model)
    assert {type(c) for c in cache} == {ArraysCache, KVCache}
    assert any(not c.is_trimmable() for c in cache)
    assert not can_trim_prompt_cache(cache)

    model(mx.array([tokenizer.encode("Hello, world!")]), cache=cache)
    mx.eval([c.state for c in cache])
    assert all(c.nbytes > 0 for c in cache)
