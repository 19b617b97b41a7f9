"""Replay what Claude Code and Codex really send against mlxd, checked against Anthropic's and OpenAI's published
response shapes.

The fixtures (``tests/fixtures``) were captured from Claude Code 2.1.197 and Codex 0.169.0 with
``tests/capture_server.py`` (whose docstring has the commands): two Claude Code turns of one conversation
(``claude -p`` then ``claude -p --continue``) and two Codex turns (``codex exec`` then ``codex exec resume
--last``). Each is replayed with its path, headers, ``max_tokens`` and ``stream`` as recorded.

Cost: with the tiny tokenizer Claude Code's request is ~43k tokens. The model is the tiny llama with one layer:
MLX then never computes the attention of a prompt chunk whose output nothing reads (only its keys and values
are kept), so prefill takes seconds where two layers take minutes on a CPU. Claude Code asks for
``max_tokens = 64000``, which a local context cannot hold: the answer is clamped to what the context leaves, so
the context is set just above the longest prompt, measured first on a calibration server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import free_port, serve_subprocess, sse_events, write_config

FIXTURES = Path(__file__).parent / "fixtures"
CALIBRATION_CONTEXT = 131072
CODEX_CONTEXT = 32768
# Completion tokens the longest prompt leaves: enough for a real answer, few enough to decode in a second.
ROOM = 64
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal",
                "model_context_window_exceeded"}
ENGINE = f"[engine]\nprefill_chunk = 2048\nmemory_limit_bytes = {4 * 1024**3}\n"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


CLAUDE_TURNS = [fixture("claude_code_turn1.json"), fixture("claude_code_turn2.json")]
# The billing-header line Claude Code sent in another recorded conversation (its hash differs). The recorded turns
# of one conversation carry the same line; turn 2 is replayed with this one, as a newer Claude Code (or another
# conversation) would send it, so that the cache hit shows that mlxd keeps the line out of the prompt.
OTHER_BILLING_LINE = "x-anthropic-billing-header: cc_version=2.1.197.a5a; cc_entrypoint=sdk-cli;"


def with_billing_line(turn: dict[str, Any], line: str) -> dict[str, Any]:
    system = [dict(block) for block in turn["body"]["system"]]
    assert system[0]["text"].startswith("x-anthropic-billing-header:") and system[0]["text"] != line
    system[0]["text"] = line
    return {**turn, "body": {**turn["body"], "system": system}}
CODEX_TURNS = [fixture("codex_responses.json"), fixture("codex_responses_turn2.json")]


@pytest.fixture(scope="module")
def one_layer_model(tiny_models_root: Path) -> Path:
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(tiny_models_root, "llama", num_layers=1)


def config(tmp: Path, model: Path, context_length: int) -> Path:
    return write_config(tmp, model, model_extra=f"context_length = {context_length}", extra=ENGINE)


def post(base: str, recorded: dict[str, Any], body: dict[str, Any] | None = None) -> httpx.Response:
    """POST a recorded request (its path with query, its headers) with ``body`` or the recorded one."""
    content = json.dumps(recorded["body"] if body is None else body)
    response = httpx.post(base + recorded["path"], headers=recorded["headers"], content=content, timeout=300)
    assert response.status_code == 200, f"{recorded['path']}: {response.status_code} {response.text[:2000]}"
    return response


def prompt_tokens(usage: dict[str, Any]) -> int:
    """Anthropic's prompt size: tokens read from the cache, written to it, and neither."""
    return sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))


@pytest.fixture(scope="module")
def context_length(one_layer_model: Path, tmp_path_factory: pytest.TempPathFactory) -> int:
    """The longest Claude Code prompt as mlxd renders it, plus ``ROOM``: measured with ``max_tokens = 1``."""
    tmp = tmp_path_factory.mktemp("calibrate")
    longest = 0
    with serve_subprocess(config(tmp, one_layer_model, CALIBRATION_CONTEXT), free_port()) as (base, _):
        for turn in CLAUDE_TURNS:
            answer = post(base, turn, {**turn["body"], "max_tokens": 1, "stream": False}).json()
            longest = max(longest, prompt_tokens(answer["usage"]))
    return longest + ROOM


