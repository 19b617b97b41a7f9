"""Speculation on a hybrid model (Qwen3.5: gated delta-net recurrent layers beside attention), served through its
vision wrapper for text-only requests: the recurrent states roll back to the last kept position.

Oracles: plain greedy decoding of the same engine. Drafters: the checkpoint's own MTP head (random weights: drafts
mostly rejected, so rollback runs almost every step), an oracle that proposes the plain output (every draft kept),
and the same oracle spoiled for some rows (ragged acceptance in one batch, beside plain rows).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx_vlm
import pytest

from mlxd.config.schema import EngineConfig, SpeculativeConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, Plain, Speculative, Token
from mlxd.engine.drafters.mtp import make_mtp_drafter
from mlxd.engine.engine import BatchedEngine
from mlxd.models.vlm import VisionLanguageModel
from tests.support.oracle_drafter import OracleDrafter
from tests.support.tiny_hybrid import tiny_qwen3_5_mtp_cached

PROMPTS = ["The quick brown fox jumps over the lazy dog. A journey", "Hello, world! How are", "Once upon a time",
           "def main():", "Rain fell softly on the roof", "1 2 3 4 5"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hybrid(tiny_models_root: Path):
    folder = tiny_qwen3_5_mtp_cached(tiny_models_root)
    model, processor = mlx_vlm.load(str(folder))
    return VisionLanguageModel(model), processor.tokenizer, folder


def start(model, drafter=None) -> BatchedEngine:
    name = drafter.name if drafter is not None else "none"
    config = EngineConfig(max_running=8, prefill_chunk=32, warmup_tokens=1,
                          speculative=SpeculativeConfig(drafter=name, k=3, adaptive=False))
    engine = BatchedEngine(model, config, drafter=drafter)
    engine.start()
    return engine


def requests(tokenizer, tag: str, modes: list) -> list[EngineRequest]:
    return [EngineRequest(request_id=f"{tag}-{i}", prompt=tokenizer.encode(PROMPTS[i]), max_tokens=MAX_TOKENS,
                          decode=mode) for i, mode in enumerate(modes)]


def run(engine: BatchedEngine, batch: list[EngineRequest]) -> list[tuple[list[int], Finished]]:
    async def one(request: EngineRequest) -> tuple[list[int], Finished]:
        tokens = []
        async for event in engine.submit(request).events():
            if isinstance(event, Token):
                tokens.append(event.token)
            elif isinstance(event, Failed):
                raise AssertionError(f"{request.request_id} failed: {event.message}")
            elif isinstance(event, Finished):
                return tokens, event
        raise AssertionError("no final event")

    async def all_of_them():
        return await asyncio.gather(*(one(r) for r in batch))

    return asyncio.run(all_of_them())


@pytest.fixture(scope="module")
def plain_outputs(hybrid):
    model, tokenizer, _ = hybrid
    engine = start(model)
    try:
        return [run(engine, [r])[0][0] for r in requests(tokenizer, "plain", [Plain()] * len(PROMPTS))]
    finally:
        engine.stop()


SPEC = Speculative(drafter="mtp", k=3, adaptive=False)
ORACLE = Speculative(drafter="oracle", k=3, adaptive=False)


def test_the_mtp_head_drafts_and_the_output_is_plain_greedy_alone_and_batched(hybrid, plain_outputs):
    model, tokenizer, folder = hybrid
    engine = start(model, make_mtp_drafter(model, folder))
    try:
        alone = [run(engine, [r])[0] for r in requests(tokenizer, "alone", [SPEC] * len(PROMPTS))]
        assert [tokens for tokens, _ in alone] == plain_outputs
        assert all(finished.decode["drafted"] > 0 for _, finished in alone)
        modes = [SPEC if i % 2 == 0 else Plain() for i in range(len(PROMPTS))]
        batched = run(engine, requests(tokenizer, "mixed", modes))
        assert [tokens for tokens, _ in batched] == plain_outputs
    finally:
        engine.stop()


def test_an_oracle_drafter_is_always_right_and_ragged_acceptance_rolls_back_per_row(hybrid, plain_outputs):
    model, tokenizer, _ = hybrid
    prompts = [tuple(tokenizer.encode(p)) for p in PROMPTS]
    right = OracleDrafter(dict(zip(prompts, plain_outputs, strict=True)))
    engine = start(model, right)
    try:
        results = run(engine, requests(tokenizer, "oracle", [ORACLE] * len(PROMPTS)))
        assert [tokens for tokens, _ in results] == plain_outputs
        assert all(finished.decode["acceptance"] == 1.0 for _, finished in results)
    finally:
        engine.stop()
    # Rows 0 and 2 get every fifth proposed token wrong, so their rows keep different lengths in one step.
    spoiled = {p: [t if (j % 5 != 4 or i not in (0, 2)) else (t + 1) % 1000 for j, t in enumerate(out)]
               for i, (p, out) in enumerate(zip(prompts, plain_outputs, strict=True))}
    engine = start(model, OracleDrafter(spoiled))
    try:
        modes = [ORACLE, ORACLE, ORACLE, Plain(), ORACLE, Plain()]
        results = run(engine, requests(tokenizer, "ragged", modes))
        assert [tokens for tokens, _ in results] == plain_outputs
        assert results[0][1].decode["acceptance"] < 1.0 and results[1][1].decode["acceptance"] == 1.0
    finally:
        engine.stop()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3"])
def test_text_requests_to_a_vision_model_speculate_and_give_the_plain_output(tiny_vlm, family):
    """Text-only rows of a vision model decode through its language model, drafts verified in the batch (ragged:
    the oracle is wrong at every fifth proposed token for half the rows)."""
    model, processor = mlx_vlm.load(str(tiny_vlm(family)))
    model, tokenizer = VisionLanguageModel(model), processor.tokenizer
    prompts = [tuple(tokenizer.encode(p)) for p in PROMPTS]
    engine = start(model)
    try:
        expected = [run(engine, [r])[0][0] for r in requests(tokenizer, "plain", [Plain()] * len(PROMPTS))]
    finally:
        engine.stop()
    vocab = engine.vocab_size
    spoiled = {p: [(t + 1) % vocab if j % 5 == 4 and i % 2 else t for j, t in enumerate(out)]
               for i, (p, out) in enumerate(zip(prompts, expected, strict=True))}
    engine = start(model, OracleDrafter(spoiled))
    try:
        modes = [ORACLE] * 4 + [Plain()] * 2
        results = run(engine, requests(tokenizer, "spec", modes))
    finally:
        engine.stop()
    assert [tokens for tokens, _ in results] == expected
    assert results[0][1].decode["acceptance"] == 1.0 and results[1][1].decode["acceptance"] < 1.0
