"""Clients that go away: real sockets closed mid-stream and mid-response abort their request, free its memory and
leave the other requests untouched."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import httpx
import pytest
from mlx_lm import generate, load

from tests.helpers import free_port, serve_subprocess, write_config

NO_EOS = {"0": -100.0, "2": -100.0}  # the tiny tokenizer's end-of-sequence ids: keep long requests going
LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20000, "temperature": 0, "logit_bias": NO_EOS}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disconnect")
    port = free_port()
    # max_waiting 128: the storm test opens 100 streams at once, and none of them may be refused with a 429.
    extra = "[engine]\nmax_running = 8\nmax_waiting = 128\n"
    config = write_config(tmp, tiny_model_dir, port=port, extra=extra)
    with serve_subprocess(config, port) as (base, _):
        yield base, port


def status(base: str) -> dict:
    return httpx.get(base + "/v1/status", timeout=10).json()


def wait_for(base: str, predicate, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        current = status(base)
        if predicate(current):
            return current
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting; status: {current}")
        time.sleep(0.02)


def idle(current: dict) -> bool:
    return not current["running"] and not current["waiting"]


def open_request(port: int, body: dict) -> socket.socket:
    """POST /v1/completions over a raw socket; the caller reads what it wants and closes."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    sock.sendall(head + payload)
    return sock


def has_text(received: bytes) -> bool:
    """Whether an SSE frame with generated (non-empty) text is among the bytes received."""
    return b'"text":"' in received.replace(b'"text":""', b"")


def read_until_text(sock: socket.socket) -> None:
    """Read the SSE stream until a frame with generated text has arrived."""
    received = b""
    while not has_text(received):
        chunk = sock.recv(4096)
        assert chunk, f"stream ended early: {received[-500:]!r}"
        received += chunk


def close_now(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def test_closed_stream_is_aborted_and_others_are_untouched(server, tiny_model_dir):
    base, port = server
    model, tokenizer = load(str(tiny_model_dir))
    expected = generate(model, tokenizer, "def fibonacci(n):", max_tokens=48)
    other: dict = {}

    def bystander() -> None:
        body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}
        other["text"] = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    before = status(base)["totals"]["num_cancelled"]
    sock = open_request(port, {**LONG, "stream": True})
    read_until_text(sock)
    thread = threading.Thread(target=bystander)
    thread.start()
    close_now(sock)
    after = wait_for(base, idle)
    thread.join(60)
    assert after["totals"]["num_cancelled"] == before + 1
    assert other["text"] == expected


def test_closed_non_streaming_request_is_aborted(server):
    base, port = server
    before = status(base)["totals"]
    sock = open_request(port, {**LONG, "stream": False})
    running = wait_for(base, lambda s: s["running"] and s["running"][0]["num_generated_tokens"] > 5)
    assert running["running"][0]["phase"] == "decode"
    close_now(sock)
    after = wait_for(base, idle, timeout=5)
    assert after["totals"]["num_cancelled"] == before["num_cancelled"] + 1
    generated = after["totals"]["num_generated_tokens"]
    time.sleep(0.2)
    assert status(base)["totals"]["num_generated_tokens"] == generated  # nothing runs on for it


def test_fifty_cancellations_leave_nothing_running_and_memory_at_baseline(server):
    base, port = server
    httpx.delete(base + "/v1/cache").raise_for_status()  # what earlier tests left there
    baseline = wait_for(base, idle)
    # At most max_running (8) streams at a time, read in order: a stream being read never waits in the queue behind
    # later streams that nobody reads yet (those would run their 20000 tokens first). Streams still queued behind
    # the previous group's cancellations, prefilling or decoding are closed.
    for start in range(0, 50, 8):
        socks = [open_request(port, {**LONG, "stream": True, "prompt": "word " * (5 + 40 * i)})
                 for i in range(min(8, 50 - start))]
        for i, sock in enumerate(socks):
            if (start + i) % 3:
                read_until_text(sock)
            close_now(sock)
    # A socket closed before the server read its body never becomes a request (the ASGI server reports the
    # disconnect first); every request that did reach the engine must end cancelled. The 33 streams read until
    # their first text certainly did.
    def all_cancelled(current: dict) -> bool:
        num_new = current["totals"]["num_requests"] - baseline["totals"]["num_requests"]
        return idle(current) and current["totals"]["num_cancelled"] - baseline["totals"]["num_cancelled"] == num_new

    wait_for(base, all_cancelled)
    time.sleep(0.5)  # nothing arrives late
    after = wait_for(base, all_cancelled)
    assert 33 <= after["totals"]["num_cancelled"] - baseline["totals"]["num_cancelled"] <= 50
    # Cancelled requests keep their processed prompt chunks in the prefix cache, within its budget; dropping
    # the cache returns memory to the baseline exactly.
    kept = httpx.get(base + "/v1/cache/stats").json()
    assert kept["num_bytes"] <= kept["budget_bytes"]
    # (the allocator rounds each buffer up a little, hence the 5% slack)
    assert after["memory"]["active_bytes"] <= baseline["memory"]["active_bytes"] + 1.05 * kept["num_bytes"]
    httpx.delete(base + "/v1/cache").raise_for_status()
    assert status(base)["memory"]["active_bytes"] == baseline["memory"]["active_bytes"]


def greedy_text(base: str) -> str:
    body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}
    return httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def close_each_at_its_first_text(socks: list[socket.socket], timeout: float) -> None:
    """Watch every stream at once; close each the moment its first generated text arrives."""
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, bytearray())
        deadline = time.monotonic() + timeout
        while selector.get_map():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{len(selector.get_map())} streams got no text within {timeout}s"
            for key, _ in selector.select(timeout=remaining):
                sock, received = key.fileobj, key.data
                chunk = sock.recv(65536)
                assert chunk, f"stream ended early: {bytes(received[-500:])!r}"
                received += chunk
                if has_text(received):
                    selector.unregister(sock)
                    close_now(sock)


def test_a_storm_of_one_hundred_disconnects_leaves_the_engine_as_it_was(server):
    """100 streams open at once (the server's max_waiting is 128, so none is refused: 8 run, the rest queue),
    each closed right after its first generated text arrives. Afterwards nothing runs or waits, every request was
    cancelled exactly once, the next greedy output equals the one before the storm, and once the prefix cache
    (where cancelled requests keep their prompt work, by design) is dropped, memory is back at the baseline."""
    base, port = server
    httpx.delete(base + "/v1/cache").raise_for_status()
    wait_for(base, idle)
    expected = greedy_text(base)
    httpx.delete(base + "/v1/cache").raise_for_status()
    baseline = wait_for(base, idle)
    started = time.monotonic()
    bodies = [{**LONG, "stream": True, "prompt": f"Story {i}: " + "once upon a time " * (i % 13)} for i in range(100)]
    close_each_at_its_first_text([open_request(port, body) for body in bodies], timeout=50)
    after = wait_for(base, idle, timeout=10)
    assert time.monotonic() - started < 60
    assert after["totals"]["num_cancelled"] == baseline["totals"]["num_cancelled"] + 100
    assert after["totals"]["num_failed"] == baseline["totals"]["num_failed"]
    assert after["memory"]["kv_reserved_bytes"] == 0
    assert greedy_text(base) == expected  # with the storm's snapshots still in the prefix cache
    httpx.delete(base + "/v1/cache").raise_for_status()
    assert status(base)["memory"]["active_bytes"] == baseline["memory"]["active_bytes"]
