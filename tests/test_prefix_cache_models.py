"""The prefix cache with real (tiny, float32) models: a hit yields exactly the tokens of a cold run.

``serve`` below plays the engine: look the prompt up, prefill the rest in chunks with a snapshot at every chunk
boundary and at ``checkpoint_length`` (all but the last prompt token), decode greedily, and snapshot the finished
request (prompt and reply). A counting wrapper around the model checks that a k-token hit makes the model process
exactly n - k prompt tokens.
"""

from __future__ import annotations

import gc
import math
import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from mlxd.cache import PrefixCache, checkpoint_length

MAX_TOKENS = 8
CHUNK = 24


class CountingModel:
    """The model, counting the tokens it is given."""

    def __init__(self, model) -> None:
        self.model = model
        self.num_tokens = 0

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        self.num_tokens += inputs.shape[1]
        return self.model(inputs, cache=cache)

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)


def _prefill(model, tokens: list[int], cache: list, start: int, stop: int, on_boundary=None) -> None:
    pos = start
    while pos < stop:
        end = min(pos + CHUNK, stop)
        model(mx.array([tokens[pos:end]]), cache=cache)
        mx.eval([c.state for c in cache])
        pos = end
        if on_boundary is not None:
            on_boundary(pos)


def _decode(model, last: int, cache: list) -> list[int]:
    out, y = [], mx.array([[last]])
    for _ in range(MAX_TOKENS):
        token = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1).item()
        out.append(token)
        y = mx.array([[token]])
    return out


def serve(model: CountingModel, prompt: list[int], prefix_cache: PrefixCache | None = None):
    """Greedy tokens for ``prompt``, the prompt tokens the model processed, and the lookup's hit (or None)."""
    hit = prefix_cache.lookup(prompt) if prefix_cache is not None else None
    cache = hit.cache if hit is not None and hit.cache is not None else model.make_cache()
    start = hit.num_cached if hit is not None else 0
    insert = (lambda pos: prefix_cache.insert(prompt[:pos], cache)) if prefix_cache is not None else None
    before = model.num_tokens
    _prefill(model, prompt, cache, start, checkpoint_length(len(prompt)), insert)
    num_processed = model.num_tokens - before + 1
    tokens = _decode(model, prompt[-1], cache)
    if prefix_cache is not None:  # the cache holds the prompt and every generated token but the last
        prefix_cache.insert(prompt + tokens[:-1], cache)
    return tokens, num_processed, hit


def cold(model: CountingModel, prompt: list[int]) -> list[int]:
    return serve(model, prompt)[0]


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    return CountingModel(model), tokenizer


def _long_memory(model) -> None:
    """Slow the linear-attention layers' decay and amplify their output.

    Random weights make the recurrent state fade within a token or two and barely reach the logits; with these
    changes the state carries across the whole prompt, so an output computed from a wrong state differs.
    """
    for layer in model.model.layers:
        if layer.is_linear:
            attn = layer.linear_attn
            attn.A_log = mx.full(attn.A_log.shape, math.log(0.02))
            attn.out_proj.weight = attn.out_proj.weight * 8


@pytest.fixture(scope="module")
def qwen3_next(tiny_qwen3_next_dir):
    model, tokenizer = mlx_lm.load(str(tiny_qwen3_next_dir))
    _long_memory(model)
    return CountingModel(model), tokenizer


