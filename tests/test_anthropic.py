"""The Anthropic Messages surface (``/v1/messages``, ``/v1/messages/count_tokens``) through the real ``anthropic``
SDK against daemons on loopback, and its translation and rendering in-process.

The scripted daemon serves the tiny model under Qwen3's fixture template (Hermes tool calls, ``<think>``
reasoning) with a model double that generates an exact text (``tests.scripted_server``), the prefix cache off,
one request running and one waiting, and an API key. A plain daemon with the prefix cache on shows cache reads in
``usage``. The oracles: streamed messages equal non-streamed ones; ``count_tokens`` equals the prompt tokens the
response's usage reports; the SSE events form a valid sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import msgspec
import pytest
import structlog
from litestar import Request

from mlxd.api import anthropic_jobs as jobs
from mlxd.api import anthropic_render as render
from mlxd.api.anthropic import handle_unexpected
from mlxd.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from mlxd.api.output import Output
from mlxd.config.schema import SamplingDefaults
from mlxd.errors import ContextLengthExceeded, EngineError, NotReady, Overloaded, RequestError
from mlxd.pipeline.events import ContentDelta, Done, ReasoningDelta, ToolCallDelta
from mlxd.pipeline.stages.template_points import strip_marks
from tests.helpers import (
    SHORT_HITS,
    free_port,
    log_lines,
    serve_subprocess,
    stop_process,
    wait_healthy,
    write_config,
)
from tests.support.tool_templates import TOOL_TEMPLATES

KEY = "test-anthropic-key"
TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CONTEXT = 2048  # the scripted daemon's: small, so that generating up to it is quick
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def decode(body: dict, type_: type = MessagesRequest):
    return msgspec.json.decode(msgspec.json.encode(body), type=type_, strict=True)


# ---- translation and rendering, in-process ----


def test_a_request_becomes_openai_shaped_chat_messages():
    body = decode({"model": "m", "max_tokens": 5, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=123;"},
        {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "\nAnswer in French."}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBOR"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "They want weather.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city", "is_error": True},
            {"type": "text", "text": "Try again.", "citations": None}]},
        {"role": "system", "content": [{"type": "text", "text": "Be quick."}]}],
        "tools": [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}],
        "metadata": {"user_id": "u"}, "context_management": {}, "output_config": {"effort": "high"},
        "service_tier": "auto", "container": None, "mcp_servers": []})
    job = jobs.messages_job(body, "m", SamplingDefaults())
    # The cache_control breakpoint is a marker where its block's text ends, which the template stage removes.
    (mark,) = job.cache_breakpoints
    assert job.messages[0]["content"] == f"You are terse.{mark}\nAnswer in French."
    assert strip_marks(job.messages, job.cache_breakpoints) == [
        {"role": "system", "content": "You are terse.\nAnswer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "They want weather.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such city"},
        {"role": "user", "content": "Try again."},
        {"role": "system", "content": "Be quick."},
    ]
    function = {"name": "get_weather", "description": "Weather for a city.", "parameters": TOOLS[0]["input_schema"]}
    assert job.tools == [{"type": "function", "function": function}]
    assert (job.tool_choice, job.parallel_tool_calls, job.template_kwargs) == ("auto", True, {})
    assert job.clamp_max_tokens and job.max_tokens == 5


@pytest.mark.parametrize(("choice", "thinking", "expected"), [
    ({"type": "any"}, {"type": "enabled", "budget_tokens": 2048}, ("required", True, {"enable_thinking": True})),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, {"type": "adaptive"},
     ({"type": "function", "function": {"name": "get_weather"}}, False, {"enable_thinking": True})),
    ({"type": "none"}, {"type": "disabled"}, ("none", True, {"enable_thinking": False})),
    ({"type": "auto", "disable_parallel_tool_use": True}, None, ("auto", False, {})),
])
def test_tool_choice_and_thinking(choice, thinking, expected):
    body = decode({"model": "m", "messages": USER, "tools": TOOLS, "tool_choice": choice,
                   **({"thinking": thinking} if thinking else {})}, CountTokensRequest)
    job = jobs.prompt_job(body, "m")
    assert (job.tool_choice, job.parallel_tool_calls, job.template_kwargs) == expected
    assert (job.tools is None) == (choice["type"] == "none")


def test_tool_results_with_blocks_keep_their_parts():
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = decode({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a chart"}, image],
         "is_error": True}]}]})
    parts = [{"type": "text", "text": "Error:"}, {"type": "text", "text": "a chart"},
             {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    messages = jobs.messages_job(body, "m", SamplingDefaults()).messages
    assert messages == [{"role": "tool", "tool_call_id": "t1", "content": parts}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [*USER, {"role": "assistant", "content": "The weather is"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [*USER, {"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
     "messages[1].content[0]"),
    ({"messages": USER, "tools": [{"name": "f"}]}, "tools[0]"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ({"messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": USER, "stop_sequences": [str(i) for i in range(17)]}, "stop_sequences"),
])
def test_requests_mlxd_cannot_honour_are_400s_naming_the_field(body, param):
    with pytest.raises(RequestError) as caught:
        jobs.messages_job(decode({"model": "m", "max_tokens": 5, **body}), "m", SamplingDefaults())
    assert caught.value.param == param


def test_the_renderer_opens_and_closes_blocks_as_event_kinds_change():
    renderer = render.MessageRenderer("msg_1", "m", num_prompt_tokens=7, clamped=False)
    events = [ReasoningDelta("Hmm."), ReasoningDelta(" Yes."), ContentDelta("Sure."), ContentDelta(""),
              ToolCallDelta(index=0, id="call_a", name="f", arguments=""),
              ToolCallDelta(index=0, arguments='{"x":'), ToolCallDelta(index=0, arguments=" 1}"),
              ToolCallDelta(index=1, id="call_b", name="g", arguments="{}")]
    done = Done(finish_reason="tool_calls", num_prompt_tokens=7, num_completion_tokens=9, num_cached_tokens=3)
    frames = renderer.opening() + [f for e in events for f in renderer.render(0, e)]
    frames += renderer.closing(0, done) + renderer.final(done)
    body = [msgspec.to_builtins(payload) for _, payload in frames]
    assert [name for name, _ in frames] == [b["type"] for b in body]
    check_sequence(body)
    starts = [b["content_block"] for b in body if b["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""},
                      {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
                      {"type": "tool_use", "id": "toolu_b", "name": "g", "input": {}}]
    deltas = [(b["index"], b["delta"]) for b in body if b["type"] == "content_block_delta"]
    assert deltas == [(0, {"type": "thinking_delta", "thinking": "Hmm."}),
                      (0, {"type": "thinking_delta", "thinking": " Yes."}),
                      (0, {"type": "signature_delta", "signature": ""}),
                      (1, {"type": "text_delta", "text": "Sure."}),
                      (2, {"type": "input_json_delta", "partial_json": '{"x":'}),
                      (2, {"type": "input_json_delta", "partial_json": " 1}"}),
                      (3, {"type": "input_json_delta", "partial_json": "{}"})]
    assert body[0]["message"]["usage"]["input_tokens"] == 7
    assert body[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert body[-2]["usage"] == {"input_tokens": 4, "output_tokens": 9, "cache_creation_input_tokens": 0,
                                 "cache_read_input_tokens": 3}


def test_the_message_body_and_stop_reasons():
    output = Output()
    for event in [ReasoningDelta("think"), ContentDelta("Hi"), ToolCallDelta(index=0, id="call_z", name="f"),
                  ToolCallDelta(index=0, arguments='{"a": [1]}')]:
        output.add(event)
    done = Done(finish_reason="length", num_prompt_tokens=5, num_completion_tokens=2)
    body = msgspec.to_builtins(render.message("msg_1", "m", output, done, clamped=True))
    assert body["content"] == [{"type": "thinking", "thinking": "think", "signature": ""},
                               {"type": "text", "text": "Hi"},
                               {"type": "tool_use", "id": "toolu_z", "name": "f", "input": {"a": [1]}}]
    assert body["stop_reason"] == "model_context_window_exceeded"
    stop = Done(finish_reason="stop", num_prompt_tokens=1, num_completion_tokens=1, stop_sequence="END")
    plain_stop = msgspec.structs.replace(stop, stop_sequence=None)
    reasons = [render.stop_reason(stop, False), render.stop_reason(plain_stop, False), render.stop_reason(done, False)]
    assert reasons == ["stop_sequence", "end_turn", "max_tokens"]


def test_error_statuses_and_types():
    assert render.status_of(Overloaded("full")) == 529
    assert render.status_of(NotReady("loading")) == 503
    assert [render.error_type(s) for s in (400, 401, 403, 404, 405, 413, 429, 500, 503, 529)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
        "invalid_request_error", "request_too_large", "rate_limit_error", "api_error", "overloaded_error",
        "overloaded_error"]
    assert render.error_message(ContextLengthExceeded("the prompt has 9 tokens", param="messages")).startswith(
        "prompt is too long: ")
    renderer = render.MessageRenderer("msg_1", "m", num_prompt_tokens=7, clamped=False)
    [(name, event)] = renderer.error(EngineError("the engine stopped at /var/mlxd/x.log", status=503))
    assert (name, msgspec.to_builtins(event)) == ("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "the engine stopped at <path>"}})


def test_an_unexpected_error_is_a_generic_500_naming_the_request():
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "raw_path": b"/v1/messages", "headers": [],
             "query_string": b"", "server": ("127.0.0.1", 80), "scheme": "http", "root_path": "", "state": {}}
    structlog.contextvars.bind_contextvars(request_id="msg_abc")
    try:
        with structlog.testing.capture_logs() as logs:
            response = handle_unexpected(Request(scope), ValueError("boom in /opt/secret/file.py"))
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    assert response.status_code == 500
    assert msgspec.to_builtins(response.content) == {"type": "error", "error": {
        "type": "api_error", "message": "internal error (request msg_abc); the details are in the server log"}}
    assert [entry["event"] for entry in logs] == ["unhandled_error"]


# ---- through the SDK, against daemons ----


@pytest.fixture(scope="module")
def daemons(tiny_model_dir, tmp_path_factory):
    """(scripted daemon: base URL, script file, log file; base URL of the plain daemon with the prefix cache)."""
    tmp = tmp_path_factory.mktemp("anthropic")
    (tmp / "template.jinja").write_text(TOOL_TEMPLATES["qwen3"])
    (tmp / "api.keys").write_text(KEY + "\n")
    script, log_path, port = tmp / "script.txt", tmp / "server.log", free_port()
    script.write_text("Hello.")
    model_extra = f'chat_template = "template.jinja"\ncontext_length = {CONTEXT}'
    config = write_config(tmp, tiny_model_dir, port=port, model_extra=model_extra,
                          server_extra='api_keys_file = "api.keys"\nmax_body_bytes = 1048576',
                          extra="[engine]\nprefix_cache_bytes = 0\nmax_running = 1\nmax_waiting = 1\n")
    plain_tmp, plain_port = tmp_path_factory.mktemp("anthropic-plain"), free_port()
    plain_config = write_config(plain_tmp, tiny_model_dir, port=plain_port, extra=SHORT_HITS)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "wb"))
        proc = subprocess.Popen([sys.executable, "-m", "tests.scripted_server", str(config), str(script)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
        stack.callback(stop_process, proc)
        plain, _ = stack.enter_context(serve_subprocess(plain_config, plain_port))
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 180, log_path)
        yield (base, script, log_path), plain


@pytest.fixture(scope="module")
def client(daemons):
    return anthropic.Anthropic(base_url=daemons[0][0], api_key=KEY, max_retries=0, timeout=60)


@contextlib.contextmanager
def scripted(daemons, text: str):
    """The scripted daemon generates ``text`` for the requests made inside this block."""
    script = daemons[0][1]
    before = script.read_text()
    script.write_text(text)
    try:
        yield
    finally:
        script.write_text(before)


def check_sequence(events: list[dict]) -> None:
    """A valid Messages stream: message_start first, message_stop last, message_delta before it; each block
    started, given deltas and stopped in turn, with indexes 0, 1, 2...; pings anywhere."""
    events = [e for e in events if e["type"] != "ping"]
    assert events[0]["type"] == "message_start" and events[0]["message"]["content"] == []
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for event in events[1:-2]:
        kind = event["type"]
        if kind == "content_block_start":
            assert open_index is None and event["index"] == next_index
            open_index, next_index = event["index"], next_index + 1
        elif kind == "content_block_delta":
            assert event["index"] == open_index
        else:
            assert kind == "content_block_stop" and event["index"] == open_index
            open_index = None
    assert open_index is None


def raw_stream(base: str, body: dict) -> list[dict]:
    """The events of a streamed message, each checked against its SSE event name."""
    events, name = [], None
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", base + "/v1/messages?beta=true", json={**body, "stream": True}, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name
                events.append(event)
    assert "[DONE]" not in json.dumps(events)
    return events


def blocks(message) -> list[dict]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def streamed(client, **kwargs):
    with client.messages.stream(**kwargs) as stream:
        return stream.get_final_message()


def test_create_and_stream_are_equal_and_usage_counts_the_prompt(daemons, client):
    request = {"model": "claude-local", "max_tokens": 50, "messages": USER,
               "system": [{"type": "text", "text": "Be brief."}]}
    with scripted(daemons, "It is sunny in Paris."):
        message = client.messages.create(**request)
        assert blocks(message) == [{"type": "text", "text": "It is sunny in Paris."}]
        assert (message.stop_reason, message.stop_sequence, message.role, message.model) == (
            "end_turn", None, "assistant", "tiny")
        assert message.id.startswith("msg_")
        final = streamed(client, **request)
        assert blocks(final) == blocks(message) and final.stop_reason == "end_turn"
        assert final.usage.output_tokens == message.usage.output_tokens
        check_sequence(raw_stream(daemons[0][0], request))
    count = client.messages.count_tokens(model="tiny", messages=USER, system=request["system"])
    assert count.input_tokens == message.usage.input_tokens == final.usage.input_tokens
    assert message.usage.cache_read_input_tokens == 0 and message.usage.cache_creation_input_tokens == 0


def test_a_tool_use_round_trip(daemons, client):
    request = {"model": "tiny", "max_tokens": 200, "messages": USER, "tools": TOOLS}
    with scripted(daemons, CALL):
        message = client.messages.create(**request)
        final = streamed(client, **request)
        events = raw_stream(daemons[0][0], request)
    assert message.stop_reason == final.stop_reason == "tool_use"
    (use,) = message.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert use.id.startswith("toolu_")
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    check_sequence(events)
    assert "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta") != ""

    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}
    history = [*USER, {"role": "assistant", "content": blocks(message)}, {"role": "user", "content": [result]}]
    with scripted(daemons, "It is sunny."):
        answer = client.messages.create(model="tiny", max_tokens=50, messages=history, tools=TOOLS)
    assert blocks(answer) == [{"type": "text", "text": "It is sunny."}] and answer.stop_reason == "end_turn"
    count = client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    assert count.input_tokens == answer.usage.input_tokens > message.usage.input_tokens
    # Thinking sent back in the current turn reaches the prompt (Qwen3's template renders it there).
    thought = {"type": "thinking", "thinking": "Call the weather tool.", "signature": ""}
    history[1] = {"role": "assistant", "content": [thought, *blocks(message)]}
    with_thinking = client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    assert with_thinking.input_tokens > count.input_tokens


def test_thinking_blocks(daemons, client):
    request = {"model": "tiny", "max_tokens": 100, "messages": USER,
               "thinking": {"type": "enabled", "budget_tokens": 1024}}
    with scripted(daemons, "<think>\nThe user wants weather.\n</think>\n\nSunny."):
        message = client.messages.create(**request)
        final = streamed(client, **request)
        events = raw_stream(daemons[0][0], request)
    thinking, text = message.content
    assert thinking.type == "thinking" and "The user wants weather." in thinking.thinking
    assert thinking.signature == ""
    assert (text.type, text.text) == ("text", "Sunny.")
    assert blocks(final) == blocks(message)
    check_sequence(events)
    kinds = [(e["type"], e.get("delta", {}).get("type")) for e in events if e["type"] != "ping"]
    stop_of_thinking = kinds.index(("content_block_stop", None))
    assert kinds[stop_of_thinking - 1] == ("content_block_delta", "signature_delta")

    # Turning thinking off renders the template's empty think block into the prompt.
    plain = client.messages.count_tokens(model="tiny", messages=USER).input_tokens
    off = client.messages.count_tokens(model="tiny", messages=USER, thinking={"type": "disabled"}).input_tokens
    assert off > plain


def test_stop_sequences_and_max_tokens(daemons, client):
    with scripted(daemons, "Hello world. Goodbye now."):
        stopped = client.messages.create(model="tiny", max_tokens=50, messages=USER, stop_sequences=["world"])
        final = streamed(client, model="tiny", max_tokens=50, messages=USER, stop_sequences=["world"])
        cut = client.messages.create(model="tiny", max_tokens=3, messages=USER)
    for message in (stopped, final):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "world")
        assert blocks(message) == [{"type": "text", "text": "Hello "}]
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_a_huge_max_tokens_is_clamped_not_refused(daemons, client):
    with scripted(daemons, "Fine."):
        message = client.messages.create(model="tiny", max_tokens=128000, messages=USER)
    with scripted(daemons, "word " * (CONTEXT + 100)):
        full = streamed(client, model="tiny", max_tokens=128000, messages=USER)
    assert blocks(message) == [{"type": "text", "text": "Fine."}] and message.stop_reason == "end_turn"
    # Running out of the clamped max_tokens is running out of context.
    assert full.stop_reason == "model_context_window_exceeded"
    assert full.usage.input_tokens + full.usage.output_tokens == CONTEXT
    lines = log_lines(daemons[0][2])
    for id in (message.id, full.id):
        (line,) = [e for e in lines if e.get("request_id") == id and e.get("event") == "request"]
        assert line["max_tokens_clamped_from"] == 128000 and line["endpoint"] == "messages"


def test_count_tokens_counts_a_prompt_longer_than_the_context(daemons, client):
    long = [{"role": "user", "content": "word " * (CONTEXT + 500)}]
    count = client.messages.count_tokens(model="tiny", messages=long).input_tokens
    assert count > CONTEXT
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=10, messages=long)
    assert caught.value.body["error"]["message"].startswith("prompt is too long")


def error_of(caught) -> dict:
    body = caught.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def test_error_shapes(daemons, client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=5, messages=USER, extra_body={"frequency_penalty": 1})
    error = error_of(caught)
    assert error["type"] == "invalid_request_error" and "frequency_penalty" in error["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=5, messages=USER, extra_body={"temperature": 1.5})
    assert "temperature" in error_of(caught)["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="llama-9000", max_tokens=5, messages=USER)
    assert error_of(caught)["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="llama-9000", messages=USER)
    wrong = anthropic.Anthropic(base_url=daemons[0][0], api_key=KEY + "x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="tiny", max_tokens=5, messages=USER)
    assert error_of(caught)["type"] == "authentication_error"
    missing = httpx.post(daemons[0][0] + "/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": USER})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    malformed = httpx.post(daemons[0][0] + "/v1/messages", content=b"{nope", headers={
        "x-api-key": KEY, "content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["type"] == "error"
    huge = httpx.post(daemons[0][0] + "/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 2_000_000}]})
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"


def test_a_full_queue_is_529_overloaded(daemons):
    base = daemons[0][0]
    headers = {"x-api-key": KEY}
    body = {"model": "tiny", "max_tokens": 4000, "messages": USER, "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as http:
            streams = [http.stream("POST", "/v1/messages", json=body) for _ in range(2)]
            responses = [await s.__aenter__() for s in streams]  # one running, one waiting
            try:
                assert [r.status_code for r in responses] == [200, 200]
                over = await http.post("/v1/messages", json={**body, "stream": False})
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
            return over

    with scripted(daemons, "word " * 3000):
        over = asyncio.run(run())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the closed streams are cancelled
            status = httpx.get(base + "/v1/status", headers=headers).json()
            if not status["running"] and not status["waiting"]:
                break
            time.sleep(0.05)
    assert over.status_code == 529, over.text
    assert int(over.headers["retry-after"]) >= 1
    assert over.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                      "message": over.json()["error"]["message"]}}


def test_claude_code_s_recorded_requests_are_understood(daemons):
    """Claude Code's requests (``tests/fixtures``: adaptive thinking, effort, context management, a system message
    in mid-conversation, 64000 max_tokens) decode and render; their prompts (~43k tokens with the tiny tokenizer)
    are longer than the plain daemon's context, so they are counted, and refused as too long to run."""
    for name in ("claude_code_turn1.json", "claude_code_turn2.json"):
        recorded = json.loads((Path(__file__).parent / "fixtures" / name).read_text())
        body, headers = recorded["body"], recorded["headers"]
        count_body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}
        count = httpx.post(daemons[1] + "/v1/messages/count_tokens?beta=true", json=count_body, headers=headers,
                           timeout=60)
        assert count.status_code == 200, count.text
        assert count.json()["input_tokens"] > 32768
        answer = httpx.post(daemons[1] + recorded["path"], json=body, headers=headers, timeout=60)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"].startswith("prompt is too long")


def test_a_repeated_request_reads_the_prefix_cache(daemons):
    client = anthropic.Anthropic(base_url=daemons[1], api_key="unused", max_retries=0, timeout=60)
    request = {"model": "tiny", "max_tokens": 4, "messages": USER, "system": "You answer questions about weather."}
    first = client.messages.create(**request)
    second = client.messages.create(**request)
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == first.usage.input_tokens
