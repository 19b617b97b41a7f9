"""Vision rows in the batching engine, against oracles: mlx-vlm's own embedding of the images, each request run
alone, the prompt run unchunked, and the language model loaded as a text model."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxd.config.schema import EngineConfig, ModelConfig
from mlxd.engine.base import EngineRequest, SamplingParams
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.step.row import Row
from mlxd.engine.step.vision import VisionPrefill
from mlxd.media.images import decode_image
from mlxd.models.load import load
from mlxd.models.vlm import VisionLanguageModel
from mlxd.pipeline.images import ImageInputs
from tests.test_batched_engine import collect_tokens
from tests.vision_helpers import png

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3"]


class CountingVLM(VisionLanguageModel):
    """The real model, recording each forward pass: its batch size and length; a gate can hold the engine."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.calls: list[tuple[int, int]] = []
        self.image_passes: list[int] = []  # the batch size of each pass that ran image embeddings
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        self.gate.wait()
        self.calls.append(tuple(inputs.shape))
        if kwargs.get("embeds") is not None:
            self.image_passes.append(inputs.shape[0])
        return super().__call__(inputs, cache, **kwargs)


class Prompts:
    """Token ids (and media) of chat prompts for one loaded vision model, as the template stage makes them."""

    def __init__(self, loaded: Any) -> None:
        self.tokenizer = loaded.tokenizer
        self.images = ImageInputs(loaded.processor, loaded.model.image_token_id)

    def __call__(self, text: str, *seeds: int, before: str = "") -> tuple[list[int], Any]:
        parts = [{"type": "text", "text": before}] if before else []
        parts += [{"type": "image"} for _ in seeds] + [{"type": "text", "text": text}]
        content = parts if seeds else before + text
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
        if not seeds:
            return self.tokenizer.encode(rendered, add_special_tokens=False), None
        decoded = [decode_image(png(s), max_pixels=1 << 20, param="test") for s in seeds]
        return self.images.process(rendered, decoded)


def loaded_model(path, counting: bool = False):
    loaded = load(ModelConfig(source=str(path)))
    if counting:
        twin = loaded.model.text_twin
        loaded.model = CountingVLM(loaded.model.vlm)
        loaded.model.attach_text_twin(twin)
    return loaded


def request(request_id: str, prompt: list[int], media: Any, max_tokens: int = 10) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt=prompt, max_tokens=max_tokens, media=media,
                         route="text" if media is None else "vision", prefill_chunk=512)


def last_logits(model: VisionLanguageModel, prompt: list[int], media: Any, chunk: int) -> mx.array:
    """The last position's logits after running the prompt in chunks of ``chunk`` tokens into a fresh cache."""
    row = Row.for_request("probe", SamplingParams(), model, 0)
    if media is not None:
        row.vision = VisionPrefill(model, 0).prepare(request("probe", prompt, media))
    logits = None
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        ids = mx.array(prompt[start:end], dtype=mx.uint32)[None]
        logits = model(ids, cache=row.cache, **row.prompt_inputs(start, end))[:, -1, :]
        mx.eval(logits)
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_embeddings_equal_mlx_vlm_own(family, tiny_vlm):
    """Features from the per-image path (the one the feature cache keeps) merge into exactly what mlx-vlm's
    get_input_embeddings gives for the same images, and different images give different logits."""
    loaded = loaded_model(tiny_vlm(family))
    model, prompts = loaded.model, Prompts(loaded)
    prompt, media = prompts("Compare these.", 1, 2)
    ours = VisionPrefill(model, 1 << 26).prepare(request("a", prompt, media))
    ids = mx.array(prompt)[None]
    inputs = {k: mx.array(v) for k, v in media.inputs.items()}
    extra = {k: v for k, v in inputs.items() if k != "pixel_values"}
    theirs = model.vlm.get_input_embeddings(ids, inputs["pixel_values"], mask=mx.ones_like(ids), **extra)
    assert np.allclose(np.array(ours.embeds), np.array(theirs.inputs_embeds), atol=1e-5)
    if theirs.deepstack_visual_embeds is not None:
        for mine, reference in zip(ours.extras["deepstack_visual_embeds"], theirs.deepstack_visual_embeds,
                                   strict=True):
            assert np.allclose(np.array(mine), np.array(reference), atol=1e-5)

    one = last_logits(model, *prompts("What is it?", 1), chunk=4096)
    other = last_logits(model, *prompts("What is it?", 2), chunk=4096)
    assert float(mx.abs(one - other).max()) > 1e-3


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_chunked_prompt_with_an_image_in_the_middle_equals_unchunked(family, tiny_vlm):
    loaded = loaded_model(tiny_vlm(family))
    prompt, media = Prompts(loaded)("and that was all of it.", 3, before="Here is a long preamble. " * 4)
    start, end = media.spans[0]
    assert 8 < start and end < len(prompt) - 4  # the image sits in the middle
    whole = last_logits(loaded.model, prompt, media, chunk=4096)
    for chunk in (7, 16):  # chunks that cut through the image's placeholders
        chunked = np.array(last_logits(loaded.model, prompt, media, chunk=chunk))
        # float32 sums in another order (a BLAS library picks its own): 1e-5 of the largest logit
        np.testing.assert_allclose(chunked, np.array(whole), rtol=0, atol=1e-5 * float(np.abs(whole).max()) + 1e-5,
                                   err_msg=f"chunk {chunk}")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "qwen3_vl"])
