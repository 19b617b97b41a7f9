"""Numbers in structured output are bounded in the grammar, so that every reply that ends by the grammar parses and
validates; a reply that does not end by the grammar (a string without ``maxLength`` run to ``max_tokens``) says
``length``. Grammar checks run on llguidance's byte tokenizer (string-level: every byte is a token); the serving
checks run on the tiny random model at temperature 1."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer

from mlxd.constraints.schema import (
    ANY_JSON_OBJECT,
    FRACTION_DIGITS,
    NUMBER_LIMIT,
    bound_numbers,
    with_json_options,
)
from mlxd.constraints.tools import select_tools
from tests.helpers import app_client, write_config

BYTES = LLTokenizer("byte")
INT64_MIN = -(2**63)


def accepts(schema: dict, text: str, param: str = "p") -> bool:
    """Whether the grammar compiled from ``schema`` (as mlxd prepares it) takes exactly ``text`` and is then
    complete."""
    matcher = LLMatcher(BYTES, LLMatcher.grammar_from_json_schema(with_json_options(schema, param=param)),
                        log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting() and not matcher.is_error()


@pytest.mark.parametrize(("text", "ok"), [
    ("0", True), ("-17", True), ("9223372036854774784", True), ("-9223372036854774784", True),
    ("9223372036854775807", False),  # int64's last 1023 values: llguidance reads bounds as doubles
    ("9223372036854775808", False), ("11111111111111111111", False), ("1" * 400, False), ("1.5", False),
])
def test_integers_are_bounded_to_int64(text, ok):
    assert accepts({"type": "integer"}, text) is ok
    if ok:
        assert INT64_MIN <= int(text) < 2**63


@pytest.mark.parametrize(("text", "ok"), [
    ("0", True), ("-3.25", True), ("0.0000000001", True), ("123456789012345678.5", True),
    ("9223372036854774784", True), ("1" * 20, False), ("1" * 400, False), ("0." + "1" * 11, False),
    ("0." + "1" * 400, False), ("1e309", False), ("1e5", False),
])
def test_numbers_have_bounded_digits(text, ok):
    assert accepts({"type": "number"}, text) is ok
    assert accepts({"type": ["number", "null"]}, text) is ok


def test_every_accepted_number_is_a_short_finite_double():
    longest = f"-{NUMBER_LIMIT}.{'9' * FRACTION_DIGITS}"  # as long as a bounded number can be: 31 characters
    assert accepts({"type": "number"}, longest) and len(longest) == 31
    assert abs(float(longest)) < 2**63
    assert not accepts({"type": "number"}, longest + "9")
    assert not accepts({"type": "number"}, f"-{NUMBER_LIMIT + 1024}")


def test_own_bounds_are_kept_where_tighter_and_nested_schemas_are_reached():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 3, "maximum": 10**30},
        "b": {"type": "array", "items": {"type": "number", "multipleOf": 0.5}},
        "c": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "d": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer", "exclusiveMaximum": 5}},
        "allOf": [{"properties": {"e": {"type": "integer"}}}]}
    out = bound_numbers(schema)
    assert out["properties"]["a"]["minimum"] == 3 and out["properties"]["a"]["maximum"] == NUMBER_LIMIT
    assert out["properties"]["b"]["items"]["multipleOf"] == 0.5  # its own multipleOf bounds its fraction
    assert out["properties"]["c"]["anyOf"][0]["maximum"] == NUMBER_LIMIT
    assert out["$defs"]["n"]["minimum"] == -NUMBER_LIMIT and out["$defs"]["n"]["exclusiveMaximum"] == 5
    assert out["allOf"][0]["properties"]["e"]["maximum"] == NUMBER_LIMIT
    assert "minimum" not in schema["properties"]["c"]["anyOf"][0]  # the argument is not changed
    assert accepts(schema, '{"a": 4, "b": [1.5], "c": "x", "d": 4, "e": 1}')
    assert not accepts(schema, '{"a": 4, "b": [1.25], "c": "x", "d": 4, "e": 1}')
    assert not accepts(schema, '{"a": 4, "b": [1.5], "c": 99999999999999999999, "d": 4, "e": 1}')


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer"},
        "area": {"type": "number"},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    },
    "required": ["city", "population", "area", "scores", "ids"],
    "additionalProperties": False,
}
FREE_TEXT = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
             "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("json-bounds")
    with app_client(write_config(tmp, tiny_model_dir)) as (test_client, _):
        yield test_client


def ask(client, schema: dict, seed: int, max_tokens: int) -> dict:
    response = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "A city, as JSON."}], "max_tokens": max_tokens,
        "temperature": 1.0, "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_replies_that_end_by_the_grammar_parse_and_validate(client):
    # The longest reply SCHEMA allows is under 400 characters (numbers at most 31, the string 16, arrays 4 items),
    # and a token is at least one character: every reply must end by the grammar, and parse.
    for seed in range(8):
        choice = ask(client, SCHEMA, seed, max_tokens=400)
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_a_reply_cut_by_max_tokens_says_length(client):
    finishes = []
    for seed in range(3):
        choice = ask(client, FREE_TEXT, seed, max_tokens=6)
        text = choice["message"]["content"]
        finishes.append(choice["finish_reason"])
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(text), FREE_TEXT)
        else:
            assert choice["finish_reason"] == "length", choice
            assert text.startswith('{"note": "')
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)
    assert "length" in finishes, finishes  # a string with no maxLength outruns 6 tokens


@pytest.mark.parametrize(("text", "ok"), [
    ("{}", True), ('{"a": [1, 2.5, "x", null, {"b": true}]}', True), ('{"a": {"b": [[]]}}', True),
    ('{"a": ' + "1" * 40 + "}", False), ('{"a": [0.' + "5" * 30 + "]}", False), ("[1]", False),
])
def test_json_object_numbers_are_bounded_at_any_depth(text, ok):
    assert accepts(ANY_JSON_OBJECT, text) is ok


def test_tool_parameters_are_bounded_the_same_way():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}}}]
    parameters = select_tools(tools, "required")["f"]
    assert parameters["properties"]["n"]["maximum"] == NUMBER_LIMIT
    assert parameters["properties"]["x"]["multipleOf"] == 10.0 ** -FRACTION_DIGITS
    assert "maximum" not in tools[0]["function"]["parameters"]["properties"]["n"]


@pytest.mark.parametrize(("schema", "text", "ok"), [
    (CITY := {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}},
     '{"city": "P", "population": 1, "x": [1.5, {"y": null}]}', True),
    (CITY, '{"city": "P", "population": 1, "x": ' + "1" * 50 + "}", False),  # an unlisted property
    ({"type": "object", "properties": {"m": {"description": "anything"}}}, '{"m": {"k": ' + "1" * 50 + "}}", False),
    ({"type": "object", "properties": {"m": {}}}, '{"m": "text"}', True),
    ({"type": "array"}, "[1, [2, " + "3" * 50 + "]]", False),
    ({"type": "array"}, '[1, [2, 3], "x"]', True),
])
def test_values_a_schema_leaves_open_have_bounded_numbers(schema, text, ok):
    assert accepts(schema, text) is ok
