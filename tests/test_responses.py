"""The Responses API (``POST /v1/responses``) through the real ``openai`` SDK against daemons on loopback.

Two daemons, started together: the tiny model as it is (greedy, prefix cache on) and the tiny model under the
Qwen3 fixture template with a scripted model double (``tests.scripted_server``) that generates an exact text, a
Hermes tool call or a ``<think>`` block. The SDK's ``responses.create``, ``responses.stream`` (with
``get_final_response``) and ``responses.parse`` must read every answer; streamed and non-streamed answers must be
equal; every stream must number its events in order and close every item it opens. The request → job conversion
and the renderer's edge cases (a failure mid-stream, blank text between items) are tested without a server.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import msgspec
import openai
import pydantic
import pytest
import structlog
import structlog.testing

from mlxd.api.responses_jobs import responses_job
from mlxd.api.responses_render import ResponsesRenderer, replay
from mlxd.api.responses_schemas import ResponseSettings, ResponsesRequest
from mlxd.config.sampling import MLXD_SAMPLING
from mlxd.errors import EngineError, RequestError
from mlxd.pipeline.events import ContentDelta, Done, ReasoningDelta, ToolCallDelta
from tests.helpers import free_port, log_lines, serve_subprocess, stop_process, wait_healthy, write_config
from tests.support.tool_templates import TOOL_TEMPLATES

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.", "strict": False,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
QUESTION = "What is the weather in Paris?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "ok": {"type": "boolean"}},
    "required": ["city", "unit", "ok"],
    "additionalProperties": False,
}


class Weather(pydantic.BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    ok: bool


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """(plain client, scripted client, the scripted model's script file, the two server logs)."""
    tmp = tmp_path_factory.mktemp("responses")
    scripted_dir = tmp / "scripted"
    scripted_dir.mkdir()
    (scripted_dir / "template.jinja").write_text(TOOL_TEMPLATES["qwen3"])
    script = scripted_dir / "script.txt"
    script.write_text("Hello there.")
    scripted_port, plain_port = free_port(), free_port()
    config = write_config(scripted_dir, tiny_model_dir, port=scripted_port,
                          model_extra='chat_template = "template.jinja"', extra="[engine]\nprefix_cache_bytes = 0\n")
    scripted_log = scripted_dir / "server.log"
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(scripted_log, "wb"))
        proc = subprocess.Popen([sys.executable, "-m", "tests.scripted_server", str(config), str(script)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
        stack.callback(stop_process, proc)
        plain_dir = tmp / "plain"
        plain_dir.mkdir()
        base, _ = stack.enter_context(serve_subprocess(write_config(plain_dir, tiny_model_dir, port=plain_port),
                                                       plain_port))
        wait_healthy(f"http://127.0.0.1:{scripted_port}", proc, 180, scripted_log)
        clients = [openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
                   for url in (base, f"http://127.0.0.1:{scripted_port}")]
        yield *clients, script, plain_dir / f"server-{plain_port}.log", scripted_log


@pytest.fixture
def plain(servers):
    return servers[0]


@pytest.fixture
def scripted(servers):
    return servers[1]


@pytest.fixture
def script(servers):
    """``script(text)``: the scripted daemon generates ``text`` for this test's requests."""
    path = servers[2]
    before = path.read_text()
    yield path.write_text
    path.write_text(before)


def check_stream(events: list) -> None:
    """Numbered in order from 0; created and in_progress first, a final event last; every item added is done,
    at increasing output indexes, and its deltas come between."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete", "response.failed")
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in added] == [e.output_index for e in done] == list(range(len(added)))
    assert [e.item.id for e in added] == [e.item.id for e in done]
    open_index = None
    for event in events:
        if event.type == "response.output_item.added":
            assert open_index is None
            open_index = event.output_index
        elif event.type == "response.output_item.done":
            open_index = None
        elif hasattr(event, "output_index"):
            assert event.output_index == open_index, event
    assert open_index is None
    final = events[-1].response
    assert [item.id for item in final.output] == [e.item.id for e in done]


def streamed(client: openai.OpenAI, **kwargs) -> tuple[list, object]:
    """The events of a stream read with the SDK's helper, and its final response."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_response()


# ---- through the SDK ----


def test_text_streamed_equals_not_streamed(scripted, script):
    script("Hello there, friend.")
    whole = scripted.responses.create(model="tiny", input="Hi", instructions="Be brief.", store=True,
                                      metadata={"k": "v"})
    assert whole.status == "completed" and whole.output_text == "Hello there, friend."
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.instructions == "Be brief."
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert whole.metadata == {"k": "v"} and whole.tools == [] and whole.tool_choice == "auto"
    usage = whole.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens > 0
    assert usage.output_tokens_details.reasoning_tokens == 0

    events, final = streamed(scripted, model="tiny", input="Hi", instructions="Be brief.")
    check_stream(events)
    assert final.output_text == whole.output_text and final.status == "completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    types = [e.type for e in events]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


def test_function_call_round_trip(scripted, script):
    script(CALL)
    first = scripted.responses.create(model="tiny", input=QUESTION, tools=TOOLS)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.status == "completed"
    assert [t.name for t in first.tools] == ["get_weather"]

    events, final = streamed(scripted, model="tiny", input=QUESTION, tools=TOOLS)
    check_stream(events)
    [streamed_call] = final.output
    assert (streamed_call.name, json.loads(streamed_call.arguments)) == ("get_weather", {"city": "Paris"})
    [args_done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args_done.arguments == streamed_call.arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        streamed_call.arguments

    script("It is sunny in Paris.")
    history = [{"role": "user", "content": QUESTION}, *[i.model_dump(mode="json", exclude_none=True)
                                                        for i in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}]
    second = scripted.responses.create(model="tiny", input=history, tools=TOOLS)
    assert second.output_text == "It is sunny in Paris." and second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens


def test_reasoning_becomes_a_summary(scripted, script):
    script(THINK)
    whole = scripted.responses.create(model="tiny", input=QUESTION, reasoning={"effort": "high", "summary": "auto"})
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [s.text for s in reasoning.summary] == ["The user wants weather."]
    assert message.type == "message" and whole.output_text == "It is sunny."
    details = whole.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.output_tokens

    events, final = streamed(scripted, model="tiny", input=QUESTION, reasoning={"effort": "high"})
    check_stream(events)
    types = [e.type for e in events]
    assert types.index("response.reasoning_summary_part.added") < types.index(
        "response.reasoning_summary_text.delta") < types.index("response.reasoning_summary_text.done") < types.index(
        "response.reasoning_summary_part.done") < types.index("response.output_text.delta")
    assert [s.text for s in final.output[0].summary] == ["The user wants weather."]
    assert final.output_text == "It is sunny."


def test_a_huge_max_output_tokens_is_clamped_not_refused(scripted, script, servers):
    script("Short.")
    result = scripted.responses.create(model="tiny", input="Hi", max_output_tokens=10**9)
    assert result.status == "completed" and result.output_text == "Short."
    assert result.max_output_tokens == 10**9
    [line] = [line for line in log_lines(servers[4]) if line.get("request_id") == result.id]
    assert line["max_tokens_clamped_from"] == 10**9 and line["finish_reason"] == "stop"


def test_max_output_tokens_makes_the_response_incomplete(plain):
    whole = plain.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=6)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.output[-1].status == "incomplete"
    events = list(plain.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=6, stream=True))
    check_stream(events)
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.response.output_text == whole.output_text


def test_json_schema_output_validates(plain):
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    for seed_text in ("The weather, as JSON.", "Paris weather?", "JSON please."):
        result = plain.responses.create(model="tiny", input=seed_text, temperature=1.0, max_output_tokens=300,
                                        text={"format": fmt})
        assert result.status == "completed", result
        jsonschema.validate(json.loads(result.output_text), SCHEMA)
        assert result.text.format.type == "json_schema"
    parsed = plain.responses.parse(model="tiny", input="Weather?", temperature=1.0, max_output_tokens=300,
                                   text_format=Weather)
    assert isinstance(parsed.output_parsed, Weather)


def test_a_repeated_request_hits_the_prefix_cache(plain):
    long_input = [{"role": "developer", "content": "You answer questions about the weather. " * 20},
                  {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]
    plain.responses.create(model="tiny", input=long_input, max_output_tokens=4)
    again = plain.responses.create(model="tiny", input=long_input, max_output_tokens=4)
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_hosted_tools_are_dropped_and_named_in_the_log(plain, servers):
    tools = [{"type": "web_search"}, *TOOLS, {"type": "local_shell"}]
    result = plain.responses.create(model="tiny", input=QUESTION, tools=tools, max_output_tokens=4)
    assert result.status == "incomplete" and [t.name for t in result.tools] == ["get_weather"]
    [line] = [line for line in log_lines(servers[3]) if line.get("event") == "responses_tools_dropped"]
    assert line["tools"] == ["web_search", "local_shell"] and line["request_id"] == result.id


def test_previous_response_id_is_a_400_that_says_why(plain):
    with pytest.raises(openai.BadRequestError) as e:
        plain.responses.create(model="tiny", input="Hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.body["message"]


def test_unknown_fields_and_bad_items_are_400s_naming_them(plain):
    with pytest.raises(openai.BadRequestError) as e:
        plain.responses.create(model="tiny", input="Hi", extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        plain.responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_file",
                                                                                   "file_id": "f"}]}])
    assert e.value.body["param"] == "input[0].content[0]"


