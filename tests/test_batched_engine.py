"""The batching engine against oracles: batched greedy output equals each request's solo output, prompts are
processed in counted chunks, a newcomer joins a running stream within one chunk plus one step, and the queue
answers 429 once full. Tiny random models (float32), real sockets for the HTTP parts."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import mlx.core as mx
import pytest
from mlx_lm import generate, load
from mlx_lm.generate import generate_step

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, SamplingParams, Token
from mlxd.engine.engine import BatchedEngine
from tests.helpers import app_client, free_port, serve_subprocess, write_config

PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Hello",
    "What is the capital of France? The capital of France is",
    "SELECT name, COUNT(*) FROM users",
    "Rain fell softly on the roof while",
    "1 2 3 4 5 6 7 8 9",
]
NO_EOS = {"0": -100.0, "2": -100.0}  # the tiny tokenizer's end-of-sequence ids: keep long streams going


@dataclass
class Call:
    at: float
    batch: int
    length: int
    last_logits: Any


class CountingModel:
    """Wraps an mlx-lm model with its real interface; records each forward pass (shape, time, last logits)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[Call] = []
        self.gate = threading.Event()  # cleared: the next forward pass waits (holds the engine mid-step)
        self.gate.set()

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        self.gate.wait()
        logits = self.model(inputs, cache=cache, **kwargs)
        last = None
        if inputs.shape[1] > 1:  # a prompt chunk: keep its logits, evaluated here on the engine's own thread
            last = logits[:, -1, :]
            mx.eval(last)
        self.calls.append(Call(time.monotonic(), inputs.shape[0], inputs.shape[1], last))
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load(str(tiny_model_dir))


def solo_tokens(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


async def collect_tokens(engine: BatchedEngine, request: EngineRequest, on_token=None) -> list[int]:
    handle = engine.submit(request)
    tokens = []
    async for event in handle.events():
        if isinstance(event, Token):
            tokens.append(event.token)
            if on_token is not None:
                on_token(len(tokens))
        elif isinstance(event, Finished | Failed):
            assert isinstance(event, Finished), event
            return tokens
    return tokens


@pytest.fixture
def counted_engine(reference):
    model, _ = reference
    counting = CountingModel(model)
    engine = BatchedEngine(counting, EngineConfig(max_running=4, step_token_budget=64, prefill_chunk=8))
    engine.start()
    counting.calls.clear()  # warm-up
    yield engine, counting
    engine.stop()


def test_a_prompt_takes_ceil_n_over_c_forward_passes_with_one_passes_logits(counted_engine, reference):
    engine, counting = counted_engine
    model, tokenizer = reference
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)
    chunk, max_tokens = 8, 3
    assert len(prompt) % chunk > 1  # a last chunk of one token would look like a decode step
    request = EngineRequest(request_id="a", prompt=prompt, max_tokens=max_tokens, prefill_chunk=chunk)
    tokens = asyncio.run(collect_tokens(engine, request))
    assert tokens == solo_tokens(model, prompt, max_tokens)
    num_chunks = math.ceil(len(prompt) / chunk)
    shapes = [(c.batch, c.length) for c in counting.calls]
    expected_chunks = [(1, chunk)] * (num_chunks - 1) + [(1, len(prompt) - chunk * (num_chunks - 1))]
    assert shapes[:num_chunks] == expected_chunks
    assert shapes[num_chunks:] == [(1, 1)] * max_tokens
    assert sum(length * batch for batch, length in shapes) == len(prompt) + max_tokens
    one_pass = model(mx.array(prompt)[None])[:, -1, :]
    chunked = counting.calls[num_chunks - 1].last_logits
    assert mx.allclose(one_pass, chunked, atol=1e-5).item()
    assert mx.argmax(one_pass).item() == mx.argmax(chunked).item()


def test_a_newcomer_joins_a_lone_stream_within_one_chunk_and_one_step(counted_engine, reference):
    engine, counting = counted_engine
    model, tokenizer = reference
    long_prompt, new_prompt = tokenizer.encode("Once upon a time"), tokenizer.encode("def fibonacci(n): return")
    bias = {0: -100.0, 2: -100.0}
    lone = EngineRequest(request_id="lone", prompt=long_prompt, max_tokens=120, prefill_chunk=32,
                         sampling=SamplingParams(logit_bias=bias))
    newcomer = EngineRequest(request_id="new", prompt=new_prompt, max_tokens=12, prefill_chunk=32)
    marks: dict[str, Any] = {}

    async def scenario():
        started = asyncio.Event()

        def on_lone_token(n: int) -> None:
            if n == 10:
                started.set()

        lone_task = asyncio.create_task(collect_tokens(engine, lone, on_lone_token))
        await started.wait()
        marks["calls_at_submit"] = len(counting.calls)
        new_tokens = await collect_tokens(engine, newcomer)
        return await lone_task, new_tokens

    lone_tokens, new_tokens = asyncio.run(scenario())
    assert new_tokens == solo_tokens(model, new_prompt, 12)
    with_bias = [t for t, _ in generate_step(mx.array(long_prompt), model, max_tokens=120,
                                             logits_processors=engine_processors(bias))]
    assert lone_tokens == with_bias
    after = [(c.batch, c.length) for c in counting.calls[marks["calls_at_submit"]:]]
    chunk_at = after.index((1, len(new_prompt)))
    # Before the newcomer's chunk: at most the lone stream's step already under way when it arrived (two when the
    # event loop thread was switched out between counting and submitting, on a busy 2-core machine).
    assert chunk_at <= 2, after[:5]
    assert after[chunk_at + 1] == (2, 1)  # the very next step decodes both, emitting the newcomer's first token


