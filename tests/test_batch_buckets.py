"""Batch-width buckets against oracles: with buckets on (forced on the CPU), every decode step and every group of
prompts the engine runs while serving a random mix of arrivals, groups and departures has a (rows, positions) shape
that warm-up ran; each request's greedy tokens equal its solo ``generate_step`` output, padded rows or not; and
warm-up's pass count follows its formula, bounded at ``max_running`` 128."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, SamplingParams
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.buckets import Buckets, bucket_widths, make_buckets
from mlxd.engine.step.prompts import process_prompt, process_prompts
from mlxd.engine.step.row import Row
from mlxd.engine.step.warmup import count_passes, warm_up_shapes
from tests.test_batched_engine import CountingModel, collect_tokens
from tests.test_warmup import RecordingModel

MAX_RUNNING = 24


def solo(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def run_steps(batch: DecodeBatch, tokens: dict[str, list[int]], count: int) -> None:
    """``count`` decode steps, each row's emitted tokens added to its list."""
    for _ in range(count):
        for row, emitted in zip(batch.rows, batch.step(), strict=True):
            tokens[row.request_id] += emitted


def assert_solo_tokens(model: Any, rows: list[Row], prompts: list[list[int]], tokens: dict[str, list[int]]) -> None:
    """Every row's tokens equal its prompt's solo greedy run."""
    for row, prompt in zip(rows, prompts, strict=True):
        got = tokens[row.request_id]
        assert got == solo(model, prompt, len(got)), row.request_id


def test_widths_are_powers_of_two_to_eight_then_multiples_of_eight():
    assert bucket_widths(128) == (1, 2, 4, 8, *range(16, 129, 8))
    assert bucket_widths(24) == (1, 2, 4, 8, 16, 24)
    assert bucket_widths(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_widths(1) == (1,)
    buckets = Buckets(24)
    assert [buckets.width(n) for n in (1, 2, 3, 5, 9, 16, 17, 24, 30)] == [1, 2, 4, 8, 16, 16, 24, 24, 30]
    assert make_buckets(24, "off") is None and make_buckets(24, "on") == buckets and make_buckets(1, "on") is None
    assert make_buckets(24, "groups") == Buckets(24, decode=False)
    assert make_buckets(24) == (None if mx.default_device() == mx.cpu else buckets)


@pytest.fixture(params=["llama", "qwen3_next"])
def model(request, tiny_model_dir, tiny_qwen3_next_dir):
    return load(str(tiny_model_dir if request.param == "llama" else tiny_qwen3_next_dir))[0]


def test_padded_batches_give_each_row_its_solo_greedy_tokens(model):
    """Rows of mixed prompt lengths join one at a time and as a padded group, leave in between, and every row's
    tokens equal its solo run; the model only ever sees bucket widths."""
    recording = RecordingModel(model)
    buckets = Buckets(8)
    batch = DecodeBatch(recording, buckets=buckets)
    prompts = [[5 + i + j for j in range(3 + 4 * i)] for i in range(7)]
    rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(7)]
    tokens: dict[str, list[int]] = {row.request_id: [] for row in rows}

    def steps(count: int) -> None:
        run_steps(batch, tokens, count)

    for row, prompt in zip(rows[:3], prompts[:3], strict=True):  # widths 1, 2, then 3 rows padded to 4
        batch.add(row, process_prompt(recording, row, prompt, last=True))
        steps(2)
    batch.add_batch(rows[3:], *process_prompts(recording, rows[3:], prompts[3:], buckets=buckets))  # 4 padded to 8
    steps(3)
    batch.remove({"r1", "r4"})  # 5 rows, still 8 wide
    steps(2)
    batch.remove({"r0", "r2", "r5"})  # 2 rows, no filler
    steps(1)
    assert {batch for batch, _ in recording.shapes} <= set(bucket_widths(8))
    assert (8, 1) in recording.shapes and (4, 1) in recording.shapes  # a group of 4 ran 8 wide; 3 rows ran 4 wide
    assert_solo_tokens(model, rows, prompts, tokens)


