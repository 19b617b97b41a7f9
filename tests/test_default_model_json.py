"""Structured output on the embedded default model (SmolLM2-135M, a real model): 20 seeds at temperature 1 for a
schema with integers, numbers, strings and arrays; every reply that ends by the grammar parses and validates, and
every other reply says ``length``. Before numbers were bounded in the grammar, a reply to the city schema came back
as ``{"city": "Paris", "population": 1111…`` (50 digits and on) cut at ``length``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest

from mlxd.models.default_model import locate_default_gguf
from tests.helpers import free_port, serve_subprocess

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer"},
        "area_km2": {"type": "number"},
        "districts": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["city", "population", "area_km2", "districts", "landmarks"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Describe Paris as JSON: its population, area, districts and landmarks."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    locate_default_gguf(download=False)  # fails (never skips) without the embedded model's wheel
    port = free_port()
    config = tmp_path_factory.mktemp("default-json") / "default.toml"
    config.write_text((ROOT / "configs" / "default.toml").read_text())
    with serve_subprocess(config, port, timeout=300) as (base, _):
        yield base


def reply(base: str, seed: int) -> dict:
    response = httpx.post(base + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m", "messages": QUESTION, "temperature": 1.0, "seed": seed, "max_tokens": 96,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_replies_that_end_by_the_grammar_parse_and_validate(server):
    with ThreadPoolExecutor(10) as pool:
        choices = list(pool.map(lambda seed: reply(server, seed), range(20)))
    finishes = [choice["finish_reason"] for choice in choices]
    for choice in choices:
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        else:
            assert choice["finish_reason"] == "length", choice
    assert finishes.count("stop") >= 15, finishes  # numbers cannot run on: nearly every reply closes
