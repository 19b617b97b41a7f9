"""The README's layout section draws a chat request's path from mlxd/pipelines/chat.toml through the files: every
`file.py:Name` it names exists, and each hop it draws is a call the code makes."""

from __future__ import annotations

import importlib
import inspect
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def layout_block() -> str:
    section = README.split("\n## Layout\n", 1)[1]
    return section.split("```\n", 2)[1]


def resolve(reference: str) -> object:
    path, _, name = reference.partition(":")
    module_path = path if path.startswith("mlxd/") else f"mlxd/{path}"
    assert (ROOT / module_path).is_file(), module_path
    target = importlib.import_module(module_path.removesuffix(".py").replace("/", "."))
    for part in name.split("."):
        target = getattr(target, part)
    return target


def source(reference: str) -> str:
    return inspect.getsource(resolve(reference))


def test_every_named_function_exists():
    references = re.findall(r"([\w/]+\.py):([\w.]+)", layout_block())
    assert len(references) >= 15
    for path, name in references:
        resolve(f"{path}:{name}")


def test_the_path_starts_at_the_chat_pipeline_with_its_stages_in_order():
    block = layout_block()
    stages = [table["type"] for table in tomllib.loads((ROOT / "mlxd/pipelines/chat.toml").read_text())["stages"]]
    drawn = re.findall(r"^  (\w+)\s+→", block, flags=re.MULTILINE)
    assert "mlxd/pipelines/chat.toml" in block and drawn == stages


# Each hop drawn, read in the code: the caller names the callee (the five places issue 38 asks a newcomer to reach
# from chat.toml in at most three hops: the stop cut, the tool-call parse, the 429, the prefix-cache lookup, and the
# vision tower: _accept hands a request routed vision to the vision prefill, whose encode is the tower's one call;
# tests/test_vision_route.py checks that no other function calls it).
@pytest.mark.parametrize(("caller", "calls"), [
    ("api/respond.py:prepare", [".prepare(job, flag, until)"]),
    ("model_slot.py:ModelSlot.prepare", ["raise Overloaded(", "self.pipeline.prepare"]),
    ("pipeline/stages/decode.py:Decode.stream", ["self.engine.submit("]),
    ("engine/engine.py:BatchedEngine.submit", ["raise Overloaded(", "Accept("]),
    ("engine/core.py:EngineCore.__init__", ["Accept: self._accept"]),
    ("engine/core.py:EngineCore._accept", ["self.reuse.lookup(", "if submitted.state.vision:", "._vision().hold("]),
    ("engine/schedule/scheduler.py:SequenceState.vision.fget", ['self.route == "vision"']),
    ("engine/step/vision.py:VisionPrefill.encode", ["self.model.encode_many(", "self.model.encode("]),
    ("pipeline/stages/detokenize.py:Detokenize.stream", ["StopCutter(", "cutter.feed("]),
    ("pipeline/stages/parse.py:Parse.stream", [".run(events)"]),
    ("pipeline/stages/parse.py:_Splitter.run", ["self.tools.feed("]),
    ("pipeline/stages/decode.py:Decode.prepare", ["EngineRequest(", "route=job.route", "plan.chunk_tokens"]),
])
def test_each_hop_is_a_call_the_code_makes(caller, calls):
    text = source(caller)
    for call in calls:
        assert call in text, f"{caller} no longer calls {call}"