def test_image_and_text_rows_decode_together_and_equal_solo_runs(family, tiny_vlm):
    loaded = loaded_model(tiny_vlm(family), counting=True)
    model, prompts = loaded.model, Prompts(loaded)
    jobs = [prompts(f"Picture {i}: describe it{' in detail' * i}.", 10 + i) for i in range(4)]  # lengths differ
    jobs += [prompts(f"Text question number {i}, answer it.") for i in range(4)]
    config = EngineConfig(max_running=8, prefix_cache_bytes=0, warmup_tokens=1)
    engine = BatchedEngine(model, config)
    engine.start()
    try:
        solo = [asyncio.run(collect_tokens(engine, request(f"solo-{i}", p, m))) for i, (p, m) in enumerate(jobs)]

        async def together():
            model.gate.clear()
            tasks = [asyncio.create_task(collect_tokens(engine, request(f"mix-{i}", p, m)))
                     for i, (p, m) in enumerate(jobs)]
            await asyncio.sleep(0.1)
            model.calls.clear()
            model.image_passes.clear()
            model.gate.set()
            return await asyncio.gather(*tasks)

        mixed = asyncio.run(together())
    finally:
        engine.stop()
    assert mixed == solo
    assert all(len(tokens) == 10 for tokens in solo)
    # Image rows and text rows advanced in the same forward passes: decode steps of all eight rows.
    assert sum(1 for batch, length in model.calls if batch == 8 and length == 1) >= 5
    # The Qwen-VL image prompts shared one pass (right-padded, each with its own positions); Gemma 3's sliding
    # window layers keep its prompts one a pass.
    assert model.image_passes == ([1, 1, 1, 1] if family == "gemma3" else [4])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_images_of_requests_sent_together_share_one_tower_pass(family, tiny_vlm):
    loaded = loaded_model(tiny_vlm(family), counting=True)
    model, prompts = loaded.model, Prompts(loaded)
    jobs = [prompts(f"Picture {i}: describe it.", 30 + i) for i in range(4)]
    engine = BatchedEngine(model, EngineConfig(max_running=8, prefix_cache_bytes=0, warmup_tokens=1))
    engine.start()
    try:
        solo = [asyncio.run(collect_tokens(engine, request(f"solo-{i}", p, m))) for i, (p, m) in enumerate(jobs)]
        assert model.num_tower_passes == 4
        engine.vision.features.clear()  # the engine is idle: the images are new to it again

        async def together():
            return await asyncio.gather(*[collect_tokens(engine, request(f"mix-{i}", p, m))
                                          for i, (p, m) in enumerate(jobs)])

        together_tokens = asyncio.run(together())
    finally:
        engine.stop()
    assert together_tokens == solo
    assert model.num_vision_calls == 8  # one run per image encoded, counted as before
    assert model.num_tower_passes == 5  # the four images sent together went through the tower in one pass


def test_a_text_load_of_a_vision_checkpoint_serves_its_language_model(tiny_vlm):
    path = tiny_vlm("qwen3_vl")
    vision = loaded_model(path)
    text = load(ModelConfig(source=str(path), kind="text"))
    assert text.kind == "text" and not isinstance(text.model, VisionLanguageModel)
    prompt, _ = Prompts(vision)("Tell me a story about the sea.")
    config = EngineConfig(max_running=2, warmup_tokens=1)
    outputs = []
    for model in (vision.model, text.model):
        engine = BatchedEngine(model, config)
        engine.start()
        try:
            outputs.append(asyncio.run(collect_tokens(engine, request("t", prompt, None, max_tokens=16))))
        finally:
            engine.stop()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 16


def test_a_text_load_holds_the_language_weights_only(tiny_vlm):
    from mlx.utils import tree_flatten

    path = tiny_vlm("qwen3_vl")
    vision = loaded_model(path)
    language_bytes = sum(v.nbytes for _, v in tree_flatten(vision.model.vlm.language_model.parameters()))
    all_bytes = sum(v.nbytes for _, v in tree_flatten(vision.model.parameters()))
    del vision
    mx.clear_cache()
    before = mx.get_active_memory()
    text = load(ModelConfig(source=str(path), kind="text"))
    held = mx.get_active_memory() - before
    assert held <= language_bytes * 1.02 < all_bytes, (held, language_bytes, all_bytes)
    assert sum(v.nbytes for _, v in tree_flatten(text.model.parameters())) == language_bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_preparing_images_never_switches_the_process_wide_mlx_device(family, tiny_vlm, monkeypatch):
    # MLX's default device is global: a worker thread that entered mx.stream(mx.cpu) while the engine thread built a
    # step sent the step to the CPU (on a GPU, concurrent image requests seemed to hang).
    prompts = Prompts(loaded_model(tiny_vlm(family)))
    switches = []
    for name in ("stream", "set_default_device", "set_default_stream"):
        real = getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda *a, _real=real, _name=name, **k: switches.append(_name) or _real(*a, **k))
    ids, media = prompts("What is in this picture?", 3)
    assert media.spans and len(ids) > media.spans[0][1]
    assert switches == []


def test_a_request_routed_vision_has_its_images_encoded_on_the_encoder_thread(tiny_vlm):
    """The engine acts on the route decision the request carries: ``vision`` holds the request until the encoder
    thread has its images' features (one job), and the output is that of in-step encoding."""
    loaded = loaded_model(tiny_vlm("qwen2_5_vl"))
    prompt, media = Prompts(loaded)("Picture: describe it.", 41)
    outputs, jobs = [], []
    for thread in (False, True):
        config = EngineConfig(max_running=2, prefix_cache_bytes=0, warmup_tokens=1, vision_encoder_thread=thread)
        engine = BatchedEngine(loaded.model, config)
        engine.start()
        try:
            outputs.append(asyncio.run(collect_tokens(engine, request("v", prompt, media))))
            encoder = engine.vision.encoder
            jobs.append(encoder.num_jobs if encoder is not None else None)
        finally:
            engine.stop()
    assert jobs == [None, 1]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 10
