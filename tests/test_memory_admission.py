"""Memory admission against the tiny model: what the engine measures equals what caches really allocate; with a
limit of weights + about 2.5 requests' KV, two long requests run and a third waits for one to finish (all three
equal to their solo output); a request whose KV alone exceeds the limit is a 400 that names it; the prefix cache
gives its memory back to a request that needs it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxd.cache.prefix_cache import PrefixCache
from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, Token
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.schedule.memory import MIN_CACHE_BYTES, MemoryBudget, measure_kv_cost, measure_memory
from mlxd.errors import RequestError
from tests.helpers import app_client, write_config

LONG_PROMPTS = ["Once upon a time", "def fibonacci(n):", "Rain fell softly on the roof while"]
LONG_MAX_TOKENS = 300  # prompt + 300 tokens: two 256-token steps of KV each
CHUNK = 512


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def measured(reference) -> MemoryBudget:
    """What the engine measures at warm-up (the same function), read before configuring a limit."""
    model, _ = reference
    return measure_memory(model)


def solo_tokens(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def need(budget: MemoryBudget, prompt: list[int], max_tokens: int) -> int:
    return budget.kv.num_bytes(len(prompt) + max_tokens, CHUNK)


def long_requests(tokenizer: Any) -> list[EngineRequest]:
    return [EngineRequest(request_id=name, prompt=tokenizer.encode(text), max_tokens=LONG_MAX_TOKENS)
            for name, text in zip("abc", LONG_PROMPTS, strict=True)]


def start_engine(model: Any, limit_bytes: int, prefix_cache_bytes: int) -> BatchedEngine:
    config = EngineConfig(max_running=4, max_waiting=8, prefill_chunk=CHUNK, warmup_tokens=1,
                          memory_limit_bytes=limit_bytes, prefix_cache_bytes=prefix_cache_bytes)
    engine = BatchedEngine(model, config)
    engine.start()
    return engine


async def collect(engine: BatchedEngine, request: EngineRequest, order: list[tuple[str, str]]) -> list[int]:
    """The request's tokens; ``order`` gets ``(id, "first")`` at its first token and ``(id, "finished")``."""
    tokens: list[int] = []
    async for event in engine.submit(request).events():
        if isinstance(event, Token):
            if not tokens:
                order.append((request.request_id, "first"))
            tokens.append(event.token)
        elif isinstance(event, Finished | Failed):
            assert isinstance(event, Finished), event
            order.append((request.request_id, "finished"))
            return tokens
    raise AssertionError("the stream ended without a final event")


async def run_watched(engine: BatchedEngine, requests: list[EngineRequest],
                      timeout: float = 60) -> tuple[list, list[dict], list]:
    """Run requests concurrently, sampling ``engine.status()`` every few milliseconds meanwhile."""
    statuses: list[dict] = []
    order: list[tuple[str, str]] = []
    tasks = [asyncio.create_task(collect(engine, r, order)) for r in requests]
    deadline = time.monotonic() + timeout
    while not all(t.done() for t in tasks):
        if time.monotonic() > deadline:
            for task in tasks:
                task.cancel()
            raise AssertionError(f"requests still unfinished after {timeout}s; status: {engine.status()}")
        statuses.append(engine.status())
        await asyncio.sleep(0.005)
    return [t.result() for t in tasks], statuses, order


# ---- what is measured ----


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_measured_cost_equals_what_a_real_cache_allocates(arch, request):
    """Attention KV grows per token in 256-token steps; qwen3_next's recurrent layers add fixed bytes."""
    folder: Path = request.getfixturevalue("tiny_model_dir" if arch == "llama" else "tiny_qwen3_next_dir")
    model, _ = load(str(folder))
    cost = measure_kv_cost(model)
    assert cost.num_bytes_per_token > 0
    assert (cost.num_fixed_bytes > 0) == (arch == "qwen3_next")
    for num_tokens in (1, 255, 256, 257, 700):
        cache = make_prompt_cache(model)
        model(mx.zeros((1, num_tokens), dtype=mx.uint32), cache=cache)
        for _ in range(3):  # decode steps write into the same allocation
            model(mx.zeros((1, 1), dtype=mx.uint32), cache=cache)
        allocated = sum(layer.nbytes for layer in cache)
        assert allocated == cost.num_bytes(num_tokens + 3), (num_tokens, allocated)


