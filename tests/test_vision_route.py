"""The engine takes the path the ``route`` stage chose, and only that one: a request routed ``text`` never touches
the vision tower (on a vision model too, and even when it carries images: the pipeline refuses that contradiction
before the engine sees it), one routed ``vision`` has its images encoded and merged into its prompt. The vision
tower is called from one method, the vision prefill's ``encode``."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from mlxd.config.schema import EngineConfig, ModelConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, Media
from mlxd.engine.engine import BatchedEngine
from mlxd.errors import PipelineError
from mlxd.models.load import load
from mlxd.pipeline.job import Job
from tests.test_batched_engine import collect_tokens
from tests.test_pipeline_order import _warm
from tests.test_vision_engine import Prompts, loaded_model

ROOT = Path(__file__).resolve().parent.parent


def routed(request_id: str, prompt: list[int], media: Media | None, route: str) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt=prompt, max_tokens=8, media=media, route=route)


def test_each_request_takes_the_path_its_route_gave(tiny_vlm):
    loaded = loaded_model(tiny_vlm("qwen2_5_vl"), counting=True)
    model, prompts = loaded.model, Prompts(loaded)
    text_prompt, _ = prompts("A question without a picture.")
    image_prompt, media = prompts("Describe this picture.", 21)
    engine = BatchedEngine(model, EngineConfig(max_running=4, prefix_cache_bytes=0, warmup_tokens=1))
    engine.start()
    try:
        model.image_passes.clear()
        text = asyncio.run(collect_tokens(engine, routed("text", text_prompt, None, "text")))
        assert (model.num_vision_calls, model.image_passes) == (0, [])  # no tower, no pass with image embeddings

        vision = asyncio.run(collect_tokens(engine, routed("vision", image_prompt, media, "vision")))
        assert (model.num_vision_calls, model.image_passes) == (1, [1])  # its image encoded and merged

        # The same token ids and images routed "text" (the pipeline refuses this; here it goes straight to the
        # engine): the engine follows the route, not the images it finds on the request.
        as_text = asyncio.run(collect_tokens(engine, routed("as-text", image_prompt, media, "text")))
        bare = asyncio.run(collect_tokens(engine, routed("bare", image_prompt, None, "text")))
        assert (model.num_vision_calls, model.image_passes) == (1, [1])
    finally:
        engine.stop()
    assert len(text) == len(vision) == 8
    assert as_text == bare  # the images were not merged: exactly the text path's output
    assert as_text != vision  # and that path's output differs from the vision path's: the comparison can fail


def test_a_vision_route_on_a_model_without_a_vision_prefill_is_refused(tiny_vlm):
    path = tiny_vlm("qwen2_5_vl")
    prompt, media = Prompts(loaded_model(path))("Describe this picture.", 22)
    text = load(ModelConfig(source=str(path), kind="text"))  # its language model only
    engine = BatchedEngine(text.model, EngineConfig(max_running=2, warmup_tokens=1))
    engine.start()

    async def ends(request: EngineRequest):
        async for event in engine.submit(request).events():
            if isinstance(event, Finished | Failed):
                return event
        return None

    try:
        refused = asyncio.run(ends(routed("v", prompt, media, "vision")))
        served = asyncio.run(ends(routed("t", prompt, None, "text")))
    finally:
        engine.stop()
    assert isinstance(refused, Failed) and refused.message == "this model does not accept images"
    assert isinstance(served, Finished) and served.reason == "length"


MEDIA = Media(digests=("ef" * 32,), spans=((1, 3),), inputs={})


@pytest.mark.parametrize(("route", "media", "error"), [
    ("vision", None, "'vision' was chosen for a request without images"),
    ("text", MEDIA, "'text' was chosen for a request with images"),
    ("mtp", None, "'mtp' is not one the engine runs; it runs 'text' and 'vision'"),
    ("", None, "'' is not one the engine runs"),
])
def test_a_route_that_contradicts_the_request_is_refused_at_the_pipeline(route, media, error):
    prefill, decode = _warm("prefill"), _warm("decode")
    job = Job(request_id="x", model="m", prompt_ids=[1, 2, 3], route=route, media=media)
    prefill.prepare(job)
    with pytest.raises(PipelineError, match=error):
        decode.prepare(job)
    assert job.engine_request is None


def _tower_callers(*, wrappers: bool = False) -> set[str]:
    """Every function in the package that calls a model's ``encode`` or ``encode_many``, or the mlx-vlm tower
    itself; the model wrappers (``mlxd/models``, which implement those entries) only with ``wrappers``."""
    callers = set()
    for path in (ROOT / "mlxd").rglob("*.py"):
        if path.parent.name == "models" and not wrappers:
            continue
        tree = ast.parse(path.read_text())
        for scope in ast.walk(tree):
            if not isinstance(scope, ast.ClassDef | ast.Module):
                continue
            for function in [n for n in scope.body if isinstance(n, ast.FunctionDef)]:
                for node in ast.walk(function):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                            node.func.attr == "vision_tower" or (
                                node.func.attr in ("encode", "encode_many")
                                and ast.unparse(node.func.value).endswith("model"))):
                        owner = f"{scope.name}." if isinstance(scope, ast.ClassDef) else ""
                        callers.add(f"{path.relative_to(ROOT)}:{owner}{function.name}")
    return callers


def test_the_vision_tower_is_called_from_one_method():
    assert _tower_callers() == {"mlxd/engine/step/vision.py:VisionPrefill.encode"}
    # The scan sees a tower call where there is one: the wrapper's own entry calls mlx-vlm's tower.
    assert "mlxd/models/vlm.py:VisionLanguageModel.encode" in _tower_callers(wrappers=True)