@pytest.mark.parametrize("bucket", [1, 16])  # 16: as on GPU backends (mlxd.engine.step.prompts.GROUP_BUCKET)
def test_short_prompts_arriving_together_share_one_forward_pass(reference, monkeypatch, bucket):
    monkeypatch.setattr("mlxd.engine.step.prompts.group_bucket", lambda: bucket)
    model, tokenizer = reference
    counting = CountingModel(model)
    engine = BatchedEngine(counting, EngineConfig(max_running=5, step_token_budget=256, prefill_chunk=64))
    engine.start()
    prompts = [tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[6])]
    blocker = EngineRequest(request_id="blocker", prompt=[5], max_tokens=10_000)
    requests = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=16, prefill_chunk=64)
                for i, p in enumerate(prompts)]

    async def scenario():
        decoding = asyncio.Event()
        blocking = asyncio.create_task(collect_tokens(engine, blocker, lambda n: decoding.set()))
        await decoding.wait()
        counting.gate.clear()  # the engine stops inside its next step until all four have arrived
        await asyncio.sleep(0.05)
        counting.calls.clear()
        tasks = [asyncio.create_task(collect_tokens(engine, r)) for r in requests]
        await asyncio.sleep(0.05)
        counting.gate.set()
        outputs = await asyncio.gather(*tasks)
        engine.cancel("blocker")
        await blocking
        return outputs

    try:
        got = asyncio.run(scenario())
    finally:
        counting.gate.set()
        engine.stop()
    prefill_calls = [(c.batch, c.length) for c in counting.calls if c.length > 1]
    longest = max(len(p) for p in prompts)
    assert prefill_calls == [(4, math.ceil(longest / bucket) * bucket)]  # left-padded, one pass
    assert bucket == 1 or longest % bucket  # the padding was rounded up
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == solo_tokens(model, prompt, 16)


async def send_apart(engine: BatchedEngine, requests: list[EngineRequest], gap_s: float) -> list[list[int]]:
    """Submit ``requests`` ``gap_s`` apart; each one's tokens, in order."""
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(collect_tokens(engine, request)))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize(("gather_ms", "gap_s", "expected_passes"), [(100.0, 0.02, 1), (0.0, 0.1, 2)])
def test_requests_that_wake_an_idle_engine_together_start_in_one_prompt_pass(reference, gather_ms, gap_s,
                                                                              expected_passes):
    model, tokenizer = reference
    counting = CountingModel(model)
    engine = BatchedEngine(counting, EngineConfig(max_running=4, step_token_budget=256, prefill_chunk=64,
                                                  gather_ms=gather_ms))
    engine.start()
    counting.calls.clear()  # warm-up
    prompts = [tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[4])]
    requests = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=8, prefill_chunk=64)
                for i, p in enumerate(prompts)]

    try:
        got = asyncio.run(send_apart(engine, requests, gap_s))  # the first wakes the engine
    finally:
        engine.stop()
    prefill_calls = [(c.batch, c.length) for c in counting.calls if c.length > 1]
    if expected_passes == 1:  # gathered: one left-padded pass
        assert prefill_calls == [(3, max(len(p) for p in prompts))]
    else:  # not gathered: the first prompt ran alone, before the others arrived
        assert prefill_calls[0] == (1, len(prompts[0])) and len(prefill_calls) >= 2, prefill_calls
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == solo_tokens(model, prompt, 8)


