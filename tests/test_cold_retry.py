"""A request whose run from a cached state fails is run again from its start, once, without that state: it
succeeds with the output of a cold run, the entry is dropped, and one log line says so."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from structlog.testing import capture_logs

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest
from mlxd.engine.engine import BatchedEngine
from tests.helpers import collect
from tests.helpers import run_request as run

PROMPT = "A long agent prompt about parsers, checkers and the tests that keep them honest. " * 4


def ask(request_id: str, prompt: list[int]) -> EngineRequest:
    # Chunks of 32 tokens: a hybrid model keeps a snapshot at a chunk boundary, which the last run serves from.
    return EngineRequest(request_id=request_id, prompt=prompt, max_tokens=8, prefill_chunk=32)


def broken_state(model, num_tokens: int) -> list:
    """A cache that claims ``num_tokens`` tokens but whose arrays have shapes no layer of the model accepts: the
    first forward pass from it raises (a state corrupted in memory, or written by another model)."""
    layers = make_prompt_cache(model)
    for layer in layers:
        if isinstance(layer, KVCache):
            layer.update_and_fetch(mx.zeros((1, 1, num_tokens, 3)), mx.zeros((1, 1, num_tokens, 3)))
        elif isinstance(layer, ArraysCache):
            layer.state = [mx.zeros((1, 1, 3)) for _ in layer.state]
    mx.eval([layer.state for layer in layers])
    return layers


@pytest.mark.parametrize(("model_fixture", "kind"), [("tiny_model_dir", "prefix"), ("tiny_model_dir", "longer"),
                                                    ("tiny_qwen3_next_dir", "prefix")])
def test_a_state_that_fails_on_use_is_dropped_and_the_request_runs_cold(model_fixture, kind, request):
    model, tokenizer = load(str(request.getfixturevalue(model_fixture)))
    engine = BatchedEngine(model, EngineConfig(max_running=2, prefill_chunk=32, prefix_cache_min_tokens=32))
    engine.start()
    try:
        prompt = tokenizer.encode(PROMPT)
        cold, finished = run(engine, ask("cold", prompt))
        assert finished.num_cached_tokens == 0
        asyncio.run(engine.clear_prefix_cache())
        # An entry that holds the prompt's first 40 tokens, or (trimmed back: a "longer" hit) more than the prompt.
        entry = prompt[:40] if kind == "prefix" else prompt + tokenizer.encode(" and more")
        k = 40 if kind == "prefix" else len(prompt) - 1
        engine.reuse.keep(entry, broken_state(model, len(entry)))
        assert engine.cache_stats()["num_entries"] == 1
        with capture_logs() as logs:
            tokens, finished = run(engine, ask("warm", prompt))
        assert tokens == cold
        assert finished.num_cached_tokens == 0 and finished.cache_hit == "miss"
        failed = [line for line in logs if line["event"] == "prefix_entry_failed"]
        assert len(failed) == 1, logs
        assert failed[0]["request_id"] == "warm" and failed[0]["num_cached_tokens"] == k
        assert failed[0]["cache_hit"] == kind and failed[0]["num_entry_tokens"] == len(entry)
        assert failed[0]["entry_dropped"] is True
        assert not [line for line in logs if line["event"] == "request_failed"]
        # The broken entry is gone: what the prompt now hits is the state the cold run kept, and it serves.
        hit = engine.reuse.lookup(prompt)
        assert hit.num_cached > 0
        assert all(layer.keys.shape[-1] != 3 for layer in hit.cache if isinstance(layer, KVCache))
        with capture_logs() as logs:
            again, finished = run(engine, ask("again", prompt))
        assert again == cold and finished.num_cached_tokens > 0
        assert not [line for line in logs if line["event"] in ("prefix_entry_failed", "request_failed")]
        assert engine.status()["running"] == [] and engine.status()["waiting"] == []
    finally:
        engine.stop()


def test_a_broken_state_in_a_shared_pass_fails_only_its_own_request_and_it_runs_cold(tiny_model_dir):
    """Rests of prompts that start from cached states share one forward pass; one broken state fails the pass, the
    rows are retried alone, and only the broken one runs again from its start."""
    model, tokenizer = load(str(tiny_model_dir))
    engine = BatchedEngine(model, EngineConfig(max_running=4, prefill_chunk=256, prefix_cache_min_tokens=32))
    engine.start()
    try:
        good, bad = (tokenizer.encode(f"Agent {name}: " + PROMPT) for name in ("one", "two"))
        cold = {name: run(engine, EngineRequest(request_id=f"cold-{name}", prompt=p, max_tokens=8))[0]
                for name, p in (("good", good), ("bad", bad))}
        asyncio.run(engine.clear_prefix_cache())
        run(engine, EngineRequest(request_id="warm-good", prompt=good[:60], max_tokens=1))  # a real state
        engine.reuse.keep(bad[:40], broken_state(model, 40))

        async def both():
            handles = [engine.submit(EngineRequest(request_id=name, prompt=p, max_tokens=8))
                       for name, p in (("good", good), ("bad", bad))]
            return {handle.request_id: await collect(handle) for handle in handles}

        with capture_logs() as logs:
            out = asyncio.run(both())
        assert out["good"][0] == cold["good"] and out["good"][1].num_cached_tokens > 0
        assert out["bad"][0] == cold["bad"] and out["bad"][1].num_cached_tokens == 0
        assert [line["request_id"] for line in logs if line["event"] == "prefix_entry_failed"] == ["bad"]
        assert not [line for line in logs if line["event"] == "request_failed"]
        groups = [line for line in logs if line["event"] == "prompt_group_failed"]
        assert groups and sorted(groups[0]["request_ids"]) == ["bad", "good"]
    finally:
        engine.stop()
