"""Images encoded on the encoder thread while the engine steps: rows already decoding never wait for the vision
tower, a request waiting for its images is admitted once they are in (with the output of a solo run), and an
encoding that fails or a request cancelled while it waits ends no other request."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import Failed, Finished, Token
from mlxd.engine.engine import BatchedEngine
from mlxd.models.vlm import VisionLanguageModel
from tests.test_batched_engine import collect_tokens
from tests.test_vision_engine import Prompts, loaded_model, request


class GatedTower(VisionLanguageModel):
    """The real model, whose vision-tower calls wait for ``gate`` and raise while ``failures`` is above 0."""

    def __init__(self, model: VisionLanguageModel) -> None:
        super().__init__(model.vlm)
        self.attach_text_twin(model.text_twin)
        self.gate = threading.Event()
        self.gate.set()
        self.failures = 0
        self.encoder_threads: set[str] = set()

    def encode(self, image: dict[str, Any], num_tokens: int, num_images: int = 1) -> Any:
        self.encoder_threads.add(threading.current_thread().name)
        assert self.gate.wait(60)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the tower broke")
        return super().encode(image, num_tokens, num_images)


@pytest.fixture
def gated(tiny_vlm):
    loaded = loaded_model(tiny_vlm("qwen2_5_vl"))
    model = GatedTower(loaded.model)
    engine = BatchedEngine(model, EngineConfig(max_running=8, prefix_cache_bytes=0, warmup_tokens=1,
                                               vision_encoder_thread=True))
    engine.start()
    yield engine, model, Prompts(loaded)
    engine.stop()


async def events_of(engine: BatchedEngine, req: Any) -> tuple[list[int], Any]:
    tokens, end = [], None
    async for event in engine.submit(req).events():
        if isinstance(event, Token):
            tokens.append(event.token)
        elif isinstance(event, Finished | Failed):
            end = event
            break
    return tokens, end


def test_text_requests_decode_while_an_image_is_encoded(gated):
    engine, model, prompts = gated
    image_job, text_job = prompts("Describe this picture.", 5), prompts("A question without a picture.")
    solo_image = asyncio.run(collect_tokens(engine, request("solo-image", *image_job, max_tokens=12)))
    solo_text = asyncio.run(collect_tokens(engine, request("solo-text", *text_job, max_tokens=12)))
    engine.vision.features.clear()

    async def together():
        model.gate.clear()
        image = asyncio.create_task(collect_tokens(engine, request("image", *image_job, max_tokens=12)))
        text = await asyncio.wait_for(collect_tokens(engine, request("text", *text_job, max_tokens=12)), 60)
        # The whole text request ran while the tower was held: the image request is still waiting, shown so.
        assert not image.done()
        [held] = engine.status()["waiting"]
        assert held["request_id"] == "image" and held["phase"] == "encoding"
        assert engine.status()["vision"]["num_held_requests"] == 1
        model.gate.set()
        return await asyncio.wait_for(image, 60), text

    image_tokens, text_tokens = asyncio.run(together())
    assert (image_tokens, text_tokens) == (solo_image, solo_text)
    assert len(solo_image) == 12
    assert model.encoder_threads == {"mlxd-image-encoder"}  # never on the engine thread
    status = engine.status()["vision"]
    assert status["num_held_requests"] == 0 and status["encoder"]["num_images"] == 2


def test_an_image_request_whose_encoding_failed_encodes_its_image_when_it_starts(gated):
    engine, model, prompts = gated
    job = prompts("Describe this picture.", 6)
    solo = asyncio.run(collect_tokens(engine, request("solo", *job)))
    engine.vision.features.clear()
    model.failures = 1  # the encoder thread's call fails; the request's own call, as its prompt starts, does not
    assert asyncio.run(collect_tokens(engine, request("again", *job))) == solo


def test_an_image_that_cannot_be_encoded_fails_its_request_only(gated):
    engine, model, prompts = gated
    text_job = prompts("A question without a picture.")
    solo_text = asyncio.run(collect_tokens(engine, request("solo-text", *text_job)))
    model.failures = 2  # on the encoder thread, then when the request starts

    async def together():
        return await asyncio.gather(events_of(engine, request("image", *prompts("Describe this.", 7))),
                                    events_of(engine, request("text", *text_job)))

    (image_tokens, image_end), (text_tokens, text_end) = asyncio.run(together())
    assert image_tokens == [] and isinstance(image_end, Failed) and image_end.status == 500
    assert isinstance(text_end, Finished) and text_tokens == solo_text
    # The engine goes on serving images.
    assert len(asyncio.run(collect_tokens(engine, request("after", *prompts("Describe this.", 8))))) == 10


def test_a_request_cancelled_while_its_images_are_encoded_ends_alone(gated):
    engine, model, prompts = gated
    job = prompts("Describe this picture.", 9)

    async def cancelled():
        model.gate.clear()
        handle = engine.submit(request("gone", *job))
        while not engine.status()["waiting"] or engine.status()["waiting"][0]["phase"] != "encoding":
            await asyncio.sleep(0.01)
        handle.cancel()
        events = [event async for event in handle.events()]
        model.gate.set()
        return events

    events = asyncio.run(cancelled())
    assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"
    assert engine.status()["vision"]["num_held_requests"] == 0
    # The features the encoder finished for it are kept: the same image again costs no tower call.
    asyncio.run(asyncio.sleep(0.2))
    calls = model.num_vision_calls
    assert len(asyncio.run(collect_tokens(engine, request("again", *job)))) == 10
    assert model.num_vision_calls == calls


def test_a_new_image_after_a_cached_prefix_is_encoded_on_the_encoder_thread_too(tiny_vlm):
    loaded = loaded_model(tiny_vlm("qwen2_5_vl"))
    model, prompts = GatedTower(loaded.model), Prompts(loaded)
    engine = BatchedEngine(model, EngineConfig(max_running=8, warmup_tokens=1, vision_encoder_thread=True))
    engine.start()
    before = "Here is a long note about the pictures that follow. " * 8  # a shared prefix past the cache's minimum
    first, second = prompts("What is this?", 11, before=before), prompts("What is this?", 12, before=before)
    text_job = prompts("A question without a picture.")
    try:
        cold = asyncio.run(collect_tokens(engine, request("cold", *second)))
        engine.reuse.clear()
        engine.vision.features.clear()
        asyncio.run(collect_tokens(engine, request("first", *first)))  # its state is kept for later turns

        async def together():
            model.gate.clear()
            held = asyncio.create_task(events_of(engine, request("second", *second)))
            text = await asyncio.wait_for(collect_tokens(engine, request("text", *text_job)), 60)
            assert not held.done() and engine.status()["waiting"][0]["phase"] == "encoding"
            model.gate.set()
            return await asyncio.wait_for(held, 60), text

        (tokens, end), text = asyncio.run(together())
    finally:
        engine.stop()
    # It started from the cached state (up to where the images differ), with a cold run's output.
    assert isinstance(end, Finished) and end.num_cached_tokens >= 32
    assert tokens == cold and len(text) == 10
    assert model.encoder_threads == {"mlxd-image-encoder"}


@pytest.mark.parametrize("thread", [True, False])
def test_the_encoder_thread_is_a_setting_with_the_same_output(tiny_vlm, thread):
    loaded = loaded_model(tiny_vlm("qwen3_vl"))
    prompts = Prompts(loaded)
    jobs = [prompts(f"Picture {i}.", 40 + i) for i in range(3)] + [prompts("Just text.")]
    config = EngineConfig(max_running=8, prefix_cache_bytes=0, warmup_tokens=1, vision_encoder_thread=thread)
    engine = BatchedEngine(loaded.model, config)
    engine.start()
    try:
        solo = [asyncio.run(collect_tokens(engine, request(f"solo-{i}", *job))) for i, job in enumerate(jobs)]
        engine.vision.features.clear()

        async def together():
            return await asyncio.gather(*[collect_tokens(engine, request(f"mix-{i}", *job))
                                          for i, job in enumerate(jobs)])

        assert asyncio.run(together()) == solo
        encoder = engine.vision.status()["encoder"]
        assert (encoder is not None) == thread
        # Three tower calls for the solo runs; the three images sent together share a fourth, either way.
        assert loaded.model.num_tower_passes == 4
    finally:
        engine.stop()
