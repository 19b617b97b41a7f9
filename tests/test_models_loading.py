"""Requests for a model that is loading (several models, :mod:`mlxd.api.loading`): streams on every surface get SSE
keep-alive comments while it loads, then what the loaded model answers; a non-streaming request waits; a request
that cannot fit, or whose model fails to load, gets 503 with Retry-After in its API's shape, or (the stream already
open) its API's error frame."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from litestar.testing import TestClient

from tests.helpers import free_port, sse_events, stop_process, streamed_text, wait_healthy
from tests.slow_load_server import LOAD_S, slow_engines
from tests.test_models_registry import PROMPT, two_models

KEEPALIVE = b": keep-alive\n\n"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
# Each surface's streaming request for model b, and how to read its text from the stream's body.
SURFACES = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES}),
    "completions": ("/v1/completions", {"prompt": PROMPT}),
    "messages": ("/v1/messages", {"messages": MESSAGES, "max_tokens": 12}),
    "responses": ("/v1/responses", {"input": "Tell me a story", "max_output_tokens": 12}),
}


@pytest.fixture(scope="module")
def second_model_dir(tiny_models_root: Path) -> Path:
    """The second model of tests.test_models_registry (another seed: other outputs)."""
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(tiny_models_root, "llama", seed=1)


def text_of(surface: str, body: bytes) -> str:
    frames = [f for f in sse_events(body.decode()) if isinstance(f, dict)]
    if surface in ("chat", "completions"):
        return streamed_text(frames)
    if surface == "messages":
        return "".join(f["delta"].get("text", "") for f in frames if f["type"] == "content_block_delta")
    return "".join(f["delta"] for f in frames if f["type"] == "response.output_text.delta")


def final_text(surface: str, body: dict) -> str:
    """The text of the same request's non-streaming answer."""
    if surface == "chat":
        return body["choices"][0]["message"]["content"]
    if surface == "completions":
        return body["choices"][0]["text"]
    if surface == "messages":
        return "".join(block.get("text", "") for block in body["content"])
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


def ends_whole(surface: str, body: bytes) -> bool:
    if surface in ("chat", "completions"):
        return body.rstrip().endswith(b"data: [DONE]")
    if surface == "messages":
        return b"event: message_stop" in body
    return b"event: response.incomplete" in body  # max_output_tokens reached: the whole response, cut as asked


@contextlib.contextmanager
def slow_load_server(config: Path) -> Iterator[str]:
    """``python -m tests.slow_load_server``: model b's load takes LOAD_S seconds longer."""
    port = free_port()
    config.write_text(config.read_text().replace("[server]\n", f"[server]\nport = {port}\n", 1))
    log_path = config.parent / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.slow_load_server", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 180, log_path)
        yield base
    finally:
        stop_process(proc)


def stream_timed(base: str, surface: str, into: dict) -> None:
    """Stream one request for model b: the body and when (seconds after sending) each piece of it arrived."""
    path, fields = SURFACES[surface]
    arrivals, chunks = [], []
    started = time.monotonic()
    with httpx.stream("POST", base + path, json={"model": "b", "stream": True, **fields}, timeout=60) as response:
        into[surface + ":status"] = response.status_code
        for chunk in response.iter_raw():
            arrivals.append(time.monotonic() - started)
            chunks.append(chunk)
    into[surface] = (b"".join(chunks), arrivals)


