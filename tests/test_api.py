"""The OpenAI surface end to end, in-process, on a tiny random model; oracles from mlx-lm itself."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import generate, load
from mlx_lm.generate import generate_step

from tests.helpers import app_client, sse_events, streamed_text, write_config

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about cats."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("api"), tiny_model_dir, model_extra="context_length = 512")
    with app_client(config) as (client, daemon):
        yield client, daemon


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load(str(tiny_model_dir))


def chat(client, **body):
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, **body}
    return client.post("/v1/chat/completions", json=body)


def test_greedy_chat_equals_mlx_lm_generate(served, reference):
    client, _ = served
    model, tokenizer = reference
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = generate(model, tokenizer, prompt, max_tokens=20)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected_ids = [t for t, _ in generate_step(mx.array(prompt_ids), model, max_tokens=20)]
    response = chat(client, max_tokens=20)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == expected
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected_ids),
                             "total_tokens": len(prompt_ids) + len(expected_ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["finish_reason"] == "length"


def test_end_of_sequence_token_ends_with_stop(served, reference):
    client, _ = served
    _, tokenizer = reference
    body = chat(client, max_tokens=20, logit_bias={str(tokenizer.eos_token_id): 100.0}).json()
    assert body["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": ""},
                                  "finish_reason": "stop", "logprobs": None}
    assert body["usage"]["completion_tokens"] == 0


def test_greedy_completion_equals_mlx_lm_generate(served, reference):
    client, _ = served
    model, tokenizer = reference
    prompt = "def fibonacci(n):"
    expected = generate(model, tokenizer, prompt, max_tokens=16)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                       "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected


def test_streaming_equals_non_streaming(served):
    client, _ = served
    whole = chat(client, max_tokens=20).json()
    streamed = chat(client, max_tokens=20, stream=True, stream_options={"include_usage": True})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    frames = sse_events(streamed.text)
    assert frames[-1] == "[DONE]"
    assert streamed_text(frames) == whole["choices"][0]["message"]["content"]
    assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [f["choices"][0]["finish_reason"] for f in frames[:-1] if f["choices"]]
    assert finish[-1] == whole["choices"][0]["finish_reason"]
    assert frames[-2]["usage"] == whole["usage"] and frames[-2]["choices"] == []


def test_stream_without_include_usage_has_no_usage_chunk(served):
    client, _ = served
    frames = sse_events(chat(client, max_tokens=5, stream=True).text)
    assert all("usage" not in f for f in frames[:-1])


def test_stop_sequence_cuts_exactly(served):
    client, _ = served
    full = chat(client, max_tokens=24).json()["choices"][0]["message"]["content"]
    assert len(full) >= 8, full
    middle = len(full) // 2
    stop = full[middle : middle + 2]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        response = chat(client, max_tokens=24, stop=[stop, "\x00never"], stream=stream)
        if stream:
            frames = sse_events(response.text)
            text, reason = streamed_text(frames), frames[-2]["choices"][0]["finish_reason"]
        else:
            text, reason = response.json()["choices"][0]["message"]["content"], \
                response.json()["choices"][0]["finish_reason"]
        assert text == cut
        assert reason == "stop"


def test_special_tokens_never_reach_content(served, reference):
    client, _ = served
    _, tokenizer = reference
    # Bias the model hard towards a special token that is not an end-of-sequence token.
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = chat(client, max_tokens=6, logit_bias={str(special): 100.0}).json()
    assert body["usage"]["completion_tokens"] == 6
    assert "<|im_start|>" not in body["choices"][0]["message"]["content"]


def test_model_aliases_and_listing(served):
    client, _ = served
    assert chat(client, model="claude-sonnet-4-5", max_tokens=2).status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/v1/models/gpt-4o").json()["id"] == "gpt-4o"
    assert client.get("/v1/models/llama").status_code == 404


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"messages": []}, "messages", "must not be empty"),
        ({"model": "nope"}, "model", "not served"),
        ({"temperature": "hot"}, "temperature", "Expected"),
        ({"messages": "hello"}, "messages", "Expected"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": 500}, "max_tokens", "exceeds the context"),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages", "context"),
        ({"bogus_field": 1}, "bogus_field", "unknown field"),
        ({"n": 9}, "n", "more choices than this server allows"),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "json_schema.schema"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, None, "Invalid enum value 'wizard'"),
    ],
)
def test_bad_requests_get_openai_shaped_400(served, body, param, fragment):
    client, _ = served
    response = chat(client, **body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["type"]
    if param is not None:
        assert error["param"] == param


def test_malformed_json_is_400(served):
    client, _ = served
    response = client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                           headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "malformed" in response.json()["error"]["message"].lower()


def test_noop_fields_are_accepted(served):
    client, _ = served
    response = chat(client, max_tokens=2, user="u1", store=False, parallel_tool_calls=True,
                    metadata={"k": "v"}, service_tier="auto")
    assert response.status_code == 200, response.text


def test_oversized_body_is_413(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, extra="")
    config.write_text(config.read_text().replace("keepalive_s = 0.5", "keepalive_s = 0.5\nmax_body_bytes = 2000"))
    with app_client(config) as (client, _):
        response = chat(client, messages=[{"role": "user", "content": "x" * 5000}])
        assert response.status_code == 413
        assert "error" in response.json()


def test_health_status_and_openapi(served):
    client, _ = served
    assert client.get("/health").json()["status"] == "ready"
    status = client.get("/v1/status").json()
    assert status["running"] == [] and status["waiting"] == []
    assert status["totals"]["num_requests"] >= 1
    schema = client.get("/docs/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/v1/status"} <= set(schema["paths"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    ref = body["$ref"].rsplit("/", 1)[-1]
    assert "messages" in schema["components"]["schemas"][ref]["properties"]


def test_tools_and_tool_calls_render_exactly_as_sent(served, reference):
    client, _ = served
    _, tokenizer = reference
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]
    expected = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    body = chat(client, messages=messages, tools=tools, max_tokens=1).json()
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(expected, add_special_tokens=False))