def test_rows_joining_a_padded_batch_take_the_filler_places_and_give_their_solo_tokens(model):
    """Rows join a batch whose filler rows can hold them (alone, then as a group of two), written into the filler's
    places in place; a row longer than the batch so far joins the other way. The model sees 8 rows once the batch
    is 8 wide, and every row's tokens equal its solo run."""
    recording = RecordingModel(model)
    buckets = Buckets(8)
    batch = DecodeBatch(recording, buckets=buckets)
    prompts = [[5 + i + j for j in range(6 + 2 * i)] for i in range(3)] + [[3, 4, 5, 6], [9] * 5, [3, 4], [8] * 5]
    prompts.append(list(range(40, 70)))
    rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {row.request_id: [] for row in rows}

    def steps(count: int) -> None:
        run_steps(batch, tokens, count)

    batch.add_batch(rows[:3], *process_prompts(recording, rows[:3], prompts[:3], buckets=buckets))  # 3 of 4
    steps(1)
    batch.add(rows[3], process_prompt(recording, rows[3], prompts[3], last=True))  # alone: 4 of 4
    steps(2)
    batch.add_batch(rows[4:5], *process_prompts(recording, rows[4:5], prompts[4:5], buckets=buckets))  # 5 of 8
    steps(1)
    batch.add_batch(rows[5:7], *process_prompts(recording, rows[5:7], prompts[5:7], buckets=buckets))  # 7 of 8
    steps(2)
    recording.shapes.clear()
    batch.add(rows[7], process_prompt(recording, rows[7], prompts[7], last=True))  # longer than the batch
    steps(3)
    assert {shape for shape in recording.shapes if shape[1] == 1} == {(8, 1)}
    assert_solo_tokens(model, rows, prompts, tokens)


def test_rows_leaving_a_padded_batch_of_the_same_width_leave_the_others_in_place(model):
    """Rows leave from the middle of a padded batch whose bucket stays the same: the others keep their places in
    the batched cache (nothing is copied), a row then joins, another leaves, and one's cache is taken out. Every
    row's tokens equal its solo run, and the cache taken out continues as its solo run does."""
    recording = RecordingModel(model)
    buckets = Buckets(8)
    batch = DecodeBatch(recording, buckets=buckets)
    prompts = [[5 + i + j for j in range(3 + 2 * i)] for i in range(8)]
    rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(8)]
    tokens: dict[str, list[int]] = {row.request_id: [] for row in rows}

    def steps(count: int) -> None:
        run_steps(batch, tokens, count)

    batch.add_batch(rows[:7], *process_prompts(recording, rows[:7], prompts[:7], buckets=buckets))
    steps(2)
    states = [layer.state for layer in batch.cache]
    batch.remove({"r1", "r3"})  # 5 rows, still 8 wide
    assert all(layer.state[0] is state[0] for layer, state in zip(batch.cache, states, strict=True))
    steps(2)
    batch.add(rows[7], process_prompt(recording, rows[7], prompts[7], last=True))  # 6 of 8
    steps(2)
    batch.remove({"r0"})
    steps(2)
    taken, held = batch.row_cache("r4"), len(tokens["r4"])  # the prompt and every token emitted so far
    steps(1)
    assert {shape for shape in recording.shapes if shape[1] == 1} == {(8, 1)}
    assert_solo_tokens(model, rows, prompts, tokens)
    after = [t for t, _ in generate_step(mx.array([tokens["r4"][held]]), model, max_tokens=3, prompt_cache=taken)]
    assert after == solo(model, prompts[4], held + 4)[held + 1 :]


def test_filling_rows_writes_what_extend_and_gather_give(tiny_model_dir):
    """Written into filler rows, a joining row's keys, values, left padding and offset equal what mlx-lm's
    ``extend`` followed by a gather of the rows into order gives, over every position attention reads."""
    from mlxd.engine.step.batchcache import fill_rows, gather_rows

    model = load(str(tiny_model_dir))[0]
    buckets = Buckets(8)
    prompts = [[5 + i + j for j in range(6 + 3 * i)] for i in range(3)]
    joining = Row.for_request("j", SamplingParams(), model, 0)
    process_prompt(model, joining, [7, 8, 9, 10], last=True)

    def batched() -> list[Any]:
        rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(3)]
        cache, _ = process_prompts(model, rows, prompts, buckets=buckets)
        gather_rows(cache, mx.array([0, 1, 2, 0]), trim=False)  # 3 rows and a filler, as a padded batch holds them
        return cache

    filled, extended = batched(), batched()
    assert fill_rows(filled, 3, joining.cache, 1)
    for layer, lone in zip(extended, joining.cache, strict=True):
        layer.extend(lone.merge([lone]))
    gather_rows(extended, mx.array([0, 1, 2, 4]), trim=False)
    for a, b in zip(filled, extended, strict=True):
        assert a._idx == b._idx
        assert a.left_padding.tolist() == b.left_padding.tolist() and a.offset.tolist() == b.offset.tolist()
        for i, pad in enumerate(a.left_padding.tolist()):
            assert mx.array_equal(a.keys[i, :, pad : a._idx], b.keys[i, :, pad : b._idx]).item()
            assert mx.array_equal(a.values[i, :, pad : a._idx], b.values[i, :, pad : b._idx]).item()