def test_a_rotating_cache_stops_growing_at_its_window(reference):
    model, _ = reference

    class WithoutMakeCache:  # the model's interface minus make_cache: the engine then builds rotating layers
        layers = model.layers

        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            return model(inputs, cache=cache)

    plain, rotating = measure_kv_cost(model), measure_kv_cost(WithoutMakeCache(), max_kv_size=100)
    assert rotating.num_bytes_per_token == 0 and rotating.windows == ((100, plain.num_bytes_per_token),)
    assert rotating.num_bytes(10_000, chunk=8) == rotating.num_bytes(256, chunk=8) < plain.num_bytes(10_000)


def test_the_tiny_model_numbers(measured, reference, tiny_model_dir):
    model, _ = reference
    args = model.args
    bytes_per_token = args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim * 4  # float32 K and V
    assert measured.kv.num_bytes_per_token_total == bytes_per_token
    assert measured.kv.num_fixed_bytes == 0
    on_disk = mx.load(str(tiny_model_dir / "model.safetensors"))  # float32 as written
    assert measured.weights_bytes == sum(array.nbytes for array in on_disk.values())
    assert measured.limit_bytes > measured.weights_bytes  # the default: a share of RAM here


def test_prefix_cache_shrinks_least_recently_used_first():
    cache = PrefixCache(budget_bytes=10**6)

    def layers(num_tokens: int) -> list[KVCache]:
        layer = KVCache()
        layer.update_and_fetch(mx.ones((1, 2, num_tokens, 4)), mx.ones((1, 2, num_tokens, 4)))
        return [layer]

    for start in (10, 20, 30):
        assert cache.insert([start, start + 1, start + 2], layers(3))
    each = cache.num_bytes // 3
    cache.lookup([10, 11, 12, 13])  # 10… is now the most recently used
    assert cache.shrink(each) == 2 * each
    assert cache.num_bytes == each and cache.stats()["num_evictions"] == 2
    assert cache.lookup([10, 11, 12, 13]).num_cached == 3
    assert cache.shrink(each) == 0  # already within


# ---- admission ----


def test_two_run_and_the_third_waits_for_room(reference, measured):
    model, tokenizer = reference
    requests = long_requests(tokenizer)
    per_request = max(need(measured, r.prompt, r.max_tokens) for r in requests)
    assert per_request == min(need(measured, r.prompt, r.max_tokens) for r in requests)  # padding costs nothing
    limit = measured.weights_bytes + per_request * 5 // 2
    engine = start_engine(model, limit, prefix_cache_bytes=0)
    try:
        outputs, statuses, order = asyncio.run(run_watched(engine, requests))
    finally:
        engine.stop()
    running = [len(s["running"]) for s in statuses]
    assert max(running) == 2
    assert any(len(s["running"]) == 2 and len(s["waiting"]) == 1 for s in statuses)
    assert all(s["memory"]["kv_reserved_bytes"] <= limit - measured.weights_bytes for s in statuses)
    # c, last in line, starts only once a or b has finished and given its room back.
    first_finish = next(i for i, (_, what) in enumerate(order) if what == "finished")
    assert order.index(("c", "first")) > first_finish
    for request, output in zip(requests, outputs, strict=True):
        assert output == solo_tokens(model, request.prompt, request.max_tokens), request.request_id


