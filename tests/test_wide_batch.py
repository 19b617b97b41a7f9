"""64 rows in one decode batch, against oracles: 64 concurrent greedy requests of mixed prompt lengths each give their
solo output (mlx-lm's ``generate_step`` on the same tiny model), and so do 8 image rows and 8 grammar-constrained
rows among 64 on a tiny vision-language model (each request run alone through the same engine). Every forward pass
is counted, so the test sees the batch really reach 64 rows."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm import load as load_text
from mlx_lm.generate import generate_step

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.step.row import logits_width
from tests.test_batched_engine import CountingModel, collect_tokens
from tests.test_vision_engine import Prompts, loaded_model

NUM_ROWS = 64
MAX_TOKENS = 6
WIDE = EngineConfig(max_running=NUM_ROWS, max_waiting=NUM_ROWS, step_token_budget=8192, prefill_chunk=256,
                    prefix_cache_bytes=0, warmup_tokens=1)
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}
WORDS = "the sea and the sky met where a small boat rocked on grey water while gulls cried".split()


def text(i: int) -> str:
    """Prompt ``i``: lengths spread from a few tokens to a hundred or so, no two alike."""
    return f"{i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 37) % 50))


def constraint_factory(tokenizer: Any, model: Any):
    from mlxd.constraints.grammar import GrammarCompiler
    from mlxd.constraints.processor import make_constraint_factory

    compiler = GrammarCompiler(tokenizer, n_vocab=logits_width(model))
    return make_constraint_factory(compiler.json_schema(SCHEMA), compiler, sorted(tokenizer.eos_token_ids))


def run_together(engine: BatchedEngine, gate: Any, requests: list[EngineRequest]) -> list[list[int]]:
    """Submit every request while the engine is held mid-step, so that all of them are queued when it goes on."""

    async def together():
        gate.clear()
        tasks = [asyncio.create_task(collect_tokens(engine, r)) for r in requests]
        await asyncio.sleep(0.1)
        gate.set()
        return await asyncio.gather(*tasks)

    try:
        return asyncio.run(together())
    finally:
        gate.set()


def widest_decode_step(calls: list[tuple[int, int]]) -> int:
    return max(batch for batch, length in calls if length == 1)


def test_64_greedy_text_requests_equal_their_solo_outputs(tiny_qwen3_dir):
    model, tokenizer = load_text(str(tiny_qwen3_dir))
    prompts = [tokenizer.encode(text(i)) for i in range(NUM_ROWS)]
    assert max(map(len, prompts)) > 5 * min(map(len, prompts))
    solo = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=MAX_TOKENS)] for p in prompts]
    counting = CountingModel(model)
    engine = BatchedEngine(counting, WIDE)
    engine.start()
    try:
        counting.calls.clear()  # warm-up
        requests = [EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=MAX_TOKENS, prefill_chunk=256)
                    for i, p in enumerate(prompts)]
        together = run_together(engine, counting.gate, requests)
    finally:
        engine.stop()
    assert widest_decode_step([(c.batch, c.length) for c in counting.calls]) == NUM_ROWS
    for i, (got, want) in enumerate(zip(together, solo, strict=True)):
        assert got == want, f"row {i} (prompt of {len(prompts[i])} tokens)"


@pytest.mark.parametrize("family", ["qwen2_5_vl"])
def test_64_rows_with_8_image_and_8_constrained_rows_equal_their_solo_outputs(family, tiny_vlm):
    loaded = loaded_model(tiny_vlm(family), counting=True)
    model, prompts = loaded.model, Prompts(loaded)
    factory = constraint_factory(loaded.tokenizer, model)
    eos = frozenset(loaded.tokenizer.eos_token_ids)

    def request(i: int, tag: str) -> EngineRequest:
        kind = i % 8  # rows 0, 8, 16, ...: an image; rows 4, 12, 20, ...: a grammar; the rest plain text
        prompt, media = prompts(text(i), 100 + i) if kind == 0 else prompts(text(i))
        return EngineRequest(request_id=f"{tag}-{i}", prompt=prompt, media=media, prefill_chunk=256,
                             route="text" if media is None else "vision",
                             max_tokens=24 if kind == 4 else MAX_TOKENS, stop_token_ids=eos,
                             logits_processors=factory if kind == 4 else None)

    engine = BatchedEngine(model, WIDE)
    engine.start()
    try:
        solo = [asyncio.run(collect_tokens(engine, request(i, "solo"))) for i in range(NUM_ROWS)]
        model.calls.clear()
        together = run_together(engine, model.gate, [request(i, "mix") for i in range(NUM_ROWS)])
    finally:
        engine.stop()
    assert widest_decode_step(model.calls) == NUM_ROWS
    assert sum(1 for i in range(NUM_ROWS) if i % 8 == 0) == 8 and sum(1 for i in range(NUM_ROWS) if i % 8 == 4) == 8
    for i, (got, want) in enumerate(zip(together, solo, strict=True)):
        assert got == want, f"row {i}"
    # The grammar held the constrained rows (valid JSON, ended by the grammar before max_tokens), and the images
    # went into the prompts (the eight image prompts sent together shared one pass).
    for i in range(4, NUM_ROWS, 8):
        assert len(solo[i]) < 24, solo[i]  # the end of sequence (not emitted) came before max_tokens
        jsonschema.validate(json.loads(loaded.tokenizer.decode(solo[i])), SCHEMA)
    assert model.image_passes[-1] == 8
