"""Prompt work survives a disconnect: the chunks a request finished before its client left stay in the prefix
cache, the same request sent again starts after them and answers what a cold run answers, and the engine's account
of the request that left says what it had computed and how long it spent (issue 37).

The engine is driven here one command at a time (:class:`EngineCore`), so that "the client left after two of five
chunks" is exact, not a race with the engine thread."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from structlog.testing import capture_logs

from mlxd.api import respond
from mlxd.api.respond import ClientDisconnected, Trace
from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Finished, RequestHandle
from mlxd.engine.commands import Accept, Cancel, Clear, Evict, RequestSpec
from mlxd.engine.core import EngineCore
from mlxd.engine.prefix import PromptReuse
from mlxd.engine.requests import Submitted
from mlxd.engine.schedule.scheduler import SequenceState
from mlxd.engine.step.sampling import make_request_sampler
from mlxd.pipeline.job import Job
from tests.helpers import ROOT, collect, free_port, log_lines, wait_healthy, write_config

CHUNK = 16
NUM_CHUNKS = 5
MAX_TOKENS = 6


class Commands:
    """The engine side of a :class:`RequestHandle` for a core driven by hand: a cancellation is applied at once,
    between steps, as the engine thread applies it."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.core.apply(Cancel(request_id, reason))
        self.core.table.send()


def make_core(model: Any) -> EngineCore:
    core = EngineCore(model, EngineConfig(max_running=2, prefill_chunk=CHUNK, prefix_cache_min_tokens=32),
                      make_sampler=make_request_sampler)
    core.warm_up()
    return core


def ask(request_id: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt=prompt, max_tokens=MAX_TOKENS, prefill_chunk=CHUNK)


def submit(core: EngineCore, request: EngineRequest, ended: list) -> RequestHandle:
    """What :meth:`BatchedEngine.submit` and the engine thread do with a new request: hold it pending, accept it."""
    request.on_end = ended.append
    handle = RequestHandle(request.request_id, Commands(core), asyncio.get_running_loop(), on_end=request.on_end)
    core.table.pending[request.request_id] = Submitted(request, handle, SequenceState.for_request(request))
    core.apply(Accept(RequestSpec.of(request)))
    return handle


def step(core: EngineCore) -> None:
    core.apply(core.plan())
    core.table.send()


async def events_of(handle: RequestHandle) -> tuple[list[int], Finished]:
    """The tokens and the final event a handle has received (every step has run: nothing is left to wait for)."""
    await asyncio.sleep(0)  # the engine's events reach the handle through the event loop
    return await collect(handle)


async def run_to_end(core: EngineCore, request: EngineRequest) -> tuple[list[int], Finished]:
    ended: list = []
    handle = submit(core, request, ended)
    for _ in range(NUM_CHUNKS + MAX_TOKENS + 2):
        if not core.scheduler.has_work:
            break
        step(core)
    tokens, finished = await events_of(handle)
    assert ended == [finished]
    return tokens, finished


async def disconnect_after(core: EngineCore, request: EngineRequest, num_chunks: int) -> Finished:
    """Submit ``request``, run ``num_chunks`` of its prompt chunks, then its client leaves."""
    ended: list = []
    handle = submit(core, request, ended)
    for _ in range(num_chunks):
        step(core)
    handle.cancel()
    tokens, finished = await events_of(handle)
    assert tokens == [] and ended == [finished]  # on_end hears the end, though nobody read the stream
    return finished


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_qwen3_next_dir"])
def test_a_retry_after_a_disconnect_resumes_after_the_finished_chunks(model_fixture, request):
    """Five prompt chunks; the client leaves after two. The same request again starts after those two chunks (a
    trimmable attention cache, and a hybrid one whose recurrent layers are snapshotted at chunk boundaries) and
    answers, greedy, exactly what a cold run answers."""
    model, tokenizer = load(str(request.getfixturevalue(model_fixture)))
    prompt = (tokenizer.encode("A long agent prompt, read before the first answer. " * 30) * 2)[: CHUNK * NUM_CHUNKS]
    assert len(prompt) == CHUNK * NUM_CHUNKS
    core = make_core(model)

    async def go() -> None:
        left = await disconnect_after(core, ask("first", prompt), num_chunks=2)
        assert left.reason == "cancelled" and left.num_cached_tokens == 0
        assert left.num_prompt_computed == 2 * CHUNK
        assert left.queued_s is not None and left.queued_s >= 0 and left.prefill_s is not None and left.prefill_s > 0
        assert core.table.totals["num_cancelled"] == 1 and not core.scheduler.has_work

        tokens, retried = await run_to_end(core, ask("retry", prompt))
        assert retried.cache_hit == "prefix" and retried.num_cached_tokens >= 2 * CHUNK
        assert retried.num_prompt_computed == len(prompt) - retried.num_cached_tokens

        core.apply(Clear())
        cold_tokens, cold = await run_to_end(core, ask("cold", prompt))
        assert cold.num_cached_tokens == 0 and cold.num_prompt_computed == len(prompt)
        assert len(tokens) == MAX_TOKENS and tokens == cold_tokens

    asyncio.run(go())


