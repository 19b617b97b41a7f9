"""Speculative decoding inside the batched step, against plain decoding as the oracle.

Greedy: whatever the drafter proposes (the target model itself, an unrelated random model, n-grams of the
context), every request's tokens equal plain greedy decoding's, alone and in a batch that mixes speculative and
plain rows; with rows whose penalties, bias, grammar or logprobs must apply at each verified position. A drafter
equal to the target has every draft accepted. Seeded sampling is reproducible alone and in a batch.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from mlx_lm import load

from mlxd.config.schema import EngineConfig, SpeculativeConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, Plain, SamplingParams, Speculative, Token
from mlxd.engine.drafters.draft_model import DraftModelDrafter
from mlxd.engine.drafters.prompt_lookup import PromptLookupDrafter
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.step.row import logits_width
from tests.support.oracle_drafter import OracleDrafter
from tests.support.tiny import tiny_model_cached

PROMPTS = ["Once upon a time", "def fibonacci(n):", "Hello", "The quick brown fox", "Rain fell softly",
           "1 2 3 4", "What is the capital of France?", "SELECT name FROM users"]
NO_EOS = {0: -100.0, 2: -100.0}  # the tiny tokenizer's end-of-sequence ids: every stream runs to max_tokens
GREEDY = SamplingParams(logit_bias=NO_EOS)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def unrelated(tiny_models_root):
    model, _ = load(str(tiny_model_cached(tiny_models_root, "llama", seed=7)))
    return model


def start(model: Any, drafter: Any = None, **speculative: Any) -> BatchedEngine:
    name = drafter.name if drafter is not None else "none"
    config = EngineConfig(max_running=8, prefill_chunk=64, warmup_tokens=1,
                          speculative=SpeculativeConfig(drafter=name, **speculative))
    engine = BatchedEngine(model, config, drafter=drafter)
    engine.start()
    return engine


def requests(tokenizer: Any, tag: str, decode: Any, *, n: int = 8, max_tokens: int = 32,
             sampling: SamplingParams = GREEDY, **kw: Any) -> list[EngineRequest]:
    modes = decode if isinstance(decode, list) else [decode] * n
    return [EngineRequest(request_id=f"{tag}-{i}", prompt=tokenizer.encode(PROMPTS[i]), max_tokens=max_tokens,
                          sampling=sampling, decode=modes[i], **kw) for i in range(n)]


async def _collect(engine: BatchedEngine, batch: list[EngineRequest]) -> list[tuple[list[Token], Any]]:
    async def one(request: EngineRequest) -> tuple[list[Token], Any]:
        tokens: list[Token] = []
        async for event in engine.submit(request).events():
            if isinstance(event, Token):
                tokens.append(event)
            elif isinstance(event, Finished | Failed):
                return tokens, event
        raise AssertionError("no final event")

    return await asyncio.gather(*(one(r) for r in batch))


def run(engine: BatchedEngine, batch: list[EngineRequest]) -> list[tuple[list[Token], Any]]:
    return asyncio.run(_collect(engine, batch))


def alone(engine: BatchedEngine, batch: list[EngineRequest]) -> list[tuple[list[Token], Any]]:
    return [run(engine, [request])[0] for request in batch]


def ids(result: tuple[list[Token], Any]) -> list[int]:
    return [t.token for t in result[0]]


@pytest.fixture(scope="module")
def plain_outputs(target):
    model, tokenizer = target
    engine = start(model)
    try:
        return [ids(r) for r in alone(engine, requests(tokenizer, "plain", Plain()))]
    finally:
        engine.stop()


def spec(k: int = 4, adaptive: bool = False, drafter: str = "draft_model") -> Speculative:
    return Speculative(drafter=drafter, k=k, adaptive=adaptive)


def test_a_drafter_equal_to_the_target_has_every_draft_accepted_and_the_plain_output(target, plain_outputs):
    model, tokenizer = target
    engine = start(model, DraftModelDrafter(model), adaptive=False)
    try:
        results = alone(engine, requests(tokenizer, "same", spec()))
        assert [ids(r) for r in results] == plain_outputs
        for _, finished in results:
            assert finished.decode["acceptance"] == 1.0
            # 32 tokens, 5 a step (the fed token and k = 4 drafts): the last step drafts only what max_tokens leaves.
            assert finished.decode["steps"] == 7
        status = engine.status()["speculative"]
        assert status["drafter"] == "draft_model" and status["acceptance"] == 1.0
    finally:
        engine.stop()


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_an_unrelated_drafter_still_gives_the_plain_output(target, unrelated, plain_outputs, adaptive):
    model, tokenizer = target
    engine = start(model, DraftModelDrafter(unrelated), adaptive=adaptive)
    try:
        results = alone(engine, requests(tokenizer, "other", spec(adaptive=adaptive)))
        assert [ids(r) for r in results] == plain_outputs
        drafted = sum(finished.decode["drafted"] for _, finished in results)
        accepted = sum(finished.decode["accepted"] for _, finished in results)
        assert drafted > 0 and accepted < drafted
        if adaptive:  # it does not pay: rows back off, and say why
            assert any(finished.decode["backoffs"] for _, finished in results)
            reasons = [finished.decode.get("backoff_reason", "") for _, finished in results]
            # The row's own rule (drafts gain less than a verify step costs, or acceptance is low) or the batch's
            # (its rows together gain less than they all pay), whichever spoke last.
            assert any(re.search(r"a verify step costs [\d.]+ plain steps|acceptance", r) for r in reasons), reasons
    finally:
        engine.stop()


@pytest.mark.parametrize("bucket", [1, 16])  # 16: prompts padded as on GPU backends (mlxd.engine.step.prompts)
def test_speculative_and_plain_rows_decode_together_as_they_do_alone(target, unrelated, plain_outputs, monkeypatch,
                                                                     bucket):
    """4 speculative rows (a drafter that is often wrong, so acceptance is ragged) and 4 plain rows at once."""
    monkeypatch.setattr("mlxd.engine.step.prompts.group_bucket", lambda: bucket)
    model, tokenizer = target
    engine = start(model, DraftModelDrafter(unrelated), adaptive=False)
    try:
        modes = [spec() if i % 2 == 0 else Plain() for i in range(8)]
        results = run(engine, requests(tokenizer, "mixed", modes))
        assert [ids(r) for r in results] == plain_outputs
        assert [r[1].decode["mode"] for r in results] == ["speculative", "plain"] * 4
        steps_before = engine.totals["num_steps"]
        run(engine, requests(tokenizer, "mixed2", modes))
        # One step per emitted token of the longest row at most: the rows advanced together, not one by one.
        assert engine.totals["num_steps"] - steps_before <= 32 + 2
    finally:
        engine.stop()


def test_prompt_lookup_gives_the_plain_output_and_drafts_from_the_context(target, plain_outputs):
    model, tokenizer = target
    engine = start(model, PromptLookupDrafter(), adaptive=False)
    try:
        results = run(engine, requests(tokenizer, "lookup", spec(drafter="prompt_lookup")))
        assert [ids(r) for r in results] == plain_outputs
        assert sum(finished.decode["drafted"] for _, finished in results) > 0
    finally:
        engine.stop()


def test_rows_with_penalties_bias_and_logprobs_are_verified_with_them(target):
    """Processors apply at each verified position with the history plain decoding would have had."""
    model, tokenizer = target
    sampling = SamplingParams(logit_bias={**NO_EOS, 17: 2.0}, repetition_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=0.3)
    plain = start(model)
    try:
        expected = alone(plain, requests(tokenizer, "p", Plain(), n=4, sampling=sampling, num_logprobs=2))
    finally:
        plain.stop()
    engine = start(model, DraftModelDrafter(model), adaptive=False)
    try:
        results = run(engine, requests(tokenizer, "s", spec(), n=4, sampling=sampling, num_logprobs=2))
    finally:
        engine.stop()
    assert [ids(r) for r in results] == [ids(r) for r in expected]
    for (got, _), (want, _) in zip(results, expected, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [t for t, _ in g.top] == [t for t, _ in w.top]


@pytest.mark.parametrize("drafts", ["oracle", "unrelated"])
def test_a_grammar_row_speculates_and_gives_the_plain_output(target, unrelated, drafts):
    """Drafts the grammar refuses are cut before verification; grammatical drafts are verified with the grammar's
    mask at each position and rolled back when rejected."""
    from mlxd.constraints.grammar import GrammarCompiler
    from mlxd.constraints.processor import make_constraint_factory

    model, tokenizer = target
    compiler = GrammarCompiler(tokenizer, n_vocab=logits_width(model))
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer",
              "maximum": 99}}, "required": ["color", "n"], "additionalProperties": False}
    factory = make_constraint_factory(compiler.json_schema(schema), compiler, sorted(tokenizer.eos_token_ids))
    kw = {"n": 3, "sampling": SamplingParams(), "max_tokens": 64, "logits_processors": factory,
          "stop_token_ids": frozenset(tokenizer.eos_token_ids)}
    plain = start(model)
    try:
        expected = alone(plain, requests(tokenizer, "gp", Plain(), **kw))
    finally:
        plain.stop()
    batch = requests(tokenizer, "gs", spec(drafter="oracle" if drafts == "oracle" else "draft_model"), **kw)
    drafter = (OracleDrafter({tuple(r.prompt): ids(e) for r, e in zip(batch, expected, strict=True)})
               if drafts == "oracle" else DraftModelDrafter(unrelated))
    engine = start(model, drafter, adaptive=False)
    try:
        results = run(engine, batch)
    finally:
        engine.stop()
    assert [ids(r) for r in results] == [ids(r) for r in expected]
    for tokens, finished in results:
        assert finished.reason == "stop"
        assert json.loads(tokenizer.decode([t.token for t in tokens]))["color"] in ("red", "green", "blue")
        if drafts == "oracle":
            assert finished.decode["acceptance"] == 1.0


def test_a_seeded_speculative_request_samples_the_same_alone_and_in_a_batch(target, unrelated):
    model, tokenizer = target
    engine = start(model, DraftModelDrafter(unrelated), adaptive=False)
    try:
        seeded = SamplingParams(temperature=1.0, seed=42, logit_bias=NO_EOS)
        first = requests(tokenizer, "seed-alone", spec(), n=1, sampling=seeded)
        solo = ids(run(engine, first)[0])
        others = requests(tokenizer, "seed-others", spec(), sampling=SamplingParams(temperature=1.0,
                                                                                   logit_bias=NO_EOS))[1:]
        batched = run(engine, [*requests(tokenizer, "seed-batched", spec(), n=1, sampling=seeded), *others])
        assert ids(batched[0]) == solo
    finally:
        engine.stop()


def test_long_ragged_generation_compacts_the_batch_and_keeps_the_plain_output(target):
    """Two rows keep every draft and two keep none, for 240 tokens: the rejected tails rolled into left padding
    add up past the compaction threshold (64 positions a row), and the batch is rebuilt mid-generation."""
    model, tokenizer = target
    plain = start(model)
    try:
        expected = [ids(r) for r in alone(plain, requests(tokenizer, "long-p", Plain(), n=4, max_tokens=240))]
    finally:
        plain.stop()
    batch = requests(tokenizer, "long-s", spec(drafter="oracle"), n=4, max_tokens=240)
    spoiled = {tuple(r.prompt): [t if i % 2 == 0 else (t + 1) % 900 for t in out]
               for i, (r, out) in enumerate(zip(batch, expected, strict=True))}
    engine = start(model, OracleDrafter(spoiled), adaptive=False)
    try:
        results = run(engine, batch)
        assert engine.core.runner.batch.speculative_step._ragged < 64 * 4  # reset by a compaction on the way (384 positions were added)
    finally:
        engine.stop()
    assert [ids(r) for r in results] == expected
    assert [r[1].decode["acceptance"] for r in results] == [1.0, 0.0, 1.0, 0.0]


def test_verify_passes_over_padded_caches_give_the_plain_output(target, unrelated, plain_outputs, monkeypatch):
    """What CUDA runs (mlxd/engine/padded.py: attention over a bucket of key positions, masked), forced here: the
    same tokens as plain decoding, alone (every draft accepted) and batched with ragged acceptance."""
    import mlxd.engine.step.target
    from mlxd.engine.step.padded import padded

    monkeypatch.setattr(mlxd.engine.step.target, "pad_verify", lambda: True)
    calls = []
    monkeypatch.setattr(mlxd.engine.step.target, "padded", lambda cache: calls.append(1) or padded(cache))
    model, tokenizer = target
    engine = start(model, DraftModelDrafter(model), adaptive=False)
    try:
        results = alone(engine, requests(tokenizer, "padded", spec(), n=3))
        assert [ids(r) for r in results] == plain_outputs[:3]
        assert all(finished.decode["acceptance"] == 1.0 for _, finished in results)
        assert len(calls) >= 3 * 7  # every verify pass went through the padded caches
    finally:
        engine.stop()
    engine = start(model, DraftModelDrafter(unrelated), adaptive=False)
    try:
        modes = [spec() if i % 2 == 0 else Plain() for i in range(8)]
        assert [ids(r) for r in run(engine, requests(tokenizer, "padded-mixed", modes))] == plain_outputs
    finally:
        engine.stop()
