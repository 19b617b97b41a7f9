"""Warm-up meets every batch shape serving uses (decode sizes 1..max_running, prompt groups 2..max_running, a full
and a partial chunk), then leaves nothing behind: MLX's buffer cache is empty, no array of its rows stays alive, and
a decode batch afterwards gives the greedy tokens a lone ``generate_step`` gives."""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import SamplingParams
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.prompts import process_prompt
from mlxd.engine.step.row import Row
from mlxd.engine.step.warmup import warm_up_shapes

MAX_RUNNING = 5
CHUNK = 32


class RecordingModel:
    """The real model, recording the (batch, length) of each forward pass."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        self.shapes.append(tuple(inputs.shape))
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.fixture(params=["llama", "qwen3_next"])
def model(request, tiny_model_dir, tiny_qwen3_next_dir):
    path = tiny_model_dir if request.param == "llama" else tiny_qwen3_next_dir
    return load(str(path))[0]


def test_warm_up_meets_every_batch_size_and_leaves_nothing_behind(model):
    config = EngineConfig(max_running=MAX_RUNNING, prefill_chunk=CHUNK, warmup_tokens=1)
    recording = RecordingModel(model)
    mx.eval(model(mx.array([[1, 2]]), cache=make_prompt_cache(model)))  # the model's one-time state (compiled
    gc.collect()  # functions' constants), and arrays only the cycle collector frees, would blur the measurement
    mx.clear_cache()
    active = mx.get_active_memory()

    warm_up_shapes(recording, config, every_shape=True)

    assert mx.get_cache_memory() == 0
    assert mx.get_active_memory() == active
    decode_sizes = {batch for batch, length in recording.shapes if length == 1}
    prompt_groups = {batch for batch, length in recording.shapes if batch > 1 and length > 1}
    assert decode_sizes == set(range(1, MAX_RUNNING + 1))
    assert prompt_groups == set(range(2, MAX_RUNNING + 1))
    assert (1, CHUNK) in recording.shapes
    # Every group decodes right after joining: alone (a batch of its own size), and beside one row below n.
    after_group = {
        (batch, recording.shapes[i + 1])
        for i, (batch, length) in enumerate(recording.shapes[:-1])
        if batch > 1 and length > 2
    }
    assert after_group == (
        {(size, (size, 1)) for size in range(2, MAX_RUNNING + 1)}
        | {(size, (size + 1, 1)) for size in range(2, MAX_RUNNING)}
    )
    # Rests of prompts continuing from cached states, together (attention-only models: their caches can merge).
    continued = {batch for batch, length in recording.shapes if batch > 1 and length == 2}
    attention_only = all(type(c) is KVCache for c in make_prompt_cache(model))
    assert continued == (set(range(2, MAX_RUNNING + 1)) if attention_only else set())

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    batch = DecodeBatch(model)
    for i, prompt in enumerate(prompts):
        row = Row.for_request(f"after-{i}", SamplingParams(), model, 0)
        batch.add(row, process_prompt(model, row, prompt, last=True))
    steps = [batch.step() for _ in range(6)]
    for i, prompt in enumerate(prompts):
        alone = [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=6)]
        assert emitted(steps, i) == alone


def emitted(steps: list[list[Any]], i: int) -> list[int]:
    """Row ``i``'s tokens over ``steps`` (a step returns the list of tokens each row emitted)."""
    tokens = []
    for step in steps:
        tokens += step[i]
    return tokens


def test_on_the_cpu_warm_up_runs_a_chunk_and_decode_batches_of_powers_of_two(model):
    """Nothing is built per shape on the CPU: the full set would cost minutes with a real model at start-up."""
    config = EngineConfig(max_running=MAX_RUNNING, prefill_chunk=CHUNK, warmup_tokens=1)
    recording = RecordingModel(model)
    warm_up_shapes(recording, config, every_shape=False)
    decode_sizes = {batch for batch, length in recording.shapes if length == 1}
    assert decode_sizes == {1, 2, 4, MAX_RUNNING} and (1, CHUNK) in recording.shapes
    assert not {batch for batch, length in recording.shapes if batch > 1 and length > 1}


def test_verify_warm_up_runs_every_batch_size_and_width_over_two_buckets(tiny_model_dir):
    from mlx_lm import load

    from mlxd.config.schema import EngineConfig, SpeculativeConfig
    from mlxd.engine.step.padded import BUCKET
    from mlxd.engine.step.warmup import VERIFY_BUCKETS, warm_up_verify

    model, _ = load(str(tiny_model_dir))
    config = EngineConfig(max_running=3, speculative=SpeculativeConfig(drafter="prompt_lookup", k=2))
    seen = []
    original = model.__call__

    class Spy:  # records the (batch, positions, filled keys) of every pass
        def __call__(self, inputs, cache=None, **kw):
            seen.append((inputs.shape[0], inputs.shape[1], getattr(cache[0], "offset", None)))
            return original(inputs, cache=cache, **kw)

        def __getattr__(self, name):
            return getattr(model, name)

    assert warm_up_verify(Spy(), config, force=True) == 3 * 2 * VERIFY_BUCKETS
    verify_passes = [(b, n) for b, n, _ in seen if n in (2, 3)]
    assert sorted(set(verify_passes)) == [(b, n) for b in (1, 2, 3) for n in (2, 3)]
    lone = [offset for b, n, offset in seen if b == 1 and n in (2, 3)]
    assert {-(-(o + 3) // BUCKET) for o in lone} == {1, 2}  # blocks end in the first and the second bucket
    assert warm_up_verify(model, config) == 0 or mx.cuda.is_available()  # only on CUDA unless forced