def test_the_kept_chunks_are_evictable_like_any_entry(tiny_model_dir):
    """What a disconnected request left in the prefix cache counts in its bytes and gives way when memory is
    needed: after an eviction the retry computes its whole prompt again (and still answers the same)."""
    model, tokenizer = load(str(tiny_model_dir))
    prompt = tokenizer.encode("Evictable prompt work, kept when the client left. " * 20)[: CHUNK * NUM_CHUNKS]
    core = make_core(model)

    async def go() -> None:
        await disconnect_after(core, ask("first", prompt), num_chunks=2)
        stats = core.reuse.stats()
        assert stats["num_entries"] == 1 and 0 < stats["num_bytes"] <= stats["budget_bytes"]
        core.apply(Evict(0))
        assert core.reuse.num_bytes == 0
        _, again = await run_to_end(core, ask("again", prompt))
        assert again.cache_hit == "miss" and again.num_prompt_computed == len(prompt)

    asyncio.run(go())


def test_a_request_cancelled_in_the_queue_says_how_long_it_waited(tiny_model_dir):
    """Never admitted: nothing computed, its wait counted until it ended, no prompt time."""
    model, tokenizer = load(str(tiny_model_dir))
    core = make_core(model)

    async def go() -> None:
        left = await disconnect_after(core, ask("queued", tokenizer.encode("Hello")), num_chunks=0)
        assert left.num_prompt_computed == 0 and left.queued_s is not None and left.prefill_s == 0.0

    asyncio.run(go())


def keep_chunks(model: Any, reuse: PromptReuse, prompt: list[int], ends: list[int], start: int = 0, **kept: Any):
    """Run ``prompt`` chunk by chunk (ending at ``ends``) into a fresh cache, keeping each chunk as serving does."""
    cache = make_prompt_cache(model)
    for end in ends:
        model(mx.array(prompt[start:end])[None], cache=cache)
        mx.eval([layer.state for layer in cache])
        reuse.keep_chunk(prompt, start, end, cache, **kept)
        start = end


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_qwen3_next_dir"])
def test_a_prompt_keeps_one_chunk_snapshot_besides_its_checkpoints(model_fixture, request):
    """However many chunks a prompt has, it leaves one chunk snapshot (its furthest) in the prefix cache, plus, for
    a cache that cannot be trimmed, its checkpoints (the end of a message), which serve other continuations; the
    furthest serves the same prompt sent again."""
    model, tokenizer = load(str(request.getfixturevalue(model_fixture)))
    hybrid = model_fixture == "tiny_qwen3_next_dir"
    prompt = tokenizer.encode("Chunk after chunk of one long prompt, kept as it goes in. " * 20)[:80]
    reuse = PromptReuse(64 * 2**20)
    keep_chunks(model, reuse, prompt, [16, 32, 40, 56, 72], checkpoints=(40,))
    stats = reuse.stats()
    assert stats["num_entries"] == (2 if hybrid else 1), stats
    again = reuse.lookup(prompt)
    assert again.kind == "prefix" and again.num_cached == 72
    edited = reuse.lookup(prompt[:40] + tokenizer.encode(" and then something else entirely"))
    assert edited.num_cached == 40

    # A request that starts from a cached state leaves that state there (other prompts part from it).
    reuse.clear()
    keep_chunks(model, reuse, prompt, [16])
    keep_chunks(model, reuse, prompt, [16, 32, 48], num_cached=16)
    assert reuse.lookup(prompt[:16] + [7] * 8).num_cached == 16
    assert reuse.stats()["num_entries"] == (2 if hybrid else 1)


def left_trace() -> Trace:
    """The trace of a request the engine took on and whose client then left."""
    job = Job("req-1", "tiny", prompt_ids=list(range(80)))
    trace = Trace(job, "completions", started=time.monotonic(), in_engine=True)
    trace.fail(ClientDisconnected("the client disconnected"))
    return trace


