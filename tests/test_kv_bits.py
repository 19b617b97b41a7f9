"""``[engine] kv_bits``: attention keys and values quantized in a request's cache, the decode batch and the prefix
cache, against oracles. Greedy rows decode the same alone and in a batch of 8 that they join at different times
(prompt lengths differ, rows leave early); a prefix-cache hit gives the tokens a miss gives; speculative rows (ragged
acceptance: per-row rollback of the batched quantized cache) give plain decoding's tokens; the bytes a token holds,
measured on real caches, are what 8 and 4 bits with their scales and biases make of 16; and what cannot be quantized
is a config error that says why.

The tiny models here have heads of 32 features (the default tiny model's 16 are below MLX's smallest quantization
group) and kv_group_size 32.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from mlxd.cache.prefix_cache import PrefixCache
from mlxd.cache.quantized import (
    BatchQuantizedKVCache,
    KVQuantization,
    QuantizedLayer,
    check_quantized_attention,
)
from mlxd.cache.store import take_snapshot
from mlxd.config.load import load_config
from mlxd.config.schema import EngineConfig, SpeculativeConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, Plain, SamplingParams, Speculative, Token
from mlxd.engine.drafters.draft_model import DraftModelDrafter
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.schedule.memory import measure_kv_cost, measure_memory
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.prompts import process_continuations, process_prompt, process_prompts
from mlxd.engine.step.row import Row, make_request_cache
from mlxd.errors import ConfigError
from tests.support.tiny import tiny_model_cached

HEADS_OF_32 = {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
GROUP = 32
PROMPTS = ["Once upon a time", "def fibonacci(n):", "Hello", "The quick brown fox jumps over the lazy dog, twice",
           "Rain", "1 2 3 4 5 6 7 8 9 10 11 12 13", "What is the capital of France?", "SELECT name FROM users"]
NO_EOS = {0: -100.0, 2: -100.0}  # the tiny tokenizer's end-of-sequence ids: every stream runs to max_tokens
GREEDY = SamplingParams(logit_bias=NO_EOS)


@pytest.fixture(scope="module")
def reference(tiny_models_root: Path) -> tuple[Any, Any]:
    return load(str(tiny_model_cached(tiny_models_root, "llama", **HEADS_OF_32)))


@pytest.fixture(scope="module")
def hybrid(tiny_models_root: Path) -> tuple[Any, Any]:
    """Linear-attention layers (a recurrent ``ArraysCache``, never quantized) between attention layers."""
    return load(str(tiny_model_cached(tiny_models_root, "qwen3_next", **HEADS_OF_32)))


ENGINE_CASES = [("reference", 8), ("reference", 4), ("hybrid", 8)]
PREFIX_CASES = [("reference", 8), ("reference", 4)]  # the hybrid model's: test_hybrid_rows_...


# ---- the decode batch (step level) ----

def _solo(model: Any, prompt: list[int], kv: KVQuantization, num_tokens: int) -> list[int]:
    row = Row.for_request("solo", GREEDY, model, 0, kv=kv)
    batch = DecodeBatch(model)
    batch.add(row, process_prompt(model, row, prompt, last=True))
    out: list[int] = []
    while len(out) < num_tokens:
        out += batch.step()[0]
    return out[:num_tokens]


def _advance(batch: DecodeBatch, out: dict[str, list[int]], lengths: list[int], seen: set[str]) -> None:
    """One step; rows that have their tokens leave."""
    seen.update(type(layer).__name__ for layer in batch.cache)
    for request_id, tokens in zip(batch.request_ids, batch.step(), strict=True):
        out[request_id] += tokens
    batch.remove({r for r in batch.request_ids if len(out[r]) >= lengths[int(r[1:])]})


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_joining_and_leaving_the_batch_decode_as_each_does_alone(reference, bits):
    model, tokenizer = reference
    kv = KVQuantization(bits, GROUP)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    lengths = [12 - (i % 3) * 3 for i in range(8)]  # rows leave at different steps: the batch shrinks and re-pads
    alone = [_solo(model, p, kv, n) for p, n in zip(prompts, lengths, strict=True)]
    batch, out, seen = DecodeBatch(model), {}, set()
    for i, prompt in enumerate(prompts):  # one row joins after each step
        row = Row.for_request(f"r{i}", GREEDY, model, 0, kv=kv)
        assert all(type(layer) is QuantizedLayer for layer in row.cache)
        batch.add(row, process_prompt(model, row, prompt, last=True))
        out[f"r{i}"] = []
        _advance(batch, out, lengths, seen)
    while batch.rows:
        _advance(batch, out, lengths, seen)
    assert [out[f"r{i}"][: lengths[i]] for i in range(8)] == alone
    assert "BatchQuantizedKVCache" in seen  # the batch held quantized keys, not 16-bit copies


@pytest.mark.parametrize("bits", [8, 4])
def test_prompts_sharing_a_pass_left_or_right_padded_decode_as_alone(reference, bits):
    """Whole prompts in one left-padded pass (``process_prompts``) and the rests of prompts whose start is cached in
    one right-padded pass (``process_continuations``: right padding rolled to the left by ``finalize``)."""
    model, tokenizer = reference
    kv = KVQuantization(bits, GROUP)
    prompts = [tokenizer.encode(p) for p in PROMPTS if len(tokenizer.encode(p)) > 2]
    alone = [_solo(model, p, kv, 8) for p in prompts]
    rows = [Row.for_request(f"r{i}", GREEDY, model, 0, kv=kv) for i in range(len(prompts))]
    together = _decode_group(model, rows, *process_prompts(model, rows, prompts))
    rows = [Row.for_request(f"r{i}", GREEDY, model, 0, kv=kv) for i in range(len(prompts))]
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        process_prompt(model, row, prompt[: 1 + i % 2], last=False)  # cached starts of different lengths
    rests = [p[1 + i % 2 :] for i, p in enumerate(prompts)]
    continued = _decode_group(model, rows, *process_continuations(model, rows, rests))
    assert together == alone and continued == alone


def _decode_group(model: Any, rows: list[Row], cache: list[Any], first: mx.array) -> list[list[int]]:
    assert all(type(layer) is BatchQuantizedKVCache for layer in cache)
    batch = DecodeBatch(model)
    batch.add_batch(rows, cache, first)
    out = {row.request_id: [] for row in rows}
    while any(len(tokens) < 8 for tokens in out.values()):
        for request_id, tokens in zip(batch.request_ids, batch.step(), strict=True):
            out[request_id] += tokens
    return [out[row.request_id][:8] for row in rows]


# ---- the engine ----

def _engine(model: Any, bits: int, drafter: Any = None, **config: Any) -> BatchedEngine:
    speculative = SpeculativeConfig(drafter=drafter.name if drafter is not None else "none")
    engine = BatchedEngine(model, EngineConfig(max_running=8, prefill_chunk=64, warmup_tokens=1, kv_bits=bits,
                                               kv_group_size=GROUP, speculative=speculative, **config),
                           drafter=drafter)
    engine.start()
    return engine


async def _collect(engine: BatchedEngine, requests: list[EngineRequest],
                   delays: list[float] | None = None) -> list[tuple[list[int], Any]]:
    async def one(request: EngineRequest, delay: float) -> tuple[list[int], Any]:
        await asyncio.sleep(delay)
        tokens: list[int] = []
        async for event in engine.submit(request).events():
            if isinstance(event, Token):
                tokens.append(event.token)
            elif isinstance(event, Finished | Failed):
                return tokens, event
        raise AssertionError("no final event")

    return await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays or [0.0] * len(requests), strict=True)))


def _requests(tokenizer: Any, tag: str, *, decode: Any = None, max_tokens: int = 16) -> list[EngineRequest]:
    return [EngineRequest(request_id=f"{tag}-{i}", prompt=tokenizer.encode(p), max_tokens=max_tokens - i % 3,
                          sampling=GREEDY, decode=decode or Plain()) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize(("served", "bits"), ENGINE_CASES)
def test_the_engine_serves_eight_staggered_rows_as_it_serves_each_alone(request, served, bits):
    model, tokenizer = request.getfixturevalue(served)
    engine = _engine(model, bits, prefix_cache_bytes=0)
    try:
        alone = [asyncio.run(_collect(engine, [r]))[0] for r in _requests(tokenizer, "alone")]
        together = asyncio.run(_collect(engine, _requests(tokenizer, "together"), [0.02 * i for i in range(8)]))
        assert all(isinstance(finished, Finished) for _, finished in alone + together)
        assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]
        assert engine.core.memory.kv.num_bytes_per_token == measure_kv_cost(model, kv=KVQuantization(bits, GROUP)) \
            .num_bytes_per_token
    finally:
        engine.stop()


@pytest.mark.parametrize(("served", "bits"), PREFIX_CASES)
def test_a_prefix_cache_hit_on_quantized_entries_gives_the_tokens_of_a_miss(request, served, bits):
    """The same prompt again (the finished row's entry, trimmed to the prompt) and the next turn of the
    conversation (that entry extended), each against an engine without a prefix cache."""
    model, tokenizer = request.getfixturevalue(served)
    prompt = tokenizer.encode(" ".join(PROMPTS))
    engine = _engine(model, bits, prefix_cache_min_tokens=8)
    try:
        (first, finished), = asyncio.run(_collect(engine, [_request("first", prompt)]))
        store = engine.core.reuse.cache._store  # the entries themselves are checked
        snapshots = [store.get(entry) for entry in list(store._snapshots)]
        assert snapshots and all(cls is QuantizedLayer for s in snapshots for cls, _, _ in s.layers)
        (again, hit), = asyncio.run(_collect(engine, [_request("again", prompt)]))
        turn = prompt + first[:-1] + tokenizer.encode(" And then?")
        (next_turn, extended), = asyncio.run(_collect(engine, [_request("turn", turn)]))
    finally:
        engine.stop()
    cold = _engine(model, bits, prefix_cache_bytes=0)
    try:
        (missed, miss), (turn_missed, _) = asyncio.run(_collect(cold, [_request("cold", prompt),
                                                                       _request("cold-turn", turn)]))
    finally:
        cold.stop()
    assert miss.num_cached_tokens == 0 and finished.num_cached_tokens == 0
    assert hit.cache_hit in ("exact", "longer") and hit.num_cached_tokens == len(prompt) - 1
    assert extended.num_cached_tokens == len(prompt) + len(first) - 1  # all the finished row held
    assert again == first == missed
    assert next_turn == turn_missed


def _request(tag: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(request_id=tag, prompt=prompt, max_tokens=12, sampling=GREEDY)


def test_speculative_rows_roll_back_quantized_keys_to_plain_decoding(reference, tiny_models_root):
    """An unrelated drafter: acceptance differs row to row, so each verify step rolls rows back by different
    lengths (the batched quantized cache's right padding rolled to the left)."""
    model, tokenizer = reference
    drafter_model, _ = load(str(tiny_model_cached(tiny_models_root, "llama", seed=7)))
    plain = _engine(model, 8, prefix_cache_bytes=0)
    try:
        expected = [asyncio.run(_collect(plain, [r]))[0][0] for r in _requests(tokenizer, "plain")]
    finally:
        plain.stop()
    engine = _engine(model, 8, DraftModelDrafter(drafter_model), prefix_cache_bytes=0)
    try:
        mode = Speculative(drafter="draft_model", k=3, adaptive=False)
        results = asyncio.run(_collect(engine, _requests(tokenizer, "spec", decode=mode)))
    finally:
        engine.stop()
    assert [tokens for tokens, _ in results] == expected
    accepted = [finished.decode["accepted"] for _, finished in results]
    drafted = [finished.decode["drafted"] for _, finished in results]
    assert sum(drafted) > 0 and sum(accepted) < sum(drafted)


# ---- bytes per token ----

@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_per_token_measured_on_real_caches_are_what_the_bits_make_of_16(reference, bits):
    """The model in float16: 16-bit keys and values against ``bits``-bit ones, each group of 32 features with a
    float16 scale and bias. Bytes are read from a filled cache's snapshot (its arrays, as stored), per token."""
    model, _ = reference
    half = type(model)(model.args)
    half.update(model.parameters())
    half.set_dtype(mx.float16)
    num_tokens = 256  # one allocation step: mlx-lm's KVCache state holds its whole allocated buffer

    def measured(kv: KVQuantization | None) -> float:
        cache = make_request_cache(half, 0, kv)
        mx.eval(half(mx.array([[1 + i % 50 for i in range(num_tokens)]]), cache=cache))
        return take_snapshot(cache).num_bytes / num_tokens

    plain, quantized = measured(None), measured(KVQuantization(bits, GROUP))
    head = HEADS_OF_32["head_dim"]
    per_head_16 = head * 2
    per_head_q = head * bits // 8 + 2 * (head // GROUP) * 2  # packed features + a float16 scale and bias per group
    layers_heads = len(half.layers) * HEADS_OF_32["num_key_value_heads"] * 2  # keys and values
    assert plain == layers_heads * per_head_16
    assert quantized == layers_heads * per_head_q
    assert quantized / plain == pytest.approx({8: 0.5625, 4: 0.3125}[bits])
    # Memory admission counts the same bytes per token (allocated in steps of 256 tokens).
    assert measure_kv_cost(half, kv=KVQuantization(bits, GROUP)).num_bytes_per_token == quantized


# ---- what is refused, and why ----

def _config(tmp_path: Path, engine: str) -> Path:
    path = tmp_path / "mlxd.toml"
    path.write_text(f'[model]\nsource = "embedded:smollm2-135m"\n\n[engine]\n{engine}\n')
    return path


def test_kv_bits_with_a_rotating_cache_is_a_config_error_naming_both_fields(tmp_path):
    path = _config(tmp_path, "kv_bits = 8\nmax_kv_size = 512")
    with pytest.raises(ConfigError, match=r"mlxd\.toml: engine: kv_bits = 8 cannot be used with max_kv_size = 512"):
        load_config(path)


@pytest.mark.parametrize(("line", "field"), [("kv_bits = 6", "engine.kv_bits"),
                                             ("kv_bits = 16", "engine.kv_bits"),
                                             ("kv_group_size = 48", "engine.kv_group_size")])
def test_values_outside_the_choices_name_the_file_and_field(tmp_path, line, field):
    with pytest.raises(ConfigError, match=rf"mlxd\.toml: {field}: Invalid enum value"):
        load_config(_config(tmp_path, line))


def test_a_group_size_that_does_not_divide_the_heads_is_refused_at_start_up(tiny_model_dir):
    model, _ = load(str(tiny_model_dir))  # heads of 16 features
    with pytest.raises(ConfigError, match=r"kv_bits = 8, kv_group_size = 32: .*cannot run on quantized keys"):
        measure_memory(model, kv=KVQuantization(8, 32))


def test_a_device_without_quantized_attention_for_the_setting_is_refused_naming_what_works(reference):
    """MLX's CUDA backend lacks some quantized_matmul kernels (8 bits in groups of 64 over bfloat16 heads of 128, on
    an H200): the start-up probe's failure, injected here through the attention it calls, is a config error naming
    the device, MLX's message and the settings that do run."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    model, _ = reference

    def without_eight_bits(*args: Any, bits: int, **kw: Any) -> mx.array:
        if bits == 8:
            raise RuntimeError("[quantized_matmul] No implementation for problem shape")
        return quantized_scaled_dot_product_attention(*args, bits=bits, **kw)

    kv = KVQuantization(8, 32)
    with pytest.raises(ConfigError, match=r"kv_bits = 8, kv_group_size = 32: Device\(cpu, 0\) has no quantized "
                       r"attention for heads of 32 in mlx.core.float32 \(\[quantized_matmul\] No implementation.*\); "
                       r"what works here: kv_bits = 4, kv_group_size = 32$"):
        check_quantized_attention(model, lambda: make_request_cache(model, 0, kv), kv, without_eight_bits)
    check_quantized_attention(model, lambda: make_request_cache(model, 0, kv), kv)  # the real one runs here


def test_mlx_cuda_backend_is_refused_before_any_probe(reference):
    """On MLX's CUDA backend quantized_matmul has no kernel for some prompt shapes (an H200: a 128-token pass over
    128 keys at 8 bits, groups of 32 and of 64), which a start-up probe cannot cover: kv_bits is a config error there,
    naming the setting and the reason; on the CPU (this machine) the same check passes."""
    model, _ = reference
    kv = KVQuantization(8, 32)
    with pytest.raises(ConfigError, match=r"kv_bits = 8, kv_group_size = 32: refused on MLX's CUDA backend: .*"
                       r"No implementation for problem shape.*unset kv_bits$"):
        check_quantized_attention(model, lambda: make_request_cache(model, 0, kv), kv, cuda=lambda: True)
    check_quantized_attention(model, lambda: make_request_cache(model, 0, kv), kv, cuda=lambda: False)


class _SlidingWindowModel:
    """A model whose cache has a sliding-window layer (as Gemma's and Mistral's local-attention layers do)."""

    layers = [None]

    def make_cache(self) -> list[Any]:
        return [RotatingKVCache(max_size=64)]


def test_sliding_window_layers_are_refused_naming_the_layer():
    with pytest.raises(ConfigError, match=r"kv_bits = 4: .*RotatingKVCache layers have no quantized form"):
        make_request_cache(_SlidingWindowModel(), 0, KVQuantization(4, 64))


def test_a_vision_language_model_is_refused_with_the_reason(tiny_vlm):
    from mlxd.config.schema import ModelConfig
    from mlxd.models.load import load as load_served

    loaded = load_served(ModelConfig(source=str(tiny_vlm("qwen2_5_vl"))))
    with pytest.raises(ConfigError, match="vision-language models are refused"):
        measure_memory(loaded.model, kv=KVQuantization(8, 32))


def test_hybrid_rows_keep_their_recurrent_state_and_quantize_their_attention(tiny_models_root):
    model, tokenizer = load(str(tiny_model_cached(tiny_models_root, "qwen3_next", **HEADS_OF_32)))
    kv = KVQuantization(8, GROUP)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    alone = [_solo(model, p, kv, 8) for p in prompts]
    batch, out = DecodeBatch(model), {}
    for i, prompt in enumerate(prompts):
        row = Row.for_request(f"h{i}", GREEDY, model, 0, kv=kv)
        batch.add(row, process_prompt(model, row, prompt, last=True))
        out[f"h{i}"] = []
    assert {type(layer).__name__ for layer in batch.cache} == {"ArraysCache", BatchQuantizedKVCache.__name__}
    while batch.rows:
        for request_id, tokens in zip(batch.request_ids, batch.step(), strict=True):
            out[request_id] += tokens
        batch.remove({r for r in batch.request_ids if len(out[r]) >= 8})
    assert [out[f"h{i}"][:8] for i in range(4)] == alone
    # A snapshot of a row's state (recurrent layers as they are, attention quantized) continues like a cold row.
    prefix_cache = PrefixCache(budget_bytes=1 << 26)
    row = Row.for_request("start", GREEDY, model, 0, kv=kv)
    process_prompt(model, row, prompts[3][:-2], last=False)
    assert prefix_cache.insert(prompts[3][:-2], row.cache)
    hit = prefix_cache.lookup(prompts[3])
    assert hit.num_cached == len(prompts[3]) - 2
    assert {type(layer) for layer in hit.cache} == {ArraysCache, QuantizedLayer}
    row = Row.for_request("hit", GREEDY, model, 0, hit.cache)
    batch = DecodeBatch(model)
    batch.add(row, process_prompt(model, row, prompts[3][-2:], last=True))
    assert sum((batch.step()[0] for _ in range(8)), []) == alone[3]