def test_the_prefix_cache_gives_way_to_a_request_that_needs_the_room(reference, measured):
    model, tokenizer = reference
    fills = [EngineRequest(request_id=f"fill-{i}", prompt=tokenizer.encode(text), max_tokens=8)
             for i, text in enumerate(["Hello", "What is 2 + 2?", "The quick brown fox", "SELECT name FROM users"])]
    big_prompt = tokenizer.encode("Machine learning models learn patterns from data. " * 30)
    big = EngineRequest(request_id="big", prompt=big_prompt, max_tokens=200)
    # Room for the big request and one fill request's snapshot beside it.
    room = max(need(measured, r.prompt, r.max_tokens) for r in fills)
    kv_budget = need(measured, big.prompt, big.max_tokens) + room
    engine = start_engine(model, measured.weights_bytes + kv_budget, prefix_cache_bytes=10 * kv_budget)
    try:
        for request in fills:  # one at a time: each leaves a snapshot of its prompt and output
            asyncio.run(run_watched(engine, [request]))
        before = engine.cache_stats()
        assert before["num_bytes"] > room
        (output,), statuses, _ = asyncio.run(run_watched(engine, [big]))
        after = engine.cache_stats()
    finally:
        engine.stop()
    assert output == solo_tokens(model, big.prompt, big.max_tokens)
    assert after["num_evictions"] > before["num_evictions"]
    # While it runs (up to its last token, whose snapshot lands as it finishes), the cache keeps to the room left.
    while_running = [s["memory"] for s in statuses
                     if s["running"] and s["running"][0]["num_generated_tokens"] < big.max_tokens - 1]
    assert len(while_running) > 5 and all(m["prefix_cache_bytes"] <= room for m in while_running)
    assert all(m["kv_reserved_bytes"] + m["prefix_cache_bytes"] <= kv_budget for m in while_running)


def test_a_request_that_can_never_fit_is_refused_at_submit(reference, measured):
    model, tokenizer = reference
    prompt = tokenizer.encode("Once upon a time")
    limit = measured.weights_bytes + need(measured, prompt, 100)
    engine = start_engine(model, limit, prefix_cache_bytes=0)

    async def submit(max_tokens: int) -> None:
        engine.submit(EngineRequest(request_id=f"r{max_tokens}", prompt=prompt, max_tokens=max_tokens))

    try:
        with pytest.raises(RequestError, match=f"memory limit of {limit} bytes") as refused:
            asyncio.run(submit(2000))
        assert refused.value.param == "max_tokens" and refused.value.status == 400
        assert engine.status()["waiting"] == []  # nothing was queued for it
    finally:
        engine.stop()


def test_over_http_the_refusal_is_a_400_naming_the_limit_and_status_shows_memory(tiny_model_dir, tmp_path,
                                                                                 measured):
    kv_budget = measured.kv.num_bytes(1000)
    limit = measured.weights_bytes + kv_budget
    extra = f"[engine]\nmax_running = 4\nwarmup_tokens = 1\nmemory_limit_bytes = {limit}\n"
    with app_client(write_config(tmp_path, tiny_model_dir, extra=extra)) as (client, _):
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2000}
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "max_tokens" and f"memory limit of {limit} bytes" in error["message"]
        fine = client.post("/v1/completions", json={**body, "max_tokens": 8})
        assert fine.status_code == 200, fine.text
        memory = client.get("/v1/status").json()["memory"]
    assert memory["limit_bytes"] == limit
    assert memory["weights_bytes"] == measured.weights_bytes
    assert memory["kv_bytes_per_token"] == measured.kv.num_bytes_per_token_total
    assert memory["kv_reserved_bytes"] == 0  # nothing runs now
    assert 0 <= memory["prefix_cache_bytes"] <= kv_budget


def test_the_engine_caps_mlx_buffer_cache_at_a_share_of_what_the_weights_leave(reference, measured):
    """Freed buffers MLX keeps for reuse are capped (by default they may fill the whole memory limit, and hold what
    other processes on the device need): a quarter of the KV budget, never below the floor."""
    model, _ = reference
    limit = measured.weights_bytes + 8 * 1024**3
    engine = start_engine(model, limit, prefix_cache_bytes=0)
    try:
        cap = mx.set_cache_limit(0)  # returns the limit in force
        mx.set_cache_limit(cap)
    finally:
        engine.stop()
    assert cap == 2 * 1024**3 == engine.memory.cache_limit_bytes
    small = MemoryBudget(limit_bytes=measured.weights_bytes + 1024**2, weights_bytes=measured.weights_bytes,
                         kv=measured.kv)
    assert small.cache_limit_bytes == MIN_CACHE_BYTES