@pytest.mark.parametrize(("preparing", "expected_passes"), [(True, 1), (False, 2)])
def test_a_burst_waits_for_the_requests_still_being_prepared(reference, preparing, expected_passes):
    """Requests 40 ms apart, far past gather_ms (2 ms, at most 20 ms in all): while the later ones are reported as
    being prepared (``incoming``), the idle engine waits for them (up to 100 ms) and starts all three in one pass;
    with nothing reported, the first starts alone. Each output equals its solo run."""
    model, tokenizer = reference
    counting = CountingModel(model)
    engine = BatchedEngine(counting, EngineConfig(max_running=4, step_token_budget=256, prefill_chunk=64))
    assert engine.core.config.gather_ms == 2.0
    on_the_way = [2 if preparing else 0]
    engine.engine_loop.incoming = lambda: on_the_way[0]
    engine.start()
    counting.calls.clear()  # warm-up
    prompts = [tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[4])]
    requests = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=8, prefill_chunk=64)
                for i, p in enumerate(prompts)]

    async def go():
        tasks = [asyncio.create_task(collect_tokens(engine, requests[0]))]
        for request in requests[1:]:
            await asyncio.sleep(0.04)
            on_the_way[0] = max(0, on_the_way[0] - 1)  # prepared: submitted now
            tasks.append(asyncio.create_task(collect_tokens(engine, request)))
        return await asyncio.gather(*tasks)
    try:
        got = asyncio.run(go())
    finally:
        engine.stop()
    prefill_calls = [(c.batch, c.length) for c in counting.calls if c.length > 1]
    if expected_passes == 1:
        assert prefill_calls == [(3, max(len(p) for p in prompts))]
    else:
        assert prefill_calls[0] == (1, len(prompts[0])) and len(prefill_calls) >= 2, prefill_calls
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == solo_tokens(model, prompt, 8)


def test_a_models_engine_hears_of_the_requests_its_slot_prepares(tmp_path, tiny_model_dir):
    """The daemon wires the slot's count of requests in preparation into its engine's burst gathering."""
    with app_client(write_config(tmp_path, tiny_model_dir)) as (_, daemon):
        slot = daemon.models.first
        assert slot.engine.engine_loop.incoming() == 0
        slot.num_preparing += 3
        try:
            assert slot.engine.engine_loop.incoming() == 3
        finally:
            slot.num_preparing -= 3


def prefill_passes_after_a_cached_prompt(model, config: EngineConfig, earlier: list[int],
                                         prompts: list[list[int]]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Serve ``earlier`` (its prompt and output then sit in the prefix cache), then ``prompts`` together: the
    prompt passes (batch, length) the latter took, and each one's 6 greedy tokens."""
    counting = CountingModel(model)
    engine = BatchedEngine(counting, config)
    engine.start()
    first = EngineRequest(request_id="first", prompt=earlier, max_tokens=4, prefill_chunk=64)
    requests = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=6, prefill_chunk=64)
                for i, p in enumerate(prompts)]

    async def scenario():
        await collect_tokens(engine, first)
        counting.calls.clear()
        return await send_apart(engine, requests, 0.02)

    try:
        got = asyncio.run(scenario())
    finally:
        engine.stop()
    return [(c.batch, c.length) for c in counting.calls if c.length > 1], got


@pytest.mark.parametrize(("min_tokens", "grouped"), [(32, True), (1, False)])
def test_prompts_sharing_only_a_few_cached_tokens_still_start_in_one_pass(reference, min_tokens, grouped):
    """A cached state covering a few tokens (a chat template's header, shared by every request) is not worth
    reusing when it would take a prompt out of the pass it shares with the prompts arriving with it."""
    model, _ = reference
    header = [5, 6, 7]
    prompts = [header + [(50 + 7 * i + j) % 200 + 10 for j in range(30)] for i in range(3)]
    config = EngineConfig(max_running=4, step_token_budget=256, prefill_chunk=64, gather_ms=100.0,
                          prefix_cache_min_tokens=min_tokens)
    prefill_calls, got = prefill_passes_after_a_cached_prompt(model, config, header + list(range(10, 40)), prompts)
    if grouped:
        assert prefill_calls == [(3, 33)]
    else:  # each reused the 3 cached tokens; the rests of the prompts ran in one pass
        assert prefill_calls == [(3, 30)], prefill_calls
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == solo_tokens(model, prompt, 6)


def test_prompts_starting_from_cached_states_of_different_lengths_continue_in_one_pass(reference):
    """Agent loops: requests that each find a different part of an earlier prompt cached, with rests of different
    lengths, run those rests in one forward pass (right-padded, then rolled to the left) and decode as they would
    alone."""
    model, _ = reference
    earlier = [(13 * j) % 200 + 10 for j in range(50)]
    prompts = [earlier[:cached] + [(90 + 7 * i + j) % 200 + 10 for j in range(rest)]
               for i, (cached, rest) in enumerate([(35, 5), (40, 12), (45, 20)])]
    config = EngineConfig(max_running=4, step_token_budget=256, prefill_chunk=64, gather_ms=100.0,
                          prefix_cache_min_tokens=32)  # hits of 35-45 tokens are reused
    prefill_calls, got = prefill_passes_after_a_cached_prompt(model, config, earlier, prompts)
    assert prefill_calls == [(3, 20)], prefill_calls  # without it: (1, 5), (1, 12), (1, 20)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == solo_tokens(model, prompt, 6)


