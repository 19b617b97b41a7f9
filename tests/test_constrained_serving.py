"""Constrained decoding through the daemon (the ``parse`` stage's grammar, applied per row in the batched step):
20 seeds at temperature 1 on the tiny random model, with ``response_format`` ``json_schema`` and with
``tool_choice`` ``required``, every output valid against its schema and finished by the grammar (not by
``max_tokens``); unconstrained requests decoding in the same batches are unchanged token for token."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.helpers import free_port, serve_subprocess, write_config

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["rain", "sun", "wind"]}, "maxItems": 3},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False},
    },
    "required": ["city", "unit", "days", "where"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 16}}, "required": ["query"],
        "additionalProperties": False}}},
]
PLAIN = ["Once upon a time", "Tell me about the sea.", "What is 2 + 2?", "Hello!"]


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("constrained")
    port = free_port()
    config = write_config(tmp, tiny_model_dir, port=port, extra="[engine]\nmax_running = 24\n")
    with serve_subprocess(config, port) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def plain(client: openai.OpenAI, prompt: str) -> str:
    result = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=24, temperature=0)
    return result.choices[0].message.content


def test_json_schema_outputs_validate_and_neighbours_are_unchanged(client):
    alone = [plain(client, p) for p in PLAIN]

    def constrained(seed: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "The weather, as JSON."}], max_tokens=400,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}})

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(constrained, seed) for seed in range(20)]
        neighbours = [pool.submit(plain, client, p) for p in PLAIN]
        results = [f.result() for f in futures]
        assert [f.result() for f in neighbours] == alone
    for result in results:
        choice = result.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({r.choices[0].message.content for r in results}) > 10  # sampled, not one forced answer


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_forced_tool_calls_validate(client, choice):
    def call(seed: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Find something."}], tools=TOOLS,
            tool_choice=choice, parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(call, range(20)))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    names = set()
    for result in results:
        choice_out = result.choices[0]
        assert choice_out.finish_reason == "tool_calls", choice_out
        assert len(choice_out.message.tool_calls) == 1 and not choice_out.message.content
        for tool_call in choice_out.message.tool_calls:
            names.add(tool_call.function.name)
            jsonschema.validate(json.loads(tool_call.function.arguments), schemas[tool_call.function.name])
    assert names == ({"search"} if isinstance(choice, dict) else names & {"weather", "search"})


def test_json_object_streams_valid_json(client):
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please."}], max_tokens=200, temperature=0.7,
        seed=5, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
        stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
