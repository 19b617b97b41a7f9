"""Faults injected on the engine thread end only the requests they must, and the engine goes on.

Oracles: the requests beside a failing one produce their solo greedy output token for token; a failing row keeps the
tokens it had (a prefix of its solo output) and ends with one ``Failed``; after a fault that breaks MLX's random
state, a seeded sampled request reproduces its pre-fault output; the totals count every failure. Faults come from
test doubles with the real interfaces: a model wrapper that raises on a poisoned prompt token or on the Nth decode
step, and a sampler factory (``BatchedEngine(make_sampler=...)``) whose samplers raise while being built or, on a
later call, inside a compiled function the way mlx-lm's samplers do. Nothing in mlx or mlx-lm is patched.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxd.config.schema import DaemonConfig, EngineConfig, ModelConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, SamplingParams, Token
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.step.sampling import make_request_sampler
from mlxd.errors import EngineError, NotReady, Overloaded
from mlxd.pipeline.events import KeepAlive
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.pipeline.stages.decode import Decode

PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):",
    "What is the capital of France? The capital of France is",
    "Rain fell softly on the roof while",
]
POISON = 500  # a prompt chunk holding this token id makes the model wrapper raise
BUILD_FAULT_SEED = 1301  # the sampler factory raises for a request with this seed
SAMPLE_FAULT_SEED = 1709  # ... and gives it a sampler that raises on its third call


class Injected(RuntimeError):
    """The fault the doubles raise."""


class Meltdown(BaseException):
    """Not an ``Exception``: escapes every per-request guard and ends the engine thread."""


class FaultyModel:
    """An mlx-lm model with its real interface that raises on command, on the engine thread: for a prompt chunk
    holding ``poison``, and on the ``fail_in``-th decode call (one token per row) from now."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.poison: int | None = None
        self.fail_in: int | None = None
        self.error: BaseException = Injected("forward pass")
        self.delay_s = 0.0  # per decode call: keeps a request running long enough to queue others behind it
        self.gate = threading.Event()  # cleared: the next forward pass waits (holds the engine mid-step)
        self.gate.set()
        self.prompt_passes: list[tuple[int, int]] = []  # (batch, length) of every prompt pass, failed ones too
        self.decode_batches: list[int] = []

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        self.gate.wait()
        batch, length = inputs.shape
        if length > 1:
            self.prompt_passes.append((batch, length))
            if self.poison is not None and any(self.poison in row for row in inputs.tolist()):
                raise Injected("poisoned prompt chunk at /secret/path")
        else:
            self.decode_batches.append(batch)
            time.sleep(self.delay_s)
            if self.fail_in is not None:
                self.fail_in -= 1
                if self.fail_in == 0:
                    self.fail_in = None
                    raise self.error
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _raise_while_compiling(logprobs: mx.array) -> mx.array:
    # mlx-lm's samplers check their arguments inside functions compiled like this one; raising there leaves
    # mx.random.state pointing at an array that cannot be evaluated.
    raise Injected("sampler at /secret/path")


class FailingSampler:
    """A real sampler that raises from its ``fail_on_call``-th call on."""

    def __init__(self, sampler: Callable[[mx.array], mx.array], fail_on_call: int) -> None:
        self.sampler, self.fail_on_call, self.num_calls = sampler, fail_on_call, 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.num_calls += 1
        if self.num_calls >= self.fail_on_call:
            return _raise_while_compiling(logprobs)
        return self.sampler(logprobs)


def faulty_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    if params.seed == BUILD_FAULT_SEED:
        raise Injected("building the sampler")
    sampler = make_request_sampler(params)
    return FailingSampler(sampler, fail_on_call=3) if params.seed == SAMPLE_FAULT_SEED else sampler


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    _, tokenizer = reference
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    assert all(POISON not in p for p in encoded)
    return encoded


_solo: dict[tuple[tuple[int, ...], int], list[int]] = {}


def solo(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """The request's greedy output alone (mlx-lm's generate_step); call while no engine runs."""
    key = (tuple(prompt), max_tokens)
    if key not in _solo:
        _solo[key] = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]
    return _solo[key]


@contextlib.contextmanager
def faulty_engine(model: Any, **config: Any) -> Iterator[tuple[BatchedEngine, FaultyModel]]:
    faulty = FaultyModel(model)
    engine = BatchedEngine(faulty, EngineConfig(**{"max_running": 4, "prefill_chunk": 8, **config}),
                           make_sampler=faulty_sampler)
    engine.start()
    faulty.prompt_passes.clear()  # warm-up
    faulty.decode_batches.clear()
    try:
        yield engine, faulty
    finally:
        faulty.gate.set()
        engine.stop()