def test_the_line_of_a_client_that_left_waits_for_the_engines_account():
    async def go() -> list[dict[str, Any]]:
        trace = left_trace()
        with capture_logs() as logs:
            trace.log()
            await asyncio.sleep(0.05)
            assert not [e for e in logs if e["event"] == "request"]  # the engine has not let it go yet
            trace.engine_ended(Finished(reason="cancelled", num_prompt_tokens=80, num_cached_tokens=16,
                                        cache_hit="prefix", num_prompt_computed=32, queued_s=0.01, prefill_s=1.5))
            await asyncio.sleep(0.01)
        return [e for e in logs if e["event"] == "request"]

    (line,) = asyncio.run(go())
    assert line["outcome"] == "client disconnected" and line["finish_reason"] == "cancelled"
    assert (line["cached_tokens"], line["prompt_tokens_computed"], line["cache_hit"]) == (16, 32, "prefix")
    assert (line["queued_s"], line["prefill_s"]) == (0.01, 1.5)


def test_without_the_engines_account_the_line_is_written_after_a_bounded_wait(monkeypatch):
    monkeypatch.setattr(respond, "ENGINE_ACCOUNT_WAIT_S", 0.05)

    async def go() -> list[dict[str, Any]]:
        with capture_logs() as logs:
            left_trace().log()
            await asyncio.sleep(0.3)
        return [e for e in logs if e["event"] == "request"]

    (line,) = asyncio.run(go())
    assert line["outcome"] == "client disconnected" and line["prompt_tokens_computed"] is None


# ---- over HTTP: a streaming client that closes its socket after two of five chunks ----


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, int, Path]]:
    """A server whose prompt chunks take 0.25 s each (:mod:`tests.slow_prompt_server`), so that a client can leave
    between chunks; yields its base URL, port and JSON log."""
    tmp = tmp_path_factory.mktemp("disconnect_resume")
    port = free_port()
    config = write_config(tmp, tiny_model_dir, port=port, extra=f"[engine]\nprefill_chunk = {CHUNK}\nprefix_cache_min_tokens = 32\n")
    log_path = tmp / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.slow_prompt_server", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 180, log_path)
        yield base, port, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request_lines(log_path: Path) -> list[dict[str, Any]]:
    lines = log_lines(log_path)
    return [line for line in lines if line.get("event") == "request"]


def wait_until(what: str, found: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := found()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)
    return result


def stream_then_leave(port: int, body: dict[str, Any], base: str, num_tokens: int) -> None:
    """POST a streaming completion over a raw socket; close it once the engine has processed ``num_tokens`` of
    its prompt (``/v1/status``), before a first token can come."""
    payload = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def prefilled() -> bool:
        running = httpx.get(base + "/v1/status", timeout=10).json()["running"]
        return bool(running) and running[0]["num_prefilled_tokens"] >= num_tokens

    wait_until(f"{num_tokens} prompt tokens processed", prefilled)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def test_the_log_line_of_a_client_that_left_says_what_it_computed_and_its_retry_resumes(slow_server):
    """A streaming client leaves after two of its prompt's five chunks. Its request log line says how it ended,
    what it got from the prefix cache (nothing), the prompt tokens computed when it left and its time queued and
    in its prompt; the same request again reports those tokens cached (usage and log line) and answers what a
    cold run answers."""
    base, port, log_path = slow_server
    body = {"model": "tiny", "prompt": list(range(5, 5 + CHUNK * NUM_CHUNKS)), "max_tokens": MAX_TOKENS,
            "temperature": 0}
    httpx.delete(base + "/v1/cache", timeout=10).raise_for_status()
    stream_then_leave(port, body, base, 2 * CHUNK)
    (left,) = wait_until("the request line of the client that left", lambda: [
        line for line in request_lines(log_path) if line["outcome"] == "client disconnected"])
    assert left["finish_reason"] == "cancelled" and left["prompt_tokens"] == CHUNK * NUM_CHUNKS
    assert left["cached_tokens"] == 0 and left["cache_hit"] == "miss"
    assert 2 * CHUNK <= left["prompt_tokens_computed"] < CHUNK * NUM_CHUNKS
    assert left["queued_s"] is not None and left["queued_s"] >= 0 and left["prefill_s"] > 0
    assert left["completion_tokens"] is None and left["ttft_s"] is None

    retry = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    cached = retry["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= left["prompt_tokens_computed"] >= 2 * CHUNK
    retry_line = wait_until("the retry's request line", lambda: [
        line for line in request_lines(log_path) if line["request_id"] == retry["id"]])[0]
    assert retry_line["cached_tokens"] == cached and retry_line["outcome"] == "ok"
    assert retry_line["prompt_tokens_computed"] == CHUNK * NUM_CHUNKS - cached

    httpx.delete(base + "/v1/cache", timeout=10).raise_for_status()
    cold = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert retry["choices"][0]["text"] == cold["choices"][0]["text"]