def test_streams_for_a_loading_model_get_keep_alives_then_its_answer(tmp_path, tiny_model_dir, second_model_dir):
    config = two_models(tmp_path, tiny_model_dir, second_model_dir)  # [server] keepalive_s = 0.5
    with slow_load_server(config) as base:
        got: dict = {}
        waiting = threading.Thread(target=lambda: got.update(plain=httpx.post(
            base + "/v1/completions", json={"model": "b", "prompt": PROMPT}, timeout=60)))
        threads = [threading.Thread(target=stream_timed, args=(base, surface, got)) for surface in SURFACES]
        for thread in [*threads, waiting]:
            thread.start()
        for thread in [*threads, waiting]:
            thread.join(90)
        assert not [thread for thread in [*threads, waiting] if thread.is_alive()], got.keys()
        status = httpx.get(base + "/v1/status").json()
        assert {m["name"]: m["num_loads"] for m in status["models"]}["b"] == 1  # one load served them all
        for surface, (path, fields) in SURFACES.items():
            body, arrivals = got[surface]
            assert got[surface + ":status"] == 200, body
            num_comments = 0
            while body.startswith(KEEPALIVE, num_comments * len(KEEPALIVE)):
                num_comments += 1
            # The stream opens with comments sent while the load ran (at least three, before any frame): the first
            # within about one keep-alive interval, not after the load's seconds of silence, and none more than a
            # few intervals apart.
            assert num_comments >= 3, (surface, body)
            assert arrivals[0] < LOAD_S / 2, (surface, arrivals)
            load_arrivals = [t for t in arrivals if t < LOAD_S]
            assert max(b - a for a, b in zip(load_arrivals, load_arrivals[1:], strict=False)) < 2.0, arrivals
            assert ends_whole(surface, body), body[-300:]
            # What came after the wait is what the loaded model answers.
            answer = httpx.post(base + path, json={"model": "b", **fields}, timeout=60)
            assert answer.status_code == 200 and text_of(surface, body) == final_text(surface, answer.json())
        plain = got["plain"]
        assert plain.status_code == 200 and plain.content.startswith(b"{")  # waited, no keep-alive in JSON
        assert plain.json()["model"] == "b" and plain.json()["choices"][0]["text"]
    # The requests that waited say so in their log lines, and their times count from their arrival.
    lines = [msgspec.json.decode(line) for line in (config.parent / "server.log").read_bytes().splitlines()
             if line.startswith(b"{")]
    waited = [line for line in lines if line["event"] == "request" and line.get("model_wait_s") is not None]
    assert len(waited) == len(SURFACES) + 1 and {line["model"] for line in waited} == {"b"}, waited
    assert all(LOAD_S * 0.75 <= line["model_wait_s"] <= line["ttft_s"] <= line["total_s"] for line in waited), waited


@contextlib.contextmanager
def slow_client(config: Path, **slow) -> Iterator[TestClient]:
    from mlxd.api.app import create_app
    from mlxd.assemble import load_everything
    from mlxd.daemon import Daemon

    loaded, pipeline = load_everything(config)
    daemon = Daemon(loaded, pipeline, base_dir=config.parent, make_engine=slow_engines(**slow))
    with TestClient(create_app(daemon), timeout=60) as client:
        daemon.wait_loaded(120)
        assert daemon.ready, daemon.error
        yield client


def test_a_load_that_fails_while_a_stream_waits_ends_it_with_the_api_s_error_frame(tmp_path, tiny_model_dir,
                                                                                   second_model_dir):
    with slow_client(two_models(tmp_path, tiny_model_dir, second_model_dir), load_s=1.5, fail=True) as client:
        for surface, (path, fields) in SURFACES.items():
            response = client.post(path, json={"model": "b", "stream": True, **fields})
            assert response.status_code == 200  # the stream was open before the load failed
            body = response.content
            assert body.startswith(KEEPALIVE) and b"failed to load after 1.5 s" in body, body
            frames = [f for f in sse_events(body.decode()) if isinstance(f, dict)]
            if surface in ("chat", "completions"):
                assert frames[-1]["error"]["type"] == "service_unavailable" and ends_whole(surface, body)
            elif surface == "messages":
                assert frames[-1]["type"] == "error" and frames[-1]["error"]["type"] == "overloaded_error"
            else:
                assert frames[-1]["type"] == "response.failed" and frames[-1]["response"]["status"] == "failed"


@pytest.mark.parametrize("surface", list(SURFACES))
def test_a_stream_for_a_model_that_cannot_fit_gets_503_in_its_api_s_shape(tmp_path, tiny_model_dir, second_model_dir,
                                                                        surface):
    from tests.helpers import app_client

    one = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, a_extra="pin = true",
                        server_extra=f"models_memory_bytes = {int(one * 1.5)}")
    path, fields = SURFACES[surface]
    with app_client(config) as (client, _):
        response = client.post(path, json={"model": "b", "stream": True, **fields})
        assert response.status_code == 503 and float(response.headers["retry-after"]) >= 1
        body = msgspec.json.decode(response.content)
        error = body["error"]
        if surface == "messages":
            assert body["type"] == "error" and error["type"] == "overloaded_error"
        else:
            assert error["type"] == "service_unavailable"
        assert "models_memory_bytes" in error["message"]


def test_a_bad_body_for_a_loading_model_is_a_400_before_any_stream(tmp_path, tiny_model_dir, second_model_dir):
    with slow_client(two_models(tmp_path, tiny_model_dir, second_model_dir), load_s=1.5) as client:
        response = client.post("/v1/chat/completions", json={"model": "b", "stream": True, "messages": []})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