def engine_processors(bias: dict[int, float]) -> list:
    from mlxd.engine.step.sampling import make_request_processors

    return make_request_processors(SamplingParams(logit_bias=bias))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batched")
    port = free_port()
    extra = "[engine]\nmax_running = 4\nmax_waiting = 2\nstep_token_budget = 64\nprefill_chunk = 16\n"
    config = write_config(tmp, tiny_model_dir, port=port, extra=extra)
    with serve_subprocess(config, port) as (base, _):
        yield base


async def completion(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    parts = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                parts.extend(c["text"] for c in httpx.Response(200, content=line[6:]).json()["choices"])
    return "".join(parts)


def test_concurrent_greedy_requests_equal_their_solo_outputs(server, reference):
    model, tokenizer = reference
    lengths = [24, 40, 17, 33, 28, 40]
    jobs = list(zip(PROMPTS[:6], lengths, strict=True))
    expected = [generate(model, tokenizer, prompt, max_tokens=n) for prompt, n in jobs]

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            return await asyncio.gather(*[completion(client, p, n, stream=i % 2 == 0) for i, (p, n) in
                                          enumerate(jobs)])

    # Six at once: four run, two wait for a slot, and rows join and leave the batch as they finish.
    assert asyncio.run(run()) == expected


def test_over_the_waiting_cap_is_429_with_retry_after(server):
    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
                    "stream": True, "logit_bias": NO_EOS}
            streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(6)]
            responses = [await s.__aenter__() for s in streams]  # 4 running + 2 waiting: all accepted
            try:
                assert [r.status_code for r in responses] == [200] * 6
                over = await client.post("/v1/completions", json=body)
                assert over.status_code == 429, over.text
                assert int(over.headers["retry-after"]) >= 1
                assert over.json()["error"]["type"] == "rate_limit_error"
                for _ in range(100):  # requests accepted between two steps wait until the next one admits them
                    status = (await client.get("/v1/status")).json()
                    if len(status["running"]) == 4:
                        break
                    await asyncio.sleep(0.02)
                assert len(status["running"]) == 4 and len(status["waiting"]) == 2, status
                # A queued stream gets SSE comments (keepalive_s = 0.5 here) while it waits for a slot.
                raw = b""
                async for chunk in responses[-1].aiter_raw():
                    raw += chunk
                    if raw.count(b": keep-alive") >= 3:
                        break
                assert b'"text"' not in raw
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
            for _ in range(100):  # the closed streams are cancelled
                status = (await client.get("/v1/status")).json()
                if not status["running"] and not status["waiting"]:
                    return status
                await asyncio.sleep(0.05)
            raise AssertionError(f"requests still in the engine: {status}")

    status = asyncio.run(run())
    assert status["totals"]["num_cancelled"] >= 6


def run_all(engine: BatchedEngine, requests: list[EngineRequest]) -> list[list[int]]:
    async def run():
        return await asyncio.gather(*[collect_tokens(engine, r) for r in requests])

    return asyncio.run(run())


def test_rotating_cache_batched_equals_solo(reference):
    from mlxd.engine.step.row import make_request_cache

    model, tokenizer = reference
    window, n = 32, 60
    prompts = [tokenizer.encode(p) for p in (PROMPTS[2], PROMPTS[0], PROMPTS[4])]  # one longer than the window
    bias = {0: -100.0, 2: -100.0}
    engine = BatchedEngine(model, EngineConfig(max_running=4, max_kv_size=window, prefill_chunk=16))
    engine.start()
    try:
        got = run_all(engine, [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=n, prefill_chunk=16,
                                             sampling=SamplingParams(logit_bias=bias)) for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    for prompt, tokens in zip(prompts, got, strict=True):
        solo = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                            prompt_cache=make_request_cache(model, window),
                                            logits_processors=engine_processors(bias))]
        assert tokens == solo


def test_hybrid_recurrent_model_batched_equals_solo(tiny_qwen3_next_dir):
    model, tokenizer = load(str(tiny_qwen3_next_dir))
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    lengths = [20, 32, 12, 28]
    engine = BatchedEngine(model, EngineConfig(max_running=4, prefill_chunk=8))
    engine.start()
    try:
        got = run_all(engine, [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=n, prefill_chunk=8)
                               for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))])
    finally:
        engine.stop()
    for prompt, n, tokens in zip(prompts, lengths, got, strict=True):
        assert tokens == solo_tokens(model, prompt, n)
