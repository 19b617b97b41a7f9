"""Whole prompts processed together (mlxd.engine.step.prompts.process_prompts), padded to a rounded length as on GPU
backends: the padding is invisible. Oracle: the same rows processed with no padding beyond the longest prompt give
the same first tokens and the same greedy continuations, and through the engine the prefix-cache entries their rows
leave serve follow-ups as a cold run would; attention-only and hybrid (recurrent) tiny models."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import RotatingKVCache

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Finished, SamplingParams, Token
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.prompts import group_width, process_prompts
from mlxd.engine.step.row import Row

PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 4], [8, 8, 1, 6, 2, 9, 4, 7, 12, 3, 5], [10, 14, 6]]


@pytest.fixture(params=["llama", "qwen3_next"])
def model(request, tiny_model_dir, tiny_qwen3_next_dir):
    return load(str(tiny_model_dir if request.param == "llama" else tiny_qwen3_next_dir))[0]


def greedy_group(model, monkeypatch, bucket: int, steps: int = 8) -> list[list[int]]:
    """Each row's first token and ``steps`` more, the rows prompted together with ``bucket``."""
    monkeypatch.setattr("mlxd.engine.step.prompts.group_bucket", lambda: bucket)
    rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(len(PROMPTS))]
    cache, first = process_prompts(model, rows, PROMPTS)
    batch = DecodeBatch(model)
    batch.add_batch(rows, cache, first)
    emitted = [[] for _ in rows]
    for _ in range(steps):
        for i, tokens in enumerate(batch.step()):
            emitted[i] += tokens
    return emitted


def test_padding_a_group_to_a_rounded_length_changes_no_token(model, monkeypatch):
    exact = greedy_group(model, monkeypatch, bucket=1)
    rounded = greedy_group(model, monkeypatch, bucket=16)
    assert rounded == exact


@pytest.mark.parametrize(("longest", "bucket", "width"), [(27, 16, 32), (32, 16, 32), (33, 16, 48), (1, 16, 16),
                                                         (27, 1, 27)])
def test_group_width_rounds_up_to_the_bucket(monkeypatch, tiny_model_dir, longest, bucket, width):
    monkeypatch.setattr("mlxd.engine.step.prompts.group_bucket", lambda: bucket)
    model = load(str(tiny_model_dir))[0]
    assert group_width([Row.for_request("r", SamplingParams(), model, 0)], longest) == width


def test_sliding_window_rows_keep_their_exact_length(monkeypatch):
    monkeypatch.setattr("mlxd.engine.step.prompts.group_bucket", lambda: 16)
    row = SimpleNamespace(cache=[RotatingKVCache(max_size=64, keep=0)])  # all group_width reads of a row
    assert group_width([row], 27) == 27


def test_the_bucket_is_one_on_the_cpu():
    from mlxd.engine.step.prompts import GROUP_BUCKET, group_bucket

    assert group_bucket() == (1 if mx.default_device() == mx.cpu else GROUP_BUCKET)


def engine_outputs(model, requests, *, together: bool):
    """Each request's tokens and final event from a fresh engine: all submitted at once, or one after another."""
    async def one(engine, request):
        tokens = []
        async for event in engine.submit(request).events():
            if isinstance(event, Token):
                tokens.append(event.token)
            elif isinstance(event, Finished):
                return tokens, event
        raise AssertionError("no Finished event")

    async def all_of(engine, batch):
        if together:
            return await asyncio.gather(*(one(engine, r) for r in batch))
        return [await one(engine, r) for r in batch]

    engine = BatchedEngine(model, EngineConfig(max_running=4, prefill_chunk=64, prefix_cache_min_tokens=4))
    engine.start()
    try:
        return [asyncio.run(all_of(engine, batch)) for batch in requests]
    finally:
        engine.stop()


def test_a_padded_groups_rows_leave_caches_that_later_requests_reuse(model, monkeypatch):
    """Rows prompted in a padded group decode, finish and go to the prefix cache; follow-ups that extend their
    conversations hit those caches and give what the same requests give alone and cold, with no padding."""
    greedy = SamplingParams(logit_bias={0: -100.0, 2: -100.0})  # no end-of-sequence: every row runs to the end
    first = [EngineRequest(request_id=f"a{i}", prompt=p, max_tokens=6, sampling=greedy) for i, p in enumerate(PROMPTS)]

    def follow_ups(outputs):
        return [EngineRequest(request_id=f"b{i}", prompt=p + tokens + [4, 9, 3], max_tokens=6, sampling=greedy)
                for i, (p, (tokens, _)) in enumerate(zip(PROMPTS, outputs, strict=True))]

    monkeypatch.setattr("mlxd.engine.step.prompts.group_bucket", lambda: 1)
    alone_first = engine_outputs(model, [first], together=False)[0]
    alone_second = engine_outputs(model, [follow_ups(alone_first)], together=False)[0]

    monkeypatch.setattr("mlxd.engine.step.prompts.group_bucket", lambda: 16)
    grouped_first, = engine_outputs(model, [first], together=True)
    assert [tokens for tokens, _ in grouped_first] == [tokens for tokens, _ in alone_first]
    grouped = engine_outputs(model, [first, follow_ups(grouped_first)], together=True)[1]
    assert [tokens for tokens, _ in grouped] == [tokens for tokens, _ in alone_second]
    assert all(finished.num_cached_tokens > 0 for _, finished in grouped)
