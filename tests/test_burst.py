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


def test_a_burst_with_prefix_cache_hits_starts_in_one_step(tiny_qwen3_dir):
    """A burst of 12 prompts, 4 of which (every third) start with the 40 tokens of a prompt served before (a
    prefix-cache hit): all 12 start in the same step, the 8 whole prompts in one pass and the 4 rests in another,
    before the step that decodes all of them; each request equals its solo greedy output."""
    model, _ = load(str(tiny_qwen3_dir))
    counting = CountingModel(model)
    config = EngineConfig(max_running=16, max_waiting=16, prefix_cache_bytes=64 * 1024**2, warmup_tokens=1)
    engine = BatchedEngine(counting, config)
    engine.start()
    engine.scheduler.max_pass_tokens = 16384
    shared = [1 + (j * 13) % 700 for j in range(40)]
    seed = EngineRequest(request_id="seed", prompt=[*shared, 901, 902, 903], max_tokens=2)
    prompts = [[*shared, *(2 + (i * 17 + j * 3) % 800 for j in range(30 + i))] if i % 3 == 1
               else [1 + (i * 31 + j * 7) % 900 for j in range(60 + i)] for i in range(12)]
    early = EngineRequest(request_id="early", prompt=[5, 6, 7], max_tokens=60)
    burst = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=4) for i, p in enumerate(prompts)]
    try:
        asyncio.run(collect_tokens(engine, seed))  # its prompt's state is kept in the prefix cache
        got = asyncio.run(held_burst(engine, counting, burst, [early]))
    finally:
        counting.gate.set()
        engine.stop()
    shapes = [(c.batch, c.length) for c in counting.calls]
    first_pass = next(i for i, (_, length) in enumerate(shapes) if length > 1)
    rests = sorted(len(p) - len(shared) for i, p in enumerate(prompts) if i % 3 == 1)
    assert shapes[first_pass] == (8, max(len(p) for i, p in enumerate(prompts) if i % 3 != 1)), shapes
    assert shapes[first_pass + 1] == (4, rests[-1]), shapes  # the rests, in the same step
    assert shapes[first_pass + 2] == (13, 1), shapes  # then one step decodes the burst's 12 rows and the early row
    for request, tokens in zip(burst, got, strict=True):
        solo = [t for t, _ in generate_step(mx.array(request.prompt), model, max_tokens=request.max_tokens)]
        assert tokens == solo, request.request_id