@pytest.fixture(scope="module")
def claude_server(one_layer_model: Path, context_length: int, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("claude")
    with serve_subprocess(config(tmp, one_layer_model, context_length), free_port()) as (base, _):
        yield base


@pytest.fixture(scope="module")
def codex_server(one_layer_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Codex sends no ``max_output_tokens``: the config's default (24) applies, so the trained context will do,
    and the random model's answer ends ``response.incomplete`` (``max_output_tokens``)."""
    tmp = tmp_path_factory.mktemp("codex")
    with serve_subprocess(config(tmp, one_layer_model, CODEX_CONTEXT), free_port()) as (base, _):
        yield base


def anthropic_answer(response: httpx.Response, stream: bool) -> dict[str, Any]:
    """The message of a Messages answer, rebuilt from its SSE events when streamed (usage merged as sent)."""
    if not stream:
        return response.json()
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in sse_events(response.text) if e["type"] != "ping"]
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop", types
    assert "error" not in types, events
    message = dict(events[0]["message"])
    blocks: dict[int, dict[str, Any]] = {}
    for event in events[1:-1]:
        index = event.get("index")
        if event["type"] == "content_block_start":
            assert index not in blocks, f"block {index} started twice"
            blocks[index] = {**event["content_block"], "open": True}
        elif event["type"] == "content_block_delta":
            assert blocks[index]["open"], f"delta for closed block {index}"
            if event["delta"]["type"] == "text_delta":
                blocks[index]["text"] += event["delta"]["text"]
        elif event["type"] == "content_block_stop":
            blocks[index]["open"] = False
        elif event["type"] == "message_delta":
            message.update(event["delta"])
            message["usage"] = {**message["usage"], **event["usage"]}
    assert all(not b.pop("open") for b in blocks.values()), blocks
    assert types.count("message_delta") == 1, types
    return {**message, "content": [blocks[i] for i in sorted(blocks)]}


def responses_answer(response: httpx.Response) -> dict[str, Any]:
    """The final response object of a Responses stream, after checking the stream's shape."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    types = [e["type"] for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete"), types
    assert not {"error", "response.failed"} & set(types), events
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas: dict[tuple[str, int], str] = {}
    for event in events:
        key = (event.get("item_id"), event.get("content_index"))
        if event["type"] == "response.output_text.delta":
            deltas[key] = deltas.get(key, "") + event["delta"]
        elif event["type"] == "response.output_text.done":
            assert event["text"] == deltas.get(key, ""), event
    final = events[-1]["response"]
    assert final["status"] == types[-1].removeprefix("response.")
    return final


def test_claude_code_turns_are_answered_and_the_second_reuses_the_first(claude_server: str, context_length: int):
    messages = []
    for turn in [CLAUDE_TURNS[0], with_billing_line(CLAUDE_TURNS[1], OTHER_BILLING_LINE)]:
        body = turn["body"]
        assert body["max_tokens"] == 64000 and body["stream"] is True  # as recorded, and replayed so
        message = anthropic_answer(post(claude_server, turn), body["stream"])
        assert message["type"] == "message" and message["role"] == "assistant", message
        assert message["stop_reason"] in STOP_REASONS, message
        assert message["usage"]["output_tokens"] >= 1 and message["content"], message
        assert prompt_tokens(message["usage"]) < context_length
        messages.append(message)
    first, second = (m["usage"] for m in messages)
    assert second.get("cache_read_input_tokens", 0) >= 0.9 * prompt_tokens(first), (first, second)


def test_codex_turns_are_answered_and_the_second_reuses_the_first(codex_server: str):
    finals = []
    for turn in CODEX_TURNS:
        assert turn["body"]["stream"] is True and "max_output_tokens" not in turn["body"]
        final = responses_answer(post(codex_server, turn))
        assert final["object"] == "response" and final["usage"]["output_tokens"] >= 1, final
        assert final["output"], final
        finals.append(final)
    first, second = (f["usage"] for f in finals)
    cached = (second.get("input_tokens_details") or {}).get("cached_tokens", 0)
    assert cached >= 0.9 * first["input_tokens"], (first, second)
