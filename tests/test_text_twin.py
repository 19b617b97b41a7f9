"""The text twin of a vision model (mlx-lm's text model on the vision model's own language weights): it shares the
arrays, it decodes after an image exactly as mlx-vlm's language model does, and token-only passes go through it."""

from __future__ import annotations

import asyncio
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import SamplingParams
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.schedule.memory import weights_bytes
from mlxd.engine.step.prompts import can_batch_prompts
from mlxd.engine.step.row import Row
from mlxd.engine.step.vision import VisionPrefill
from tests.test_batched_engine import collect_tokens
from tests.test_vision_engine import Prompts, loaded_model, request

TWIN_FAMILIES = ["qwen2_5_vl", "qwen3_vl"]


class CountingTwin:
    """The twin, recording the shape of every call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.calls.append(tuple(inputs.shape))
        return self.inner(inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("family", TWIN_FAMILIES)
def test_the_twin_shares_the_language_weights(family, tiny_vlm):
    model = loaded_model(tiny_vlm(family)).model
    assert model.has_text_twin
    language = {id(a) for _, a in tree_flatten(model.language_model.parameters())}
    twin = [a for _, a in tree_flatten(model.text_twin.parameters())]
    assert twin and all(id(a) in language for a in twin)  # the same arrays, not copies
    # Counted once: the weights the memory budget sees are the vision model's alone.
    assert weights_bytes(model) == sum(a.nbytes for _, a in tree_flatten(model.vlm.parameters()))


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_families_without_a_twin_keep_mlx_vlm_forward(family, tiny_vlm):
    assert not loaded_model(tiny_vlm(family)).model.has_text_twin


@pytest.mark.parametrize("family", TWIN_FAMILIES)
def test_decoding_after_an_image_through_the_twin_equals_mlx_vlm(family, tiny_vlm):
    loaded = loaded_model(tiny_vlm(family))
    model = loaded.model
    prompt, media = Prompts(loaded)("What is in the picture?", 4)
    caches = []
    for name in ("twin", "vlm"):
        row = Row.for_request(name, SamplingParams(), model, 0)
        row.vision = VisionPrefill(model, 0).prepare(request(name, prompt, media))
        mx.eval(model(mx.array(prompt)[None], cache=row.cache, **row.prompt_inputs(0, len(prompt))))
        caches.append(row.cache)
    delta = row.rope_delta
    assert delta != 0  # the image's positions run behind its tokens: the shift matters
    deltas = mx.array([[delta]], dtype=mx.int32)
    for token in (11, 23, 5):
        ids = mx.array([[token]])
        ours = model(ids, cache=caches[0], rope_deltas=deltas)
        theirs = model.language_model(ids, cache=caches[1], rope_deltas=deltas).logits
        assert np.allclose(np.array(ours), np.array(theirs), atol=1e-4)
    # Without the shift the twin would be wrong: the comparison can fail.
    unshifted = model.text_twin(mx.array([[7]]), cache=caches[0])
    reference = model.language_model(mx.array([[7]]), cache=caches[1], rope_deltas=deltas).logits
    assert not np.allclose(np.array(unshifted), np.array(reference), atol=1e-4)


@pytest.mark.parametrize("family", TWIN_FAMILIES)
def test_token_only_passes_run_through_the_twin(family, tiny_vlm):
    loaded = loaded_model(tiny_vlm(family))
    model, prompts = loaded.model, Prompts(loaded)
    twin = CountingTwin(model.text_twin)
    model.attach_text_twin(twin)
    engine = BatchedEngine(model, EngineConfig(max_running=4, prefix_cache_bytes=0, warmup_tokens=1))
    engine.start()
    try:
        twin.calls.clear()
        text, _ = prompts("A question in words only.")
        tokens = asyncio.run(collect_tokens(engine, request("t", text, None, max_tokens=6)))
        assert len(tokens) == 6
        # The prompt and every decode step: nothing through mlx-vlm's language model.
        assert twin.calls[0] == (1, len(text))
        assert len(twin.calls) >= 6 and set(twin.calls[1:]) == {(1, 1)}
        twin.calls.clear()
        image, media = prompts("Describe it.", 3)
        asyncio.run(collect_tokens(engine, request("i", image, media, max_tokens=6)))
        # The image prompt runs through mlx-vlm (its embeddings); its decode steps through the twin.
        assert len(twin.calls) >= 5 and set(twin.calls) == {(1, 1)}
    finally:
        engine.stop()


def test_text_prompts_on_a_vision_model_batch_together(tiny_vlm):
    model = loaded_model(tiny_vlm("qwen2_5_vl")).model
    rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(3)]
    assert can_batch_prompts(rows)
