"""Speculative sampling keeps the target's distribution: a chi-square test against the exact distribution.

A tiny model with a vocabulary of 16 tokens, sampled at temperature 1, and a drafter that differs from it (another
random model, drafting greedily). For one prompt, the exact marginal distributions of the 2nd and 3rd generated
tokens (both produced by speculative verification, not by the prompt's pass) are computed by enumerating every
earlier token. Thousands of seeded requests, speculative and plain, are each compared with them: fixed seeds make the
outcome the same on every run.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.llama import Model, ModelArgs
from scipy.stats import chisquare

from mlxd.config.schema import EngineConfig, SpeculativeConfig
from mlxd.engine.base import EngineRequest, Finished, Plain, SamplingParams, Speculative, Token
from mlxd.engine.drafters.draft_model import DraftModelDrafter
from mlxd.engine.engine import BatchedEngine

VOCAB = 16
PROMPT = [3, 1, 4, 1, 5]
NUM_SAMPLES = 3000


def tiny(seed: int, noise: float = 0.0) -> Model:
    """A random model; with ``noise``, the seed's model with its output layer perturbed (a drafter that agrees with
    it often, not always)."""
    args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                     tie_word_embeddings=False)
    mx.random.seed(seed)
    model = Model(args)
    weight = model.lm_head.weight * 4  # peaked distributions
    if noise:
        weight = weight + noise * mx.random.normal(weight.shape, key=mx.random.key(seed + 1000))
    model.lm_head.weight = weight
    mx.eval(model.parameters())
    return model


def next_probs(model: Model, prefixes: list[list[int]]) -> np.ndarray:
    """p(next token | prefix) for each prefix (all the same length), ``(len(prefixes), VOCAB)``."""
    logits = model(mx.array(prefixes), cache=make_prompt_cache(model))[:, -1, :]
    return np.array(mx.softmax(logits.astype(mx.float32), axis=-1))


def exact_marginals(model: Model) -> tuple[np.ndarray, np.ndarray]:
    """The exact distributions of the 2nd and 3rd generated tokens, by enumerating the tokens before them."""
    p1 = next_probs(model, [PROMPT])[0]
    firsts = [[*PROMPT, a] for a in range(VOCAB)]
    p2_given = next_probs(model, firsts)  # [a, b] = p(b | a)
    second = p1 @ p2_given
    pairs = [[*PROMPT, a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p3_given = next_probs(model, pairs).reshape(VOCAB, VOCAB, VOCAB)  # [a, b, c] = p(c | a, b)
    third = np.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return second, third


def sample(engine: BatchedEngine, decode: object) -> np.ndarray:
    """The first three generated tokens of NUM_SAMPLES seeded requests, ``(NUM_SAMPLES, 3)``."""

    async def one(seed: int) -> list[int]:
        request = EngineRequest(request_id=f"s{seed}-{type(decode).__name__}", prompt=PROMPT, max_tokens=3,
                                sampling=SamplingParams(temperature=1.0, seed=seed), decode=decode)
        tokens = []
        async for event in engine.submit(request).events():
            if isinstance(event, Token):
                tokens.append(event.token)
            elif isinstance(event, Finished):
                return tokens
        raise AssertionError("the request did not finish")

    async def all_of_them() -> list[list[int]]:
        out = []
        for start in range(0, NUM_SAMPLES, 64):  # within the queue's limit
            out += await asyncio.gather(*(one(seed) for seed in range(start, min(start + 64, NUM_SAMPLES))))
        return out

    return np.array(asyncio.run(all_of_them()))


def goodness_of_fit(samples: np.ndarray, expected: np.ndarray) -> float:
    """The chi-square p-value of the samples against the expected distribution, bins with an expected count
    under 5 pooled into one."""
    observed = np.bincount(samples, minlength=VOCAB).astype(float)
    counts = expected.astype(np.float64) * len(samples)
    small = counts < 5
    observed = np.append(observed[~small], observed[small].sum())
    counts = np.append(counts[~small], counts[small].sum())
    if counts[-1] < 5:  # nothing pooled, or too little to keep as a bin: fold it into the largest
        observed[np.argmax(counts[:-1])] += observed[-1]
        counts[np.argmax(counts[:-1])] += counts[-1]
        observed, counts = observed[:-1], counts[:-1]
    return chisquare(observed, counts * observed.sum() / counts.sum()).pvalue


@pytest.fixture(scope="module")
def models():
    return tiny(1), tiny(1, noise=1.0)


@pytest.mark.parametrize("mode", ["speculative", "plain"])
def test_speculative_samples_follow_the_target_distribution(models, mode):
    target, draft = models
    second, third = exact_marginals(target)
    drafter = DraftModelDrafter(draft)
    config = EngineConfig(max_running=16, prefill_chunk=64, warmup_tokens=1,
                          speculative=SpeculativeConfig(drafter=drafter.name, k=3, adaptive=False))
    engine = BatchedEngine(target, config, drafter=drafter)
    engine.start()
    try:
        decode = Speculative(drafter=drafter.name, k=3, adaptive=False) if mode == "speculative" else Plain()
        tokens = sample(engine, decode)
        status = engine.status()["speculative"]
    finally:
        engine.stop()
    assert tokens.shape == (NUM_SAMPLES, 3)
    if mode == "speculative":
        # The drafter was asked, and both of verification's paths ran: drafts accepted and drafts rejected.
        assert 0.05 < status["acceptance"] < 0.95
    assert goodness_of_fit(tokens[:, 1], second) > 0.001
    assert goodness_of_fit(tokens[:, 2], third) > 0.001
