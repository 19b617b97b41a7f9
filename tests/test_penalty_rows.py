"""Rows with penalties and logit bias, processed together in a decode step, against mlx-lm's own processors: the
batched arithmetic equals each row's processors bit for bit (repeated tokens in the window included), and rows of
several settings decoding together, short prompts among them, give what ``generate_step`` gives each alone."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, SamplingParams
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.step.penalties import CONTEXT, apply_penalties, penalty_key
from mlxd.engine.step.sampling import make_request_processors
from tests.test_batched_engine import collect_tokens

SETTINGS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=0.4),
    SamplingParams(logit_bias={5: -3.0, 7: 2.5}, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3),
]


@pytest.mark.parametrize("params", SETTINGS)
def test_batched_penalties_equal_mlx_lm_processors_bit_for_bit(params):
    key = mx.random.key(3)
    logits = mx.random.normal((12, 1000), key=key) * 5
    # Histories of 30+ tokens drawn from 60 ids: every window repeats some.
    histories = [mx.random.randint(0, 60, (30 + i,), key=mx.random.key(i)).astype(mx.uint32) for i in range(12)]
    solo = []
    for i, history in enumerate(histories):
        row = logits[i : i + 1]
        for processor in make_request_processors(params):
            row = processor(history, row)
        solo.append(row)
    windows = mx.stack([h[-CONTEXT:] for h in histories])
    assert mx.array_equal(apply_penalties(penalty_key(params), windows, logits), mx.concatenate(solo)).item()


def test_rows_of_several_penalty_settings_decode_together_as_alone(tiny_model_dir, monkeypatch):
    import mlxd.engine.step.batch as batch_module

    group_sizes: list[int] = []

    def counted(key, windows, logits):
        group_sizes.append(windows.shape[0])
        return apply_penalties(key, windows, logits)

    monkeypatch.setattr(batch_module, "apply_penalties", counted)
    model, tokenizer = load(str(tiny_model_dir))
    shared = SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, logit_bias={11: -4.0})
    settings = [shared] * 8 + [SETTINGS[0]] * 3 + [SETTINGS[3], SamplingParams()]
    # Short prompts (fewer tokens than a penalty window) and long ones: rows join their group once theirs is full.
    prompts = [tokenizer.encode(("tell me a story " * (1 + 3 * (i % 4)))[: 8 + 23 * (i % 4)] + str(i))
               for i in range(len(settings))]
    assert min(map(len, prompts)) < CONTEXT < max(map(len, prompts))
    max_tokens = 24

    def alone(prompt: list[int], params: SamplingParams) -> list[int]:
        return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                            logits_processors=make_request_processors(params))]

    want = [alone(p, s) for p, s in zip(prompts, settings, strict=True)]
    unpenalized = [alone(p, SamplingParams()) for p in prompts[:8]]
    assert want[:8] != unpenalized  # the penalties change the greedy output
    engine = BatchedEngine(model, EngineConfig(max_running=16, prefix_cache_bytes=0, warmup_tokens=1))
    engine.start()
    try:
        async def together():
            return await asyncio.gather(*[
                collect_tokens(engine, EngineRequest(request_id=f"p{i}", prompt=p, max_tokens=max_tokens,
                                                     sampling=s, stop_token_ids=frozenset()))
                for i, (p, s) in enumerate(zip(prompts, settings, strict=True))])

        got = asyncio.run(together())
    finally:
        engine.stop()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"row {i}"
    # The shared settings' rows were processed together (8 once every window is full), the three of another
    # setting too; the row alone in its setting never was.
    assert max(group_sizes) == 8 and 3 in group_sizes and 1 not in group_sizes


def test_rows_leaving_a_penalty_group_at_different_steps_keep_their_solo_output(tiny_model_dir):
    """A group's windows roll forward while it keeps its rows; as rows finish one by one, the group is rebuilt, and
    the last row goes on alone, each from the history its window gave back: every row equals its solo run."""
    model, tokenizer = load(str(tiny_model_dir))
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3)
    prompts = [tokenizer.encode(("once upon a time " * 4)[: 30 + 3 * i] + str(i)) for i in range(5)]
    lengths = [30, 26, 22, 18, 40]

    def alone(prompt: list[int], max_tokens: int) -> list[int]:
        return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                            logits_processors=make_request_processors(params))]

    engine = BatchedEngine(model, EngineConfig(max_running=8, prefix_cache_bytes=0, warmup_tokens=1))
    engine.start()
    try:
        async def together():
            return await asyncio.gather(*[
                collect_tokens(engine, EngineRequest(request_id=f"q{i}", prompt=p, max_tokens=n, sampling=params,
                                                     stop_token_ids=frozenset()))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))])

        got = asyncio.run(together())
    finally:
        engine.stop()
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert got[i] == alone(prompt, n), f"row {i}"
