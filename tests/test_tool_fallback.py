"""The fallback for calls the configured parser cannot read (``mlxd.pipeline.parsers.tools.fallback``).

Oracles: a complete call in another known format (Hermes JSON in tags, a bare JSON call) to one of the request's
tools comes out as that call, whole or split at every character, with no markup in content and one
``tool_call_fallback`` log line naming both parsers; anything else (ordinary JSON, a call to an undeclared name, no
tools at all) comes out as the exact text that was generated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from mlxd.pipeline.events import ContentDelta, ToolCallDelta
from mlxd.pipeline.parsers.tools import TOOL_PARSERS
from mlxd.pipeline.parsers.tools.fallback import FallbackToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
WEATHER = {"city": "Paris", "days": 3}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
BARE = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
CODER = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
        "</parameter>\n</function>\n</tool_call>"
SEED = "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>"


def splits(text: str) -> Iterator[list[str]]:
    yield [text]
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text)


def run(primary: str, pieces: list[str], tools: list | None = TOOLS) -> tuple[str, list[tuple[str, Any]], int]:
    """Content, calls (name, arguments) and the parser's call count for ``pieces``."""
    parser = FallbackToolParser(TOOL_PARSERS[primary](tools), tools)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content, calls = [], {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        else:
            assert isinstance(event, ToolCallDelta)
            if event.index not in calls:
                assert event.index == len(calls) and event.id and event.name, event
                calls[event.index] = [event.name, ""]
            calls[event.index][1] += event.arguments
    return "".join(content), [(n, json.loads(a)) for n, a in calls.values()], parser.num_calls


RECOVERED = [
    ("qwen3_coder", "Let me check.\n" + HERMES, "Let me check.\n"),  # Hermes JSON inside Qwen3-Coder output
    ("seed_oss", HERMES, ""),
    ("qwen3_coder", BARE, ""),  # untagged JSON
    ("hermes", "Sure: " + BARE, "Sure: "),
    ("llama3", "Calling it.\n```json\n" + BARE + "\n```", "Calling it.\n"),
    ("glm45", HERMES, ""),
]


@pytest.mark.parametrize(("primary", "text", "content"), RECOVERED)
def test_a_complete_call_in_another_format_is_recovered_at_every_split(primary: str, text: str,
                                                                        content: str) -> None:
    for pieces in splits(text):
        got_content, calls, count = run(primary, pieces)
        assert (got_content, calls, count) == (content, [("get_weather", WEATHER)], 1), pieces
        assert "<tool_call>" not in got_content and '"name"' not in got_content


def test_the_recovery_is_logged_with_both_parsers() -> None:
    with capture_logs() as logs:
        run("qwen3_coder", [HERMES])
    assert [log for log in logs if log["event"] == "tool_call_fallback"] == [
        {"event": "tool_call_fallback", "log_level": "info", "parser": "qwen3_coder", "fallback": "generic",
         "tool": "get_weather"}]


NOT_CALLS = [
    ("qwen3_coder", 'The config is {"city": "Paris", "days": 3}.'),  # ordinary JSON
    ("qwen3_coder", '{"name": "launch_rocket", "arguments": {"target": "moon"}}'),  # not a declared tool
    ("seed_oss", '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call> done'),
    ("hermes", 'A list: [{"name": "x"}] and {"name": "get_weather"} alone.'),  # no arguments: not a call
    ("qwen3_coder", '{"name": "get_weather", "arguments": {"city": "Pa'),  # incomplete
]


@pytest.mark.parametrize(("primary", "text"), NOT_CALLS)
def test_text_that_is_not_a_complete_call_of_a_declared_tool_stays_as_generated(primary: str, text: str) -> None:
    for pieces in splits(text):
        assert run(primary, pieces) == (text, [], 0), pieces


@pytest.mark.parametrize("text", [HERMES, BARE, "Sure: " + BARE])
def test_without_tools_nothing_is_a_call(text: str) -> None:
    assert run("qwen3_coder", list(text), tools=None) == (text, [], 0)


def test_once_the_configured_parser_finds_a_call_the_fallback_retires() -> None:
    """A bare JSON call after a Qwen3-Coder call is the model's text; one before it was recovered first."""
    for pieces in splits(CODER + "\n" + BARE):
        content, calls, _ = run("qwen3_coder", pieces)
        assert (content.strip(), calls) == (BARE, [("get_weather", WEATHER)]), pieces
    for pieces in splits(BARE + "\n" + SEED):
        content, calls, _ = run("seed_oss", pieces)
        assert (content.strip(), calls) == ("", [("get_weather", WEATHER), ("get_weather", {"city": "Paris"})])


def test_ordinary_json_streams_on_and_only_a_call_s_beginning_is_held() -> None:
    parser = FallbackToolParser(TOOL_PARSERS["qwen3_coder"](TOOLS), TOOLS)
    assert parser.feed('Config: {"city": "Pa') == [ContentDelta('Config: {"city": "Pa')]
    assert parser.feed('ris"} then {"na') == [ContentDelta('ris"} then ')]  # may begin a call: held
    assert parser.feed('me": "x"} end') == [ContentDelta('{"name": "x"} end')]
    assert parser.finish() == [] and parser.num_calls == 0