# ---- the request → job conversion ----

DEFAULTS = msgspec.structs.replace(MLXD_SAMPLING, temperature=0.5)  # resolved, as the daemon passes them


def job_of(**body):
    return responses_job(msgspec.convert({"model": "m", **body}, ResponsesRequest), "m", DEFAULTS)


def test_input_items_become_chat_messages():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_a", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "call_b", "name": "g", "arguments": {"y": 2}},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_a", "output": "one"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "two"}]},
    ]
    with structlog.testing.capture_logs() as logs:
        job, settings = job_of(instructions="Be kind.", input=items, temperature=0.2)
    assert [(e["event"], e["items"]) for e in logs] == [("responses_input_dropped", {"web_search_call": 1})]
    assert job.messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"y": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "one"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "two"}]},
    ]
    assert job.clamp_max_tokens and job.request_id.startswith("resp_")
    assert job.sampling.temperature == 0.2 and settings.temperature == 0.2 and settings.top_p == 1.0


def test_tools_tool_choice_reasoning_and_text_format():
    tools = [*TOOLS, {"type": "function", "name": "search", "parameters": {"type": "object"}},
             {"type": "custom", "name": "apply_patch"}, {"type": "web_search_preview"}]
    job, settings = job_of(input="Hi", tools=tools, tool_choice={"type": "function", "name": "search"},
                           parallel_tool_calls=False, reasoning={"effort": "minimal"},
                           text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True},
                                 "verbosity": "low"})
    assert [t["function"]["name"] for t in job.tools] == ["get_weather", "search"]
    assert job.tools[0] == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.", "parameters": TOOLS[0]["parameters"],
        "strict": False}}
    assert job.tool_choice == {"type": "function", "function": {"name": "search"}}
    assert job.parallel_tool_calls is False
    assert job.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert job.response_format == {"type": "json_schema", "schema": SCHEMA, "strict": True, "name": "w"}
    assert [t["name"] for t in settings.tools] == ["get_weather", "search"]
    assert settings.text["verbosity"] == "low" and settings.tool_choice["name"] == "search"

    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "search"}]}
    job, settings = job_of(input="Hi", tools=tools, tool_choice=allowed)
    assert job.tool_choice == "required" and [t["function"]["name"] for t in job.tools] == ["search"]
    assert job_of(input="Hi", tools=TOOLS, tool_choice="none")[0].tools is None
    assert job_of(input="Hi", reasoning={"effort": "xhigh"})[0].template_kwargs == {
        "enable_thinking": True, "reasoning_effort": "high"}
    assert job_of(input="Hi", text={"format": {"type": "json_object"}})[0].response_format == {"type": "json_object"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "Hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": "Hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "w"}}}, "text"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as e:
        job_of(**body)
    assert e.value.param == param


def test_no_op_fields_are_accepted():
    job_of(input="Hi", include=["reasoning.encrypted_content"], prompt_cache_key="k", client_metadata={"a": "b"},
           store=True, metadata={"a": "b"}, user="u", service_tier="auto", truncation="auto", background=False,
           safety_identifier="s", prompt_cache_retention="24h", top_logprobs=2, max_tool_calls=3,
           stream_options={"include_obfuscation": False}, text={"verbosity": "high"})


# ---- the renderer ----


def render(events: list) -> tuple[list, ResponsesRenderer]:
    renderer = ResponsesRenderer("resp_1", 0, ResponseSettings(model="m"))
    frames = renderer.opening()
    for event in events:
        frames += renderer.closing(0, event) + renderer.final(event) if isinstance(event, Done) else \
            renderer.render(0, event)
    return frames, renderer


DONE = Done(finish_reason="stop", num_prompt_tokens=5, num_completion_tokens=10)


def test_blank_text_between_items_opens_no_item():
    events = [ReasoningDelta("\nThinking"), ReasoningDelta(" hard.\n"), ContentDelta("\n\n"),
              ToolCallDelta(index=0, id="call_1", name="f"), ToolCallDelta(index=0, arguments='{"a": 1}'),
              ContentDelta("\n"), ContentDelta("  Done"), ContentDelta(".\n"), DONE]
    frames, renderer = render(events)
    response = replay(ResponsesRenderer("resp_1", 0, ResponseSettings(model="m")), [(0, e) for e in events])
    strip = lambda items: [msgspec.structs.replace(item, id="") for item in items]  # noqa: E731
    assert strip(frames[-1][1].response.output) == strip(response.output)
    reasoning, call, message = response.output
    assert reasoning.summary[0].text == "Thinking hard."
    assert (call.call_id, call.name, call.arguments) == ("call_1", "f", '{"a": 1}')
    assert message.content[0].text == "  Done."
    assert [name for name, _ in frames].count("response.output_item.added") == 3
    assert [f.sequence_number for _, f in frames] == list(range(len(frames)))


def test_a_failure_mid_stream_closes_the_open_item_then_fails():
    frames, renderer = render([ContentDelta("Hello")])
    frames += renderer.error(EngineError("the engine stopped"))
    names = [name for name, _ in frames]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.failed"]
    failed = frames[-1][1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output[0].status == "incomplete" and failed.output[0].content[0].text == "Hello"
    assert all(name == frame.type for name, frame in frames)


def test_a_call_without_arguments_sends_an_empty_object():
    frames, _ = render([ToolCallDelta(index=0, id="call_1", name="now"), DONE])
    done = [f for name, f in frames if name == "response.function_call_arguments.done"]
    assert done[0].arguments == "{}" and frames[-1][1].response.output[0].arguments == "{}"