def test_a_padded_batch_emptied_at_once_takes_a_lone_row_as_generate_step(tiny_model_dir):
    """Every row of a padded batch (3 rows, 4 wide) leaves in one step; a row then joining the empty batch, alone
    or as a group of one, runs unpadded and gives its solo tokens (a stale filler count once fed it extra rows: a
    broadcast error in its first decode step on a GPU, after a burst had left)."""
    model = load(str(tiny_model_dir))[0]
    buckets = Buckets(8)
    batch = DecodeBatch(model, buckets=buckets)
    prompts = [[7 + i + j for j in range(4 + 3 * i)] for i in range(5)]
    rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(5)]
    batch.add_batch(rows[:3], *process_prompts(model, rows[:3], prompts[:3], buckets=buckets))
    batch.step()
    batch.remove({"r0", "r1", "r2"})
    for joining in ("alone", "group of one"):
        row, prompt = (rows[3], prompts[3]) if joining == "alone" else (rows[4], prompts[4])
        if joining == "alone":
            batch.add(row, process_prompt(model, row, prompt, last=True))
        else:
            batch.add_batch([row], *process_prompts(model, [row], [prompt], buckets=buckets))
        got = [token for _ in range(4) for token in batch.step()[0]]
        assert got == solo(model, prompt, len(got)), joining
        batch.remove({row.request_id})


def test_serving_meets_only_shapes_warm_up_ran(tiny_model_dir):
    """Warm-up with buckets forced on records its shapes; then random waves of requests (prompts of 3-60 tokens,
    1-12 tokens each, so rows join alone and in groups and leave at random) must meet no decode width and no
    group shape outside them, and each request gives its solo greedy tokens."""
    model, _ = load(str(tiny_model_dir))
    counting = CountingModel(model)
    config = EngineConfig(max_running=MAX_RUNNING, max_waiting=128, step_token_budget=2048, prefill_chunk=128,
                          prefix_cache_bytes=0, warmup_tokens=1, batch_buckets="on")
    engine = BatchedEngine(counting, config)
    engine.start()
    rng = random.Random(35)
    requests = [EngineRequest(request_id=f"r{i}", prompt=[rng.randrange(3, 900) for _ in range(rng.randint(3, 60))],
                              max_tokens=rng.randint(1, 12), prefill_chunk=128)
                for i in range(80)]
    try:
        warm = {(c.batch, c.length) for c in counting.calls}
        counting.calls.clear()

        async def serve() -> list[list[int]]:
            async def later(request: EngineRequest, delay: float) -> list[int]:
                await asyncio.sleep(delay)
                return await collect_tokens(engine, request)

            delays = [rng.choice((0.0, 0.0, 0.05, 0.1, 0.2, 0.3)) for _ in requests]
            return await asyncio.gather(*(later(r, d) for r, d in zip(requests, delays, strict=True)))

        together = asyncio.run(serve())
    finally:
        engine.stop()
    served = [(c.batch, c.length) for c in counting.calls]
    decode = {shape for shape in served if shape[1] == 1}
    groups = {shape for shape in served if shape[0] > 1 and shape[1] > 1}
    assert len(decode) > 3 and groups, (decode, groups)  # the mix reached several widths and grouped prompts
    assert decode <= warm, decode - warm
    assert groups <= warm, groups - warm
    for request, got in zip(requests, together, strict=True):
        assert got == solo(model, request.prompt, request.max_tokens), request.request_id


def test_warm_up_passes_follow_the_formula_and_stay_bounded_at_128(tiny_model_dir):
    model = load(str(tiny_model_dir))[0]
    config = EngineConfig(max_running=MAX_RUNNING, prefill_chunk=64, warmup_tokens=2)
    recording = RecordingModel(model)
    warm_up_shapes(recording, config, buckets=Buckets(MAX_RUNNING))
    prompts = [shape for shape in recording.shapes if shape[1] > 1]
    counted = (len(prompts), sum(1 for b, _ in prompts if b > 1), sum(1 for _, n in recording.shapes if n == 1))
    assert counted == count_passes(config, Buckets(MAX_RUNNING))
    # L (m - 1) + 3m + 1 prompt passes (L (m - 1) + 3m - 5 groups), T m + (L + 2)(m - 1) - 1 decode steps
    wide = EngineConfig(max_running=128, warmup_tokens=4)
    assert count_passes(wide, Buckets(128)) == (4 * 18 + 3 * 19 + 1, 4 * 18 + 3 * 19 - 5, 4 * 19 + 6 * 18 - 1)
    assert count_passes(wide, Buckets(128)) == (130, 124, 183)
    every = count_passes(wide, None)
    assert every[0] > 3 * count_passes(wide, Buckets(128))[0] and every[2] > 6 * count_passes(wide, Buckets(128))[2]