@dataclass
class Outcome:
    tokens: list[int]
    end: Finished | Failed


async def outcome(engine: BatchedEngine, request: EngineRequest,
                  on_token: Callable[[int], None] | None = None) -> Outcome:
    handle = engine.submit(request)
    tokens: list[int] = []
    async for event in handle.events():
        if isinstance(event, Token):
            tokens.append(event.token)
            if on_token is not None:
                on_token(len(tokens))
        elif isinstance(event, Finished | Failed):
            return Outcome(tokens, event)
    raise AssertionError("the stream ended without a final event")


def request(request_id: str, prompt: list[int], max_tokens: int, chunk: int = 8, **sampling: Any) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt=prompt, max_tokens=max_tokens, prefill_chunk=chunk,
                         sampling=SamplingParams(**sampling))


def assert_failed(result: Outcome, message: str, status: int = 500) -> None:
    assert isinstance(result.end, Failed), result
    assert message in result.end.message and result.end.status == status, result.end
    assert "secret" not in result.end.message and "Injected" not in result.end.message


def run(scenario: Callable[[], Any]) -> Any:
    """Run a scenario on a fresh event loop; a hung engine fails the test instead of hanging it."""

    async def bounded():
        async with asyncio.timeout(60):
            return await scenario()

    return asyncio.run(bounded())


