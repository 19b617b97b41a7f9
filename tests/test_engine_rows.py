"""Per-row state inside the batched step, against oracles: a seeded request samples the same tokens alone and in
a batch of 8; logprobs equal a direct log-softmax of the model's raw logits; a request's logits processors (from its
factory) act on its row alone; a request ended by the pipeline finishes as ``stop``, not as a cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, SamplingParams, Token
from mlxd.engine.engine import BatchedEngine

PROMPTS = ["Once upon a time", "def fibonacci(n):", "Hello", "The quick brown fox", "Rain fell softly",
           "1 2 3 4", "What is the capital of France?", "SELECT name FROM users"]
NO_EOS = {0: -100.0, 2: -100.0}  # the tiny tokenizer's end-of-sequence ids: every stream runs to max_tokens


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def engine(reference):
    model, _ = reference
    engine = BatchedEngine(model, EngineConfig(max_running=8, prefill_chunk=64, warmup_tokens=1))
    engine.start()
    yield engine
    engine.stop()


def request(tokenizer: Any, i: int, **kw: Any) -> EngineRequest:
    sampling = kw.pop("sampling", SamplingParams(logit_bias=NO_EOS))
    return EngineRequest(request_id=f"r{i}-{kw.pop('tag', '')}", prompt=tokenizer.encode(PROMPTS[i]),
                         max_tokens=kw.pop("max_tokens", 12), sampling=sampling, **kw)


async def run(engine: BatchedEngine, requests: list[EngineRequest]) -> list[tuple[list[Token], Any]]:
    async def one(req: EngineRequest) -> tuple[list[Token], Any]:
        tokens = []
        async for event in engine.submit(req).events():
            if isinstance(event, Token):
                tokens.append(event)
            elif isinstance(event, Finished | Failed):
                return tokens, event
        raise AssertionError("no final event")

    return await asyncio.gather(*(one(r) for r in requests))


def ids(tokens: list[Token]) -> list[int]:
    return [t.token for t in tokens]


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch_of_eight(engine, reference):
    _, tokenizer = reference
    seeded = SamplingParams(temperature=1.0, seed=1234, logit_bias=NO_EOS)
    alone = asyncio.run(run(engine, [request(tokenizer, 0, sampling=seeded, tag="alone")]))[0][0]
    others = [request(tokenizer, i, sampling=SamplingParams(temperature=1.0, logit_bias=NO_EOS), tag="b")
              for i in range(1, 8)]
    batched = asyncio.run(run(engine, [request(tokenizer, 0, sampling=seeded, tag="batched"), *others]))
    assert ids(batched[0][0]) == ids(alone)
    again = asyncio.run(run(engine, [*others[:3], request(tokenizer, 0, sampling=seeded, tag="again")]))
    assert ids(again[-1][0]) == ids(alone)
    other_seed = SamplingParams(temperature=1.0, seed=99, logit_bias=NO_EOS)
    assert ids(asyncio.run(run(engine, [request(tokenizer, 0, sampling=other_seed, tag="s99")]))[0][0]) != ids(alone)


def direct_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[mx.array]:
    """Log-softmax of the model's raw logits at each generated position (the oracle)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    out = []
    for token in tokens:
        out.append(logits[0] - mx.logsumexp(logits[0]))
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out


@pytest.mark.parametrize("batched", [False, True])
def test_logprobs_are_the_raw_log_softmax_alone_and_in_a_batch(engine, reference, batched):
    model, tokenizer = reference
    # A penalty and a temperature change the sampling distribution, never the reported logprobs.
    sampling = SamplingParams(temperature=0.7, repetition_penalty=1.3, logit_bias=NO_EOS)
    asked = request(tokenizer, 1, sampling=sampling, num_logprobs=5, tag=f"lp{batched}")
    crowd = [request(tokenizer, i, tag=f"crowd{batched}") for i in (2, 3, 4)] if batched else []
    results = asyncio.run(run(engine, [asked, *crowd]))
    tokens = results[0][0]
    assert all(t.logprob is None and t.top == () for r in results[1:] for t in r[0])
    expected = direct_logprobs(model, asked.prompt, ids(tokens))
    for token, row in zip(tokens, expected, strict=True):
        assert token.logprob == pytest.approx(row[token.token].item(), abs=2e-3)
        top = mx.argsort(-row)[:5].tolist()
        assert [i for i, _ in token.top] == top
        for i, lp in token.top:
            assert lp == pytest.approx(row[i].item(), abs=2e-3)


class Forbid:
    """A logits processor that bans one token: the test's stand-in for a grammar."""

    def __init__(self, token: int) -> None:
        self.token, self.calls = token, 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.calls += 1
        return mx.where(mx.arange(logits.shape[-1]) == self.token, -mx.inf, logits)


def test_a_request_s_processors_act_on_its_row_alone(engine, reference):
    _, tokenizer = reference
    greedy = [request(tokenizer, i, tag="plain") for i in range(4)]
    plain = asyncio.run(run(engine, greedy))
    banned = ids(plain[0][0])[0]
    made: list[Forbid] = []

    def factory() -> list:
        made.append(Forbid(banned))
        return [made[-1]]

    constrained = request(tokenizer, 0, logits_processors=factory, tag="constrained")
    mixed = asyncio.run(run(engine, [constrained, *[request(tokenizer, i, tag="n") for i in range(1, 4)]]))
    assert banned not in ids(mixed[0][0])
    assert [ids(r[0]) for r in mixed[1:]] == [ids(r[0]) for r in plain[1:]]  # neighbours unchanged
    # Once per token, and once more at most: the pipelined step computes the next logits before the engine knows
    # the last token was the last.
    assert len(made) == 1 and len(mixed[0][0]) <= made[0].calls <= len(mixed[0][0]) + 1


def test_ended_by_the_pipeline_finishes_as_stop_not_as_a_cancellation(engine, reference):
    _, tokenizer = reference

    async def end_after_three(reason: str) -> Any:
        handle = engine.submit(request(tokenizer, 0, max_tokens=200, tag=reason))
        num = 0
        async for event in handle.events():
            if isinstance(event, Token):
                num += 1
                if num == 3:
                    handle.cancel(reason)
        return engine.status()["totals"]

    before = engine.status()["totals"]
    after = asyncio.run(end_after_three("stop"))
    assert after["num_cancelled"] == before["num_cancelled"]
    after_cancel = asyncio.run(end_after_three("cancelled"))
    assert after_cancel["num_cancelled"] == before["num_cancelled"] + 1
