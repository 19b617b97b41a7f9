"""The default max_running, derived from the memory budget at start-up: plain numbers for the derivation (an 8B
model on large and small devices, a prefix cache larger than the room, weights that leave one row, a rotating cache), then the engine over the tiny
model, where the derived width is what the scheduler admits, the status page shows, and the log line says."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
import structlog
from mlx_lm import load

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.schedule.memory import (
    MAX_DERIVED_RUNNING,
    MAX_DERIVED_RUNNING_GPU,
    MAX_PASS_TOKENS,
    PASS_ESTIMATE_FACTOR,
    PASS_PROBE_TOKENS,
    TYPICAL_CONTEXT_TOKENS,
    KVCost,
    MemoryBudget,
    derive_max_running,
    max_pass_tokens,
    measure_memory,
    measure_pass_bytes,
)
from tests.test_batched_engine import collect_tokens

GB = 10**9
GiB = 1024**3
# Qwen3-8B: 36 layers x 8 KV heads x 128 x (K, V) x 2 bytes (bf16) a token.
QWEN3_8B_KV = KVCost(num_fixed_bytes=0, num_bytes_per_token=36 * 8 * 128 * 2 * 2)


def test_an_8b_model_on_an_h200_gets_the_largest_derived_width():
    budget = MemoryBudget(limit_bytes=int(139 * GiB * 0.9), weights_bytes=int(16.4 * GB), kv=QWEN3_8B_KV)
    limit = derive_max_running(budget, prefix_cache_bytes=2 * GiB)
    row = QWEN3_8B_KV.num_bytes(TYPICAL_CONTEXT_TOKENS)
    assert (budget.kv_budget_bytes - 2 * GiB) // row > 128  # room for far more: the cap holds
    assert (limit.max_running, limit.source) == (MAX_DERIVED_RUNNING, "derived")
    assert (limit.context_tokens, limit.row_bytes, limit.room_bytes) == (
        TYPICAL_CONTEXT_TOKENS, row, budget.kv_budget_bytes - 2 * GiB)


def test_a_small_device_gets_the_rows_that_fit_rounded_down_to_a_power_of_two():
    # 16 GB Mac: about 10.7 GB working set, a 4-bit 8B model (4.6 GB), the 2 GiB prefix cache.
    budget = MemoryBudget(limit_bytes=int(10.7 * GB), weights_bytes=int(4.6 * GB), kv=QWEN3_8B_KV)
    row = QWEN3_8B_KV.num_bytes(TYPICAL_CONTEXT_TOKENS)
    fits = (budget.kv_budget_bytes - 2 * GiB) // row
    assert fits == 6
    assert derive_max_running(budget, prefix_cache_bytes=2 * GiB).max_running == 4
    # Without the prefix cache the same device holds 10 rows: 8.
    assert derive_max_running(budget, prefix_cache_bytes=0).max_running == 8


def test_a_prefix_cache_larger_than_the_room_counts_for_half_of_it():
    # A 16 GB bf16 8B model on a 24 GB CPU host (18 GB limit): 1.6 GB beside the weights, less than the 2 GiB cache.
    budget = MemoryBudget(limit_bytes=18 * GB, weights_bytes=int(16.4 * GB), kv=QWEN3_8B_KV)
    limit = derive_max_running(budget, prefix_cache_bytes=2 * GiB)
    assert limit.room_bytes == budget.kv_budget_bytes - budget.kv_budget_bytes // 2
    assert limit.max_running == 1  # 0.8 GB: one row of 4096 tokens (0.6 GB)
    roomy = MemoryBudget(limit_bytes=18 * GB, weights_bytes=4 * GB, kv=QWEN3_8B_KV)  # 14 GB beside 4-bit weights
    assert derive_max_running(roomy, prefix_cache_bytes=10 * GiB).max_running == 8  # 7 GB counted: 11 rows


@pytest.mark.parametrize("room_rows", [0.5, 1.0, 1.99])
def test_weights_that_leave_less_than_two_rows_give_one(room_rows):
    kv = KVCost(num_fixed_bytes=1000, num_bytes_per_token=100)
    row = kv.num_bytes(TYPICAL_CONTEXT_TOKENS)
    budget = MemoryBudget(limit_bytes=10**6 + int(room_rows * row) + 5000, weights_bytes=10**6, kv=kv)
    assert derive_max_running(budget, prefix_cache_bytes=5000).max_running == 1
    squeezed = MemoryBudget(limit_bytes=10**6 + 10, weights_bytes=10**6, kv=kv)  # the prefix cache takes it all
    assert derive_max_running(squeezed, prefix_cache_bytes=5000).max_running == 1


def test_a_rotating_cache_counts_its_window_not_the_typical_context():
    kv = KVCost(num_fixed_bytes=0, num_bytes_per_token=1000)
    budget = MemoryBudget(limit_bytes=20 * 1024 * 1000 + 100, weights_bytes=100, kv=kv)
    assert derive_max_running(budget, prefix_cache_bytes=0).max_running == 4  # 4096-token rows: 5 fit
    windowed = derive_max_running(budget, prefix_cache_bytes=0, max_kv_size=1024)
    assert (windowed.context_tokens, windowed.max_running) == (1024, 16)  # 1024-token rows: 20 fit


def _engine(model, **config) -> BatchedEngine:
    engine = BatchedEngine(model, EngineConfig(warmup_tokens=1, prefill_chunk=64, **config))
    engine.start()
    return engine


def test_the_engine_derives_its_width_logs_it_and_admits_that_many(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    measured = measure_memory(model)
    row = measured.kv.num_bytes(TYPICAL_CONTEXT_TOKENS)
    # Room for 5.5 rows beside the weights and a prefix cache of one row's bytes: 4 rows.
    limit = measured.weights_bytes + row + int(5.5 * row)
    with structlog.testing.capture_logs() as logs:
        engine = _engine(model, memory_limit_bytes=limit, prefix_cache_bytes=row)
    try:
        assert engine.max_running == engine.scheduler.max_running == 4
        status = engine.status()["limits"]
        assert (status["max_running"], status["max_running_source"]) == (4, "derived")
        line = next(e for e in logs if e["event"] == "max_running")
        assert line == {"event": "max_running", "log_level": "info", "max_running": 4, "source": "derived",
                        "context_tokens": TYPICAL_CONTEXT_TOKENS, "row_bytes": row, "room_bytes": int(5.5 * row),
                        "prefix_cache_bytes": row, "max_derived": MAX_DERIVED_RUNNING}

        async def six():
            requests = [EngineRequest(request_id=f"r{i}", prompt=tokenizer.encode(f"Count {i}"), max_tokens=40,
                                      prefill_chunk=64) for i in range(6)]
            tasks = [asyncio.create_task(collect_tokens(engine, r)) for r in requests]
            widest = 0
            while not all(t.done() for t in tasks):
                widest = max(widest, engine.scheduler.num_running)
                await asyncio.sleep(0.002)
            await asyncio.gather(*tasks)
            return widest

        assert asyncio.run(six()) == 4  # six requests, four running at most
    finally:
        engine.stop()


def test_a_configured_width_is_kept_and_said_to_come_from_the_config(tiny_model_dir):
    model, _ = load(str(tiny_model_dir))
    with structlog.testing.capture_logs() as logs:
        engine = _engine(model, max_running=3)
    try:
        assert engine.max_running == 3
        assert engine.status()["limits"]["max_running_source"] == "config"
        assert next(e for e in logs if e["event"] == "max_running")["source"] == "config"
    finally:
        engine.stop()


def test_on_a_gpu_the_derived_width_reaches_64_now_that_warm_up_visits_buckets_only():
    """An H200 (and an H100: about 88 rows of 4,096 tokens) beside a bf16 8B model gets 64 rows, the same cap as
    elsewhere; a device with room for fewer still gets what fits."""
    assert MAX_DERIVED_RUNNING_GPU == 64
    budget = MemoryBudget(limit_bytes=int(139 * GiB * 0.9), weights_bytes=int(16.4 * GB), kv=QWEN3_8B_KV)
    assert derive_max_running(budget, prefix_cache_bytes=2 * GiB, cap=MAX_DERIVED_RUNNING_GPU).max_running == 64
    h100 = MemoryBudget(limit_bytes=int(80 * GB * 0.9), weights_bytes=int(16.4 * GB), kv=QWEN3_8B_KV)
    assert derive_max_running(h100, prefix_cache_bytes=2 * GiB, cap=MAX_DERIVED_RUNNING_GPU).max_running == 64
    small = MemoryBudget(limit_bytes=int(10.7 * GB), weights_bytes=int(4.6 * GB), kv=QWEN3_8B_KV)
    assert derive_max_running(small, prefix_cache_bytes=0, cap=MAX_DERIVED_RUNNING_GPU).max_running == 8


def test_a_burst_pass_may_hold_at_most_the_room_beside_the_weights(tiny_model_dir):
    """The measured bytes a prompt pass holds per token cover at least its logits (every position's, float32 for the
    tiny model); a pass of whole prompts may hold at most the room beside the weights over them, between the step
    token budget and MAX_PASS_TOKENS, on GPU backends (the scheduler keeps it beside the reservations each step);
    on the CPU the step token budget stands."""
    model, _ = load(str(tiny_model_dir))
    vocab = model(mx.zeros((1, 1), dtype=mx.uint32)).shape[-1]
    probed = measure_pass_bytes(model, evaluate=True)
    assert vocab * 4 <= probed < 64 * vocab * 4  # float32 logits, and the activations beside them
    estimated = measure_pass_bytes(model, evaluate=False)
    assert estimated == PASS_ESTIMATE_FACTOR * vocab * 4 and probed / 2 <= estimated <= 2 * probed
    measured = measure_memory(model)
    assert measured.pass_bytes_per_token == (estimated if mx.default_device() == mx.cpu else probed)
    h100 = MemoryBudget(limit_bytes=int(80 * GB * 0.9), weights_bytes=int(16.4 * GB), kv=QWEN3_8B_KV,
                        pass_bytes_per_token=700_000)
    assert max_pass_tokens(h100, 512, wide=True) == MAX_PASS_TOKENS == 32768  # 64 prompts of 256 tokens, and more
    tight = MemoryBudget(limit_bytes=17 * GB, weights_bytes=int(16.4 * GB), kv=QWEN3_8B_KV,
                         pass_bytes_per_token=700_000)
    assert max_pass_tokens(tight, 512, wide=True) == tight.kv_budget_bytes // 700_000 == 857  # 0.6 GB of room
    tighter = MemoryBudget(limit_bytes=int(16.6 * GB), weights_bytes=int(16.4 * GB), kv=QWEN3_8B_KV,
                           pass_bytes_per_token=700_000)
    assert max_pass_tokens(tighter, 512, wide=True) == 512  # 0.2 GB of room: the step token budget stands
    mid = MemoryBudget(limit_bytes=10 * GB, weights_bytes=2 * GB, kv=QWEN3_8B_KV, pass_bytes_per_token=1_000_000)
    assert max_pass_tokens(mid, 512, wide=True) == 8 * GB // 1_000_000
    assert max_pass_tokens(MemoryBudget(limit_bytes=10 * GB, weights_bytes=2 * GB, kv=QWEN3_8B_KV), 512) == 512
    assert max_pass_tokens(h100, 512, wide=False) == 512  # the CPU: a wide pass only delays first tokens
    assert max_pass_tokens(h100, 512) == (512 if mx.default_device() == mx.cpu else MAX_PASS_TOKENS)
    assert PASS_PROBE_TOKENS >= 64