async def poll(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_rows_that_cannot_be_built_fail_alone(reference, prompts):
    model, _ = reference
    good = [solo(model, p, 16) for p in prompts[:2]]
    with faulty_engine(model) as (engine, _):
        vocab = engine.vocab_size
        assert vocab > 0
        requests = [
            request("a", prompts[0], 16),
            request("b", prompts[1], 16),
            request("factory", prompts[2], 16, seed=BUILD_FAULT_SEED),
            request("bias", prompts[3], 16, logit_bias={3: 1.0, vocab + 5: 2.0}),  # never reaches MLX
            request("negative-seed", prompts[3], 16, seed=-1),
            request("huge-seed", prompts[3], 16, temperature=1.0, seed=2**70),
            request("prompt-id", [*prompts[3], vocab], 16),
        ]

        async def scenario():
            return await asyncio.gather(*[outcome(engine, r) for r in requests])

        a, b, factory, bias, negative, huge, prompt_id = run(scenario)
        totals = engine.status()["totals"]
    assert a.tokens == good[0] and isinstance(a.end, Finished)
    assert b.tokens == good[1] and isinstance(b.end, Finished)
    assert_failed(factory, "could not set up this request")
    assert_failed(bias, f"logit_bias keys must be token ids in [0, {vocab})")
    assert_failed(negative, "seed must be in")
    assert_failed(huge, "seed must be in")
    assert_failed(prompt_id, "prompt token ids must be in")
    assert all(not r.tokens for r in (factory, bias, negative, huge, prompt_id))
    assert totals["num_failed"] == 5 and totals["num_requests"] == 7


def test_a_failing_prompt_chunk_fails_only_its_request(reference, prompts):
    model, _ = reference
    long_prompt = prompts[2] + prompts[0]
    poisoned = [*long_prompt[:10], POISON, *long_prompt[10:]]  # in the second chunk of 8
    good = [solo(model, p, 20) for p in (prompts[0], prompts[1], long_prompt)]
    with faulty_engine(model) as (engine, faulty):
        faulty.poison = POISON

        async def scenario():
            return await asyncio.gather(
                outcome(engine, request("a", prompts[0], 20)),
                outcome(engine, request("poisoned", poisoned, 20)),
                outcome(engine, request("b", prompts[1], 20)),
                outcome(engine, request("long", long_prompt, 20)),
            )

        a, bad, b, long = run(scenario)
        num_failed = engine.status()["totals"]["num_failed"]
    assert_failed(bad, "failed while processing the prompt")
    assert not bad.tokens
    assert [a.tokens, b.tokens, long.tokens] == good
    assert num_failed == 1
    assert max(faulty.decode_batches) >= 3  # the survivors decoded together


def test_a_failing_group_of_prompts_is_retried_one_by_one(reference, prompts):
    model, _ = reference
    short = prompts[:3]
    poisoned = [*prompts[3][:2], POISON, *prompts[3][2:]]
    good = [solo(model, p, 12) for p in short]
    blocker = request("blocker", [5, 6], 10_000)
    with faulty_engine(model, max_running=5, step_token_budget=256) as (engine, faulty):
        faulty.poison = POISON
        ids = ["a", "b", "poisoned", "c"]
        prompts_in = [short[0], short[1], poisoned, short[2]]

        async def scenario():
            decoding = asyncio.Event()
            blocking = asyncio.create_task(outcome(engine, blocker, lambda n: decoding.set()))
            await decoding.wait()
            faulty.gate.clear()  # the engine stops inside its next step until all four have arrived
            await asyncio.sleep(0.05)
            faulty.prompt_passes.clear()
            tasks = [asyncio.create_task(outcome(engine, request(i, p, 12, chunk=64)))
                     for i, p in zip(ids, prompts_in, strict=True)]
            await asyncio.sleep(0.05)
            faulty.gate.set()
            results = await asyncio.gather(*tasks)
            engine.cancel("blocker")
            return results, await blocking

        (a, b, bad, c), blocked = run(scenario)
        num_failed = engine.status()["totals"]["num_failed"]
    longest = max(len(p) for p in prompts_in)
    # One left-padded pass for all four (it raised), then each prompt alone.
    assert faulty.prompt_passes[0] == (4, longest)
    assert sorted(faulty.prompt_passes[1:]) == sorted((1, len(p)) for p in prompts_in)
    assert_failed(bad, "failed while processing the prompt")
    assert [a.tokens, b.tokens, c.tokens] == good
    assert blocked.end.reason == "cancelled" and blocked.tokens
    assert num_failed == 1


def test_a_failing_pass_over_the_rests_of_cached_prompts_is_retried_one_by_one(reference, prompts):
    model, _ = reference
    earlier = [(13 * j) % 200 + 10 for j in range(50)]
    rests = [[(90 + 7 * i + j) % 200 + 10 for j in range(n)] for i, n in enumerate([5, 12, 20])]
    rests[1][3] = POISON
    prompts_in = [earlier[:cached] + rest for cached, rest in zip([35, 40, 45], rests, strict=True)]
    good = [solo(model, prompts_in[i], 6) for i in (0, 2)]
    with faulty_engine(model, max_running=4, step_token_budget=256, gather_ms=100.0,
                       prefix_cache_min_tokens=32) as (engine, faulty):
        faulty.poison = POISON

        async def scenario():
            await outcome(engine, request("earlier", earlier, 4, chunk=64))  # now in the prefix cache
            faulty.prompt_passes.clear()
            return await asyncio.gather(*[outcome(engine, request(f"r{i}", p, 6, chunk=64))
                                          for i, p in enumerate(prompts_in)])

        a, bad, c = run(scenario)
    # One pass over the three rests (it raised), then each rest alone, from its cached state; the one that fails
    # again runs once more from its start without the cached state (40 + 12 tokens), and fails there too.
    assert faulty.prompt_passes[0] == (3, 20), faulty.prompt_passes
    assert sorted(faulty.prompt_passes[1:]) == [(1, 5), (1, 12), (1, 20), (1, 52)]
    assert_failed(bad, "failed while processing the prompt")
    assert [a.tokens, c.tokens] == good


def test_a_failing_sampler_in_the_decode_step_fails_only_its_row(reference, prompts):
    model, _ = reference
    good = [solo(model, p, 24) for p in prompts]
    # No prefix cache: the seeded request's second run must take the very path of its first.
    with faulty_engine(model, prefix_cache_bytes=0) as (engine, faulty):
        seeded = request("seeded", prompts[3], 24, temperature=1.0, seed=7)

        async def scenario():
            before = await outcome(engine, seeded)
            results = await asyncio.gather(
                outcome(engine, request("a", prompts[0], 24)),
                outcome(engine, request("b", prompts[1], 24)),
                # Greedy, its own sampler (top_p sets it apart from the others; greedy ignores it).
                outcome(engine, request("culprit", prompts[2], 24, top_p=0.5, seed=SAMPLE_FAULT_SEED)),
                outcome(engine, request("sampled", prompts[3], 24, temperature=1.0)),
            )
            after = await outcome(engine, seeded)
            return before, results, after

        before, (a, b, culprit, sampled), after = run(scenario)
        num_failed = engine.status()["totals"]["num_failed"]
    # Its third sampler call raised, in the second decode step: the two tokens before it stand.
    assert_failed(culprit, "failed while sampling the next token")
    assert culprit.tokens == good[2][:2]
    assert [a.tokens, b.tokens] == good[:2]
    # A sampled neighbour decoded on through the broken random state (reset at once) ...
    assert isinstance(sampled.end, Finished) and len(sampled.tokens) == 24
    # ... and a seeded request reproduces its output from before the fault.
    assert isinstance(after.end, Finished) and after.tokens == before.tokens
    assert num_failed == 1
    assert max(faulty.decode_batches) >= 4


def test_a_real_sampler_error_fails_its_request_and_resets_the_random_state(reference, prompts):
    model, _ = reference
    with faulty_engine(model, prefix_cache_bytes=0) as (engine, _):
        seeded = request("seeded", prompts[0], 16, temperature=1.0, seed=11)

        async def scenario():
            before = await outcome(engine, seeded)
            # mlx-lm's min_p check raises inside its compiled function (validated upstream; reached here only
            # through a bug): before the reset, every later sampled request failed.
            bad = await outcome(engine, request("bad", prompts[1], 16, temperature=1.0, min_p=1.5))
            unseeded = await outcome(engine, request("unseeded", prompts[2], 16, temperature=1.0))
            after = await outcome(engine, seeded)
            # A top_k that keeps the whole vocabulary is the same distribution: turned off, not an error.
            top_k = await outcome(engine, request("top-k", prompts[0], 16, temperature=1.0, seed=11,
                                                  top_k=engine.vocab_size + 10))
            return before, bad, unseeded, after, top_k

        before, bad, unseeded, after, top_k = run(scenario)
    assert_failed(bad, "failed while processing the prompt")
    # Seeding would repair the state by itself: an unseeded request shows the reset.
    assert isinstance(unseeded.end, Finished) and len(unseeded.tokens) == 16
    assert isinstance(after.end, Finished) and after.tokens == before.tokens
    assert isinstance(top_k.end, Finished) and top_k.tokens == before.tokens


def test_a_broken_decode_step_fails_every_decoding_row_and_the_engine_goes_on(reference, prompts):
    model, _ = reference
    good = [solo(model, p, 40) for p in prompts]
    with faulty_engine(model) as (engine, faulty):
        faulty.fail_in = 8  # the eighth decode step from now raises: both requests decode by then

        async def scenario():
            broken = await asyncio.gather(
                outcome(engine, request("a", prompts[0], 40)),
                outcome(engine, request("b", prompts[1], 40)),
            )
            after = await asyncio.gather(*[outcome(engine, request(f"r{i}", p, 40)) for i, p in enumerate(prompts)])
            return broken, after

        (a, b), after = run(scenario)
        totals = engine.status()["totals"]
    for result, expected in ((a, good[0]), (b, good[1])):
        assert_failed(result, "failed while generating")
        assert 0 < len(result.tokens) < 8 and result.tokens == expected[: len(result.tokens)]
    assert [r.tokens for r in after] == good
    assert totals["num_failed"] == 2


def test_a_snapshot_the_device_cannot_take_skips_the_prefix_cache_and_the_engine_goes_on(reference, prompts):
    """Keeping a finished request's state for later turns needs device memory; when that fails (out of memory),
    the state is not kept, the request still finishes, and the engine serves the next ones."""
    model, _ = reference
    good = [solo(model, p, 12) for p in prompts[:2]]
    with faulty_engine(model) as (engine, _):
        insert, failures = engine.reuse.cache.insert, []

        def insert_out_of_memory(tokens, layers):
            if not failures:
                failures.append(len(tokens))
                raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
            insert(tokens, layers)

        engine.reuse.cache.insert = insert_out_of_memory

        async def scenario():
            first = await outcome(engine, request("a", prompts[0], 12))
            return first, await outcome(engine, request("b", prompts[1], 12))

        first, second = run(scenario)
        assert engine.failure is None
    assert failures and first.tokens == good[0] and isinstance(first.end, Finished)
    assert second.tokens == good[1] and isinstance(second.end, Finished)


def test_an_engine_thread_that_ends_fails_everything_and_refuses_new_requests(reference, prompts):
    model, _ = reference
    with faulty_engine(model, max_running=1) as (engine, faulty):
        calls: list[tuple[str, str]] = []
        engine.on_failure = lambda reason: calls.append((reason, threading.current_thread().name))
        faulty.error = Meltdown("the device went away")
        faulty.delay_s = 0.01  # the running request takes seconds

        async def scenario():
            started = asyncio.Event()

            def on_token(n: int) -> None:
                if n == 3:
                    started.set()

            running = asyncio.create_task(outcome(engine, request("running", prompts[0], 1000), on_token))
            await started.wait()
            queued = asyncio.create_task(outcome(engine, request("queued", prompts[1], 8)))
            await poll(lambda: engine.status()["waiting"] != [])
            faulty.fail_in = 1
            results = await asyncio.gather(running, queued)
            with pytest.raises(NotReady, match="the engine has stopped: Meltdown on the engine thread"):
                engine.submit(request("later", prompts[2], 8))
            return results

        running, queued = run(scenario)
        engine._thread.join(5)
        assert not engine._thread.is_alive()
        assert engine.failure == "Meltdown on the engine thread"
        assert calls == [("Meltdown on the engine thread", "mlxd-engine")]
        assert engine.num_active == 0
    for result in (running, queued):
        assert_failed(result, "the engine has stopped (Meltdown on the engine thread)", status=503)
    assert running.tokens and not queued.tokens


def test_a_request_waiting_past_max_queue_wait_s_gets_503(reference, prompts):
    model, _ = reference
    with faulty_engine(model, max_running=1, max_queue_wait_s=0.3) as (engine, faulty):
        faulty.delay_s = 0.01  # the running request takes seconds

        async def scenario():
            started = asyncio.Event()
            running = asyncio.create_task(outcome(engine, request("running", prompts[0], 1000),
                                                  lambda n: started.set()))
            await started.wait()
            submitted_at = time.monotonic()
            queued = await outcome(engine, request("queued", prompts[1], 8))
            waited = time.monotonic() - submitted_at
            still_running = engine.num_active == 1
            engine.cancel("running")
            return queued, waited, still_running, await running

        queued, waited, still_running, running = run(scenario)
        totals = engine.status()["totals"]
    assert_failed(queued, "waited more than 0.3 s in the queue", status=503)
    assert 0.3 <= waited < 2.0 and still_running
    assert running.end.reason == "cancelled"
    assert totals["num_timed_out"] == 1 and totals["num_failed"] == 0


def test_abort_all_ends_every_request_with_503_and_the_engine_serves_on(reference, prompts):
    model, _ = reference
    good = solo(model, prompts[2], 12)
    with faulty_engine(model, max_running=1, max_waiting=1) as (engine, faulty):
        decode = Decode(Decode.Config())
        config = DaemonConfig(model=ModelConfig(source="tiny"))
        decode.warm_up(PipelineContext(config, ModelInfo("tiny", 512, frozenset(), frozenset()), None, engine))
        assert engine.num_active == 0 and engine.retry_after_s() == 1.0
        faulty.delay_s = 0.01

        async def through_decode(job: Job) -> EngineError:
            async def nothing():
                return
                yield

            with pytest.raises(EngineError) as caught:
                async for event in decode.stream(job, nothing()):
                    assert isinstance(event, KeepAlive)
            return caught.value

        async def scenario():
            started = asyncio.Event()
            running = asyncio.create_task(outcome(engine, request("running", prompts[0], 1000),
                                                  lambda n: started.set()))
            await started.wait()
            waiting_job = Job(request_id="waiting", model="tiny", engine_request=request("waiting", prompts[1], 8))
            waiting = asyncio.create_task(through_decode(waiting_job))
            await poll(lambda: engine.num_active == 2)
            with pytest.raises(Overloaded) as overloaded:
                engine.submit(request("over", prompts[2], 8))
            engine.abort_all("the server is shutting down")
            results = await running, await waiting
            await poll(lambda: engine.num_active == 0)
            faulty.delay_s = 0.0
            return overloaded.value, results, await outcome(engine, request("after", prompts[2], 12))

        overloaded, (running, error), after = run(scenario)
        totals = engine.status()["totals"]
    assert overloaded.retry_after >= 1.0
    assert_failed(running, "the server is shutting down", status=503)
    assert (error.status, error.type, error.message) == (503, "service_unavailable", "the server is shutting down")
    assert after.tokens == good and isinstance(after.end, Finished)
    assert totals["num_aborted"] == 2 and totals["num_failed"] == 0
