"""Forced tool calls on the embedded default model (SmolLM2-135M, a real model): a named ``tool_choice`` and
``required`` with ``parallel_tool_calls: false`` each give exactly one call, streamed and not, at temperature 1
over three seeds. Before the fix the named choice gave two calls at seed 0 (``get_weather`` for Paris, then for
Rome), streamed and not: the grammar allowed more than one call of the named function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.models.default_model import locate_default_gguf
from tests.helpers import free_port, serve_subprocess, sse_events

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 40}},
                                               "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 40}},
                                               "required": ["city"], "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is the weather and the time in Paris and in Rome?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    locate_default_gguf(download=False)  # fails (never skips) without the embedded model's wheel
    port = free_port()
    config = tmp_path_factory.mktemp("default-tools") / "default.toml"
    config.write_text((ROOT / "configs" / "default.toml").read_text())
    with serve_subprocess(config, port, timeout=300) as (base, _):
        yield base


def calls(base: str, stream: bool, seed: int, **body: Any) -> tuple[list[tuple[str, dict]], str]:
    """The calls (name, arguments) and the finish reason of one request, rebuilt from the stream if streamed."""
    payload = {"model": "smollm2-135m", "messages": QUESTION, "tools": TOOLS, "temperature": 1.0, "seed": seed,
               "max_tokens": 200, "stream": stream, **body}
    response = httpx.post(base + "/v1/chat/completions", json=payload, timeout=300)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in choice["message"].get("tool_calls") or []], choice["finish_reason"]
    parts: dict[int, list[str]] = {}
    finish = ""
    for frame in sse_events(response.text):
        if frame == "[DONE]" or not frame["choices"]:
            continue
        for call in frame["choices"][0]["delta"].get("tool_calls") or []:
            part = parts.setdefault(call["index"], ["", ""])
            part[0] += call["function"].get("name") or ""
            part[1] += call["function"].get("arguments") or ""
        finish = frame["choices"][0].get("finish_reason") or finish
    return [(name, json.loads(args)) for _, (name, args) in sorted(parts.items())], finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_gives_one_call(server: str, stream: bool) -> None:
    for seed in range(3):
        got, finish = calls(server, stream, seed, tool_choice=NAMED)
        assert finish == "tool_calls" and len(got) == 1, (seed, got)
        assert got[0][0] == "get_weather" and isinstance(got[0][1]["city"], str), (seed, got)


@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_calls_gives_one_call(server: str, stream: bool) -> None:
    for seed in range(3):
        got, finish = calls(server, stream, seed, tool_choice="required", parallel_tool_calls=False)
        assert finish == "tool_calls" and len(got) == 1, (seed, got)
        assert got[0][0] in ("get_weather", "get_time") and isinstance(got[0][1]["city"], str), (seed, got)
