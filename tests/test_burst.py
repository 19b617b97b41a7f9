"""A burst of 64 new prompts starts in one prompt pass when memory allows it, not step_token_budget tokens at a
time, while rows already decoding get their token every step; each request equals its solo greedy output."""

from __future__ import annotations

import asyncio

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest
from mlxd.engine.engine import BatchedEngine
from tests.test_batched_engine import CountingModel, collect_tokens

NUM_ROWS = 64


async def held_burst(engine: BatchedEngine, counting: CountingModel, burst: list[EngineRequest],
                     early: list[EngineRequest]) -> list[list[int]]:
    """Start ``early`` and let it decode a few steps, hold the engine mid-step while the whole ``burst`` is
    submitted, then let it go: the burst reaches the scheduler at once. Returns the burst's tokens (``early``'s
    are awaited too); ``counting.calls`` holds the passes from the burst's submission on."""
    decoding = [asyncio.create_task(collect_tokens(engine, r)) for r in early]
    counting.calls.clear()
    while sum(1 for c in counting.calls if c.length == 1) < 3:
        await asyncio.sleep(0.01)  # the early rows decode
    counting.gate.clear()  # hold the engine so that the whole burst is queued at once
    await asyncio.sleep(0.05)
    counting.calls.clear()
    tasks = [asyncio.create_task(collect_tokens(engine, r)) for r in burst]
    await asyncio.sleep(0.2)
    counting.gate.set()
    got = await asyncio.gather(*tasks)
    await asyncio.gather(*decoding)
    return got


def test_a_burst_of_64_prompts_starts_in_one_pass_beside_decoding_rows(tiny_qwen3_dir):
    model, _ = load(str(tiny_qwen3_dir))
    counting = CountingModel(model)
    config = EngineConfig(max_running=NUM_ROWS + 4, max_waiting=NUM_ROWS, prefix_cache_bytes=0, warmup_tokens=1)
    engine = BatchedEngine(counting, config)
    engine.start()
    assert config.step_token_budget == 512
    # What a GPU backend gets (mlxd.engine.schedule.memory.max_pass_tokens); on the CPU, where a pass costs its
    # tokens' compute whatever its width, whole prompts start within step_token_budget.
    engine.scheduler.max_pass_tokens = 16384
    prompts = [[1 + (i * 31 + j * 7) % 900 for j in range(80 + i % 20)] for i in range(NUM_ROWS)]  # 80-99 tokens
    early = [EngineRequest(request_id=f"early-{i}", prompt=[5 + i, 6, 7], max_tokens=40) for i in range(4)]
    burst = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=4) for i, p in enumerate(prompts)]
    try:
        got = asyncio.run(held_burst(engine, counting, burst, early))
    finally:
        counting.gate.set()
        engine.stop()
    prompt_passes = [(c.batch, c.length) for c in counting.calls if c.length > 1]
    assert prompt_passes == [(NUM_ROWS, 99)], prompt_passes  # one pass of all 64, padded to the longest
    shapes = [(c.batch, c.length) for c in counting.calls]
    joined = shapes.index((NUM_ROWS, 99))
    assert all(shape == (4, 1) for shape in shapes[:joined])  # the early rows decoded while the burst was queued
    assert shapes[joined + 1] == (NUM_ROWS + 4, 1)  # the same step decodes them and the burst's 64 rows together
    for request, tokens in zip(burst, got, strict=True):
        solo = [t for t, _ in generate_step(mx.array(request.prompt), model, max_tokens=request.max_tokens)]
        assert tokens == solo, request.request_id


SHARED = [1 + (j * 13) % 700 for j in range(40)]
# A burst of 12: every third prompt starts with SHARED, the first 40 tokens of a prompt served before it.
SHARED_START_PROMPTS = [[*SHARED, *(2 + (i * 17 + j * 3) % 800 for j in range(30 + i))] if i % 3 == 1
                        else [1 + (i * 31 + j * 7) % 900 for j in range(60 + i)] for i in range(12)]


def run_shared_start_burst(model_dir, config: EngineConfig) -> list[tuple[int, int]]:
    """Serve a prompt that starts with SHARED, then the burst of SHARED_START_PROMPTS (held so that it is queued at
    once) beside a decoding row; check each request against its solo greedy output and return the shapes of the
    forward passes from the burst's submission on, from the first prompt pass."""
    model, _ = load(str(model_dir))
    counting = CountingModel(model)
    engine = BatchedEngine(counting, config)
    engine.start()
    engine.scheduler.max_pass_tokens = 16384
    seed = EngineRequest(request_id="seed", prompt=[*SHARED, 901, 902, 903], max_tokens=2)
    early = EngineRequest(request_id="early", prompt=[5, 6, 7], max_tokens=60)
    burst = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=4) for i, p in enumerate(SHARED_START_PROMPTS)]
    try:
        asyncio.run(collect_tokens(engine, seed))  # its prompt's state is kept in the prefix cache
        got = asyncio.run(held_burst(engine, counting, burst, [early]))
    finally:
        counting.gate.set()
        engine.stop()
    for request, tokens in zip(burst, got, strict=True):
        solo = [t for t, _ in generate_step(mx.array(request.prompt), model, max_tokens=request.max_tokens)]
        assert tokens == solo, request.request_id
    shapes = [(c.batch, c.length) for c in counting.calls]
    return shapes[next(i for i, (_, length) in enumerate(shapes) if length > 1):]


def test_a_short_shared_start_is_not_reused_by_default_and_the_burst_runs_as_one_pass(tiny_qwen3_dir):
    """With the default ``prefix_cache_min_tokens`` (64), the prompts of a burst that share only 40 tokens with a
    prompt served before start whole, in the burst's one pass with the others (no pass of rests after it); each
    request equals its solo greedy output."""
    config = EngineConfig(max_running=16, max_waiting=16, prefix_cache_bytes=64 * 1024**2, warmup_tokens=1)
    assert config.prefix_cache_min_tokens == 64
    shapes = run_shared_start_burst(tiny_qwen3_dir, config)
    assert shapes[0] == (12, max(len(p) for p in SHARED_START_PROMPTS)), shapes  # all 12 whole, in one pass
    assert shapes[1] == (13, 1), shapes  # then one step decodes them and the early row


def test_a_burst_with_prefix_cache_hits_starts_in_one_step(tiny_qwen3_dir):
    """A burst of 12 prompts, 4 of which (every third) start with the 40 tokens of a prompt served before (a
    prefix-cache hit, reused from 32 tokens on): all 12 start in the same step, the 8 whole prompts in one pass and
    the 4 rests in another, before the step that decodes all of them; each request equals its solo greedy output."""
    config = EngineConfig(max_running=16, max_waiting=16, prefix_cache_bytes=64 * 1024**2, warmup_tokens=1,
                          prefix_cache_min_tokens=32)
    shapes = run_shared_start_burst(tiny_qwen3_dir, config)
    whole = [p for i, p in enumerate(SHARED_START_PROMPTS) if i % 3 != 1]
    rests = sorted(len(p) - len(SHARED) for i, p in enumerate(SHARED_START_PROMPTS) if i % 3 == 1)
    assert shapes[0] == (8, max(len(p) for p in whole)), shapes
    assert shapes[1] == (4, rests[-1]), shapes  # the rests, in the same step
    assert shapes[2] == (13, 1), shapes  # then one step decodes the burst's 12 rows and the early row