def _message(tokenizer, role: str, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n", add_special_tokens=False)


def _generation_prompt(tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)


def _stored_state(model: CountingModel, tokens: list[int]) -> list:
    cache = model.make_cache()
    _prefill(model, tokens, cache, 0, len(tokens))
    return cache


def _prompt(tokenizer) -> list[int]:
    system = _message(tokenizer, "system", "You are a helpful assistant. Answer briefly.")
    user = _message(tokenizer, "user", "What is the capital of France? Please summarise the report.")
    return system + user + _generation_prompt(tokenizer)


KINDS = {  # what is stored, given the prompt p and a 6-token tail t of other text
    "exact": lambda p, t: p,
    "prefix": lambda p, t: p[: len(p) - 9],
    "longer": lambda p, t: p + t,
    "diverged": lambda p, t: p[: len(p) - 9] + t,
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_match_kind_continues_exactly_like_a_cold_run(llama, kind):
    model, tokenizer = llama
    prompt = _prompt(tokenizer)
    tail = tokenizer.encode(" The quick brown fox jumps", add_special_tokens=False)[:6]
    stored = KINDS[kind](prompt, tail)
    prefix_cache = PrefixCache(budget_bytes=1 << 24)
    assert prefix_cache.insert(stored, _stored_state(model, stored))

    tokens, num_processed, hit = serve(model, prompt, prefix_cache)
    expected_cached = {"exact": len(prompt) - 1, "longer": len(prompt) - 1}.get(kind, len(prompt) - 9)
    assert (hit.kind, hit.num_cached) == (kind, expected_cached)
    assert num_processed == len(prompt) - hit.num_cached
    assert tokens == cold(model, prompt)


def _conversation(model, tokenizer, prefix_cache, turns: list[str]):
    """Run an agent loop; yields (prompt, reply, hit, tokens processed) per turn, each checked against a cold run."""
    history = _message(tokenizer, "system", "You are a helpful assistant.")
    for text in turns:
        history = history + _message(tokenizer, "user", text)
        prompt = history + _generation_prompt(tokenizer)
        tokens, num_processed, hit = serve(model, prompt, prefix_cache)
        assert tokens == cold(model, prompt)
        yield prompt, tokens, hit, num_processed
        history = prompt + tokens + tokenizer.encode("<|im_end|>\n", add_special_tokens=False)


TURNS = ["What's the weather in Paris?", "And in Berlin, tomorrow morning?", "Thanks! Write a haiku about it."]


def test_hybrid_model_hits_across_a_multi_turn_conversation(qwen3_next):
    model, tokenizer = qwen3_next
    prefix_cache = PrefixCache(budget_bytes=1 << 26)
    num_expected = 0
    for prompt, reply, hit, num_processed in _conversation(model, tokenizer, prefix_cache, TURNS):
        expected = ("prefix", num_expected) if num_expected else ("miss", 0)
        assert (hit.kind, hit.num_cached) == expected
        assert num_processed == len(prompt) - hit.num_cached
        num_expected = len(prompt) + len(reply) - 1  # the finished request's state: prompt and reply but the last

    # Resending the last prompt reuses all of it but its last token, though the cache cannot be trimmed.
    tokens, num_processed, hit = serve(model, prompt, prefix_cache)
    assert (hit.kind, hit.num_cached, num_processed) == ("prefix", len(prompt) - 1, 1)
    assert tokens == cold(model, prompt)


def test_the_hybrid_oracle_sees_the_recurrent_state(qwen3_next):
    model, tokenizer = qwen3_next
    prompt = _prompt(tokenizer)
    prefix_cache = PrefixCache(budget_bytes=1 << 26)
    prefix_cache.insert(prompt[:-20], _stored_state(model, prompt[:-20]))
    hit = prefix_cache.lookup(prompt)
    assert any(isinstance(layer, ArraysCache) for layer in hit.cache)
    cache = [ArraysCache(size=2) if isinstance(layer, ArraysCache) else layer for layer in hit.cache]
    _prefill(model, prompt, cache, hit.num_cached, len(prompt) - 1)
    assert _decode(model, prompt[-1], cache) != cold(model, prompt)  # so equal outputs prove the state was right


def test_hybrid_model_never_reuses_state_past_where_conversations_diverge(qwen3_next):
    model, tokenizer = qwen3_next
    prefix_cache = PrefixCache(budget_bytes=1 << 26)
    first = list(_conversation(model, tokenizer, prefix_cache, TURNS[:2]))
    base = first[0][0]  # turn one's prompt, then a different second user message (as if the reply was dropped)
    branch = base + _message(tokenizer, "user", "Tell me a story about the sea.") + _generation_prompt(tokenizer)
    shared = next(i for i, (a, b) in enumerate(zip(first[1][0], branch, strict=False)) if a != b)
    tokens, num_processed, hit = serve(model, branch, prefix_cache)
    assert hit.kind == "prefix" and hit.num_cached <= shared
    assert hit.num_cached >= len(base) - 1  # turn one's checkpoint, or a later chunk boundary before `shared`
    assert num_processed == len(branch) - hit.num_cached
    assert tokens == cold(model, branch)
    assert prefix_cache.stats()["hits"]["prefix"] >= 2


def test_trimmable_model_keeps_one_entry_per_conversation(llama):
    model, tokenizer = llama
    prefix_cache = PrefixCache(budget_bytes=1 << 26)
    results = list(_conversation(model, tokenizer, prefix_cache, TURNS))
    assert [hit.kind for _, _, hit, _ in results] == ["miss", "prefix", "prefix"]
    stats = prefix_cache.stats()
    assert stats["num_entries"] == 1  # every chunk boundary and earlier turn is a strict prefix of the last
    assert stats["num_dominated_dropped"] == stats["num_inserts"] - 1
    assert stats["num_tokens_reused"] == sum(hit.num_cached for _, _, hit, _ in results)

    # An edited earlier turn: the stored conversation is trimmed back to where the edit starts.
    edited = results[1][0][:-12] + tokenizer.encode("Rome?<|im_end|>\n", add_special_tokens=False)
    tokens, num_processed, hit = serve(model, edited, prefix_cache)
    assert hit.kind == "diverged" and hit.num_cached == len(results[1][0]) - 12
    assert num_processed == len(edited) - hit.num_cached and tokens == cold(model, edited)


def test_byte_budget_holds_under_a_soak_of_distinct_prompts(llama):
    model, tokenizer = llama
    rng = random.Random(0)
    budget = 1 << 20
    serve(model, _prompt(tokenizer))  # warm up, so that the baseline holds what a first request leaves behind
    gc.collect()
    baseline = mx.get_active_memory()
    prefix_cache = PrefixCache(budget_bytes=budget)
    stems = [[rng.randrange(3, 900) for _ in range(rng.randrange(20, 200))] for _ in range(8)]
    for i in range(60):
        stem = stems[i % len(stems)]
        prompt = stem[: rng.randrange(10, len(stem) + 1)] + [rng.randrange(3, 900) for _ in range(rng.randrange(2, 40))]
        serve(model, prompt, prefix_cache)
        assert prefix_cache.stats()["num_bytes"] <= budget
    stats = prefix_cache.stats()
    assert stats["num_evictions"] > 0 and stats["num_hits"] > 0
    gc.collect()
    assert mx.get_active_memory() <= baseline + budget + (1 << 18)
    prefix_cache.clear()
    gc.collect()
    assert mx.get_active_memory() <= baseline + (1 << 18)
