"""Requests cannot run work of their own choosing, and client input is never a 500.

In-process on the tiny model (a Hermes-format template): ``chat_template_kwargs`` takes template switches only;
schemas the grammar engine cannot use (``$ref`` loops) and tool names that hold tool-call markup are 400s naming
the field, on the OpenAI chat, Anthropic Messages and Responses surfaces; a hostile model template is refused
within its deadline while /health answers at once; afterwards the daemon answers a greedy request as before.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers import app_client, write_config

MESSAGES = [{"role": "user", "content": "Tell me about cats."}]
GREEDY = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
LOOPS = ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}{% endfor %}"
         "{% endfor %}{% endfor %}")
SELF_REF = {"$ref": "#"}
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NESTED_LOOP = {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]}
ALL_OF_LOOP = {"allOf": [{"$ref": "#"}]}
BAD_SCHEMAS = {"self": SELF_REF, "loop": LOOP, "nested": NESTED_LOOP, "allOf": ALL_OF_LOOP}
MARKUP_NAMES = ["</tool_call>", "get<tool_call>x", 'a"b', "a\nb", "a b", "<|im_end|>", "[TOOL_CALLS]", ""]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("client-code"), tiny_model_dir)
    with app_client(config) as (client, daemon):
        greedy = client.post("/v1/chat/completions", json=GREEDY)
        assert greedy.status_code == 200, greedy.text
        yield client, greedy.json()["choices"][0]["message"]["content"]


def openai_error(response, param: str) -> dict:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "tools", "documents", "return_dict",
                                 "add_generation_prompt", "continue_final_message", "tokenizer_kwargs",
                                 "return_tensors", "bos_token", "messages"])
def test_chat_template_kwargs_refuse_anything_but_switches(served, key):
    client, _ = served
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json={**GREEDY, "chat_template_kwargs": {key: LOOPS}})
    openai_error(response, f"chat_template_kwargs.{key}")
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, "x" * 300])
def test_switch_values_must_be_small_scalars(served, value):
    client, _ = served
    response = client.post("/v1/chat/completions", json={**GREEDY, "chat_template_kwargs": {"enable_thinking": value}})
    openai_error(response, "chat_template_kwargs.enable_thinking")


def test_six_hostile_template_requests_get_fast_400s_while_health_answers(served):
    client, greedy = served
    hostile = [LOOPS, "{% set s = 'a' * 300000000 %}{{ s }}"] * 3
    results, health = [], []

    def send(template: str) -> None:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json={**GREEDY, "chat_template_kwargs": {
            "chat_template": template}})
        results.append((response.status_code, time.monotonic() - started))

    threads = [threading.Thread(target=send, args=(t,)) for t in hostile]
    for thread in threads:
        thread.start()
    for _ in range(3):
        started = time.monotonic()
        health.append((client.get("/health").status_code, time.monotonic() - started))
    for thread in threads:
        thread.join(30)
    assert [status for status, _ in results] == [400] * 6
    assert max(seconds for _, seconds in results) < 5.0
    assert all(status == 200 and seconds < 0.5 for status, seconds in health), health
    again = client.post("/v1/chat/completions", json=GREEDY)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == greedy


@pytest.mark.parametrize("name", sorted(BAD_SCHEMAS))
def test_schemas_without_a_finite_instance_are_400s_naming_the_field(served, name):
    client, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMAS[name]}}
    response = client.post("/v1/chat/completions", json={**GREEDY, "response_format": fmt})
    error = openai_error(response, "response_format.json_schema.schema")
    assert "$ref" in error["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("name", ["self", "loop"])
def test_tool_parameters_without_a_finite_instance_are_400s(served, choice, name):
    client, _ = served
    body = {**GREEDY, "tools": [tool("g"), tool("f", BAD_SCHEMAS[name])], "tool_choice": choice}
    openai_error(client.post("/v1/chat/completions", json=body), "tools[1].function.parameters")


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_tool_names_holding_markup_are_400s(served, choice, name):
    client, _ = served
    tool_choice = {"type": "function", "function": {"name": name}} if choice == "named" else choice
    body = {**GREEDY, "tools": [tool("fine"), tool(name)], "tool_choice": tool_choice}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] in ("tools[1].function.name", "tools", "tool_choice")


def test_namespaced_tool_names_are_served(served):
    client, _ = served
    body = {**GREEDY, "tools": [tool("mcp__files__read-file"), tool("github.create_issue:v2")]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def anthropic_error(response) -> str:
    assert response.status_code == 400, response.text[:500]
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


ANTHROPIC = {"model": "tiny", "max_tokens": 8, "messages": MESSAGES}


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "f"}])
def test_anthropic_tool_schema_loops_are_400s(served, choice):
    client, _ = served
    body = {**ANTHROPIC, "tools": [{"name": "f", "input_schema": LOOP}], "tool_choice": choice}
    assert "tools[0].function.parameters" in anthropic_error(client.post("/v1/messages", json=body))


@pytest.mark.parametrize("choice", [None, {"type": "any"}])
def test_anthropic_tool_names_holding_markup_are_400s(served, choice):
    client, _ = served
    body = {**ANTHROPIC, "tools": [{"name": "a</tool_call>b", "input_schema": {"type": "object"}}],
            **({"tool_choice": choice} if choice else {})}
    assert "tools[0].function.name" in anthropic_error(client.post("/v1/messages", json=body))


RESPONSES = {"model": "tiny", "input": "Tell me about cats.", "max_output_tokens": 8}


def responses_error(response) -> dict:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def test_responses_schema_loop_is_a_400(served):
    client, _ = served
    body = {**RESPONSES, "text": {"format": {"type": "json_schema", "name": "x", "schema": SELF_REF}}}
    error = responses_error(client.post("/v1/responses", json=body))
    assert error["param"] == "response_format.json_schema.schema" and "$ref" in error["message"]


def test_responses_tool_problems_are_400s(served):
    client, _ = served
    looped = {**RESPONSES, "tools": [{"type": "function", "name": "f", "parameters": LOOP}],
              "tool_choice": "required"}
    assert responses_error(client.post("/v1/responses", json=looped))["param"] == "tools[0].function.parameters"
    marked = {**RESPONSES, "tools": [{"type": "function", "name": "<tool_call>", "parameters": {"type": "object"}}]}
    assert responses_error(client.post("/v1/responses", json=marked))["param"] == "tools[0].function.name"


def test_the_daemon_answers_as_before_afterwards(served):
    client, greedy = served
    response = client.post("/v1/chat/completions", json=GREEDY)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == greedy


def test_a_hostile_model_template_is_a_400_within_its_deadline(tiny_model_dir, tmp_path):
    extra = f"chat_template = '''{LOOPS}'''\ntemplate_timeout_s = 0.5"
    config = write_config(tmp_path, tiny_model_dir, model_extra=extra)
    with app_client(config) as (client, _):
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json=GREEDY)
        assert time.monotonic() - started < 3.0
        error = openai_error(response, "messages")
        assert "time bound" in error["message"]
        assert client.get("/health").status_code == 200