def test_padded_batches_with_image_rows_equal_their_solo_outputs(tiny_vlm):
    """Image rows (multimodal positions: their RoPE offsets padded for the filler rows too) among text rows, in a
    padded decode batch, give what each gives alone."""
    from tests.test_vision_engine import Prompts, loaded_model
    from tests.test_wide_batch import run_together, text

    loaded = loaded_model(tiny_vlm("qwen2_5_vl"), counting=True)
    model, prompts = loaded.model, Prompts(loaded)

    def request(i: int, tag: str) -> EngineRequest:
        prompt, media = prompts(text(i), 100 + i) if i % 3 == 0 else prompts(text(i))
        return EngineRequest(request_id=f"{tag}-{i}", prompt=prompt, media=media, prefill_chunk=256,
                             route="text" if media is None else "vision", max_tokens=3 + i % 4)

    config = EngineConfig(max_running=16, max_waiting=16, step_token_budget=8192, prefill_chunk=256,
                          prefix_cache_bytes=0, warmup_tokens=1, batch_buckets="on")
    engine = BatchedEngine(model, config)
    engine.start()
    try:
        solo = [asyncio.run(collect_tokens(engine, request(i, "solo"))) for i in range(11)]
        model.calls.clear()
        together = run_together(engine, model.gate, [request(i, "mix") for i in range(11)])
    finally:
        engine.stop()
    assert {batch for batch, length in model.calls if length == 1} <= set(bucket_widths(16))
    assert (16, 1) in model.calls  # 11 rows decoded 16 wide
    assert together == solo


def test_speculative_rows_join_and_leave_a_padded_batch_with_penalty_rows(tiny_model_dir, tiny_models_root):
    """Speculative rows (a drafter that is often wrong) run unpadded; once the last leaves, the plain rows run
    padded again (3 rows, 4 wide), their penalty group's windows rolling forward, and every row equals its solo
    plain output."""
    from mlxd.config.schema import SpeculativeConfig
    from mlxd.engine.base import Plain, Speculative
    from mlxd.engine.drafters.draft_model import DraftModelDrafter
    from tests.support.tiny import tiny_model_cached

    model, tokenizer = load(str(tiny_model_dir))
    unrelated = load(str(tiny_model_cached(tiny_models_root, "llama", seed=7)))[0]
    sampling = SamplingParams(logit_bias={0: -100.0, 2: -100.0}, repetition_penalty=1.3)
    texts = ["Once upon a time", "def fibonacci(n):", "Hello", "The quick brown fox", "Rain fell", "1 2 3 4"]

    def requests(tag: str, speculative: bool) -> list[EngineRequest]:
        return [EngineRequest(request_id=f"{tag}-{i}", prompt=tokenizer.encode(text), sampling=sampling,
                              max_tokens=8 + 4 * i if i % 2 == 0 else 34,
                              decode=Speculative(drafter="draft_model", k=3) if speculative and i % 2 == 0
                              else Plain())
                for i, text in enumerate(texts)]

    def serve(engine: BatchedEngine, batch: list[EngineRequest]) -> list[list[int]]:
        async def together():
            return await asyncio.gather(*(collect_tokens(engine, r) for r in batch))

        return asyncio.run(together())

    common = dict(max_running=8, prefill_chunk=64, warmup_tokens=1, prefix_cache_bytes=0, batch_buckets="on")
    plain = BatchedEngine(model, EngineConfig(**common))
    plain.start()
    try:
        want = [serve(plain, [r])[0] for r in requests("alone", speculative=False)]
    finally:
        plain.stop()
    counting = CountingModel(model)
    engine = BatchedEngine(counting, EngineConfig(**common, speculative=SpeculativeConfig(drafter="draft_model")),
                           drafter=DraftModelDrafter(unrelated))
    engine.start()
    try:
        counting.calls.clear()
        got = serve(engine, requests("mixed", speculative=True))
    finally:
        engine.stop()
    assert got == want
    decode = [c.batch for c in counting.calls if c.length == 1]
    assert 4 in decode and 3 not in decode[decode.index(4):]  # back to padded once the speculative rows left
