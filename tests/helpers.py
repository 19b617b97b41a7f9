"""Helpers shared by tests: configs for tiny models, an in-process app, a subprocess server."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
from litestar.testing import TestClient

from mlxd.cli import load_everything
from mlxd.daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent
CHAT_PIPELINE = ROOT / "mlxd" / "pipelines" / "chat.toml"


def benchmark_module(name: str) -> Any:
    """``benchmarks/NAME.py`` imported as a module (the benchmarks are scripts, not a package), registered as
    ``bench_NAME``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)
    return module


# For tests of prefix-cache hits on short prompts: reuse any cached state, however short (by default a state is
# reused only when it covers 64 tokens or more: [engine] prefix_cache_min_tokens).
SHORT_HITS = "[engine]\nprefix_cache_min_tokens = 1\n"


def write_config(tmp: Path, model_dir: Path, *, pipeline: str | None = None, extra: str = "",
                 model_extra: str = "", server_extra: str = "", port: int = 8080) -> Path:
    """A daemon config for a tiny model; greedy by default so outputs are comparable. ``extra`` is appended
    (whole tables); ``model_extra`` and ``server_extra`` are lines added to ``[model]`` and ``[server]``."""
    pipeline_line = pipeline if pipeline is not None else f'pipeline = "{CHAT_PIPELINE}"'
    text = f"""{pipeline_line}
[server]
port = {port}
keepalive_s = 0.5
{server_extra}
[model]
source = "{model_dir}"
name = "tiny"
aliases = ["gpt-*", "claude-*"]
{model_extra}
[model.sampling]
temperature = 0.0
max_tokens = 24
[logging]
format = "json"
{extra}
"""
    path = tmp / "mlxd.toml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def app_client(config_path: Path) -> Iterator[tuple[TestClient, Daemon]]:
    """The Litestar app in-process, with the model loaded and warmed."""
    from mlxd.api.app import create_app

    config, pipeline = load_everything(config_path)
    daemon = Daemon(config, pipeline, base_dir=config_path.parent)
    with TestClient(create_app(daemon), timeout=60) as client:
        daemon.wait_loaded(120)
        assert daemon.ready, daemon.error
        yield client, daemon


def free_port() -> int:
    """A port free now for a server to bind soon, chosen below the kernel's range of ephemeral ports: a port the
    kernel hands out (bind to 0) can be taken, before the server binds it, as the local end of some other test's
    outgoing connection ("address already in use")."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port found below the ephemeral range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux); 32768 elsewhere, under macOS's 49152 too."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


@contextlib.contextmanager
def serve_subprocess(config_path: Path, port: int, env: dict[str, str] | None = None, timeout: float = 180,
                     args: list[str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m mlxd --config ... --port ... *args`` as a real process; yields (base URL, process)."""
    log_path = config_path.parent / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "--config", str(config_path), "--port", str(port), *(args or [])],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout, log_path)
        yield base, proc
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then kill it if it is still there after 20 s."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise AssertionError(f"server not healthy after {timeout}s:\n{log_path.read_text()}")


def log_lines(path: Path) -> list[dict]:
    """A server's JSON log lines written so far. A line still being written (no newline yet) is left for the next
    read: a test that polls a running server's log would otherwise parse half a line."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.startswith("{")]


def sse_events(text: str) -> list[Any]:
    """Decode the ``data:`` frames of an SSE body (``[DONE]`` kept as the string)."""
    frames = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            frames.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return frames


def streamed_text(frames: list[Any]) -> str:
    out = []
    for frame in frames:
        if isinstance(frame, dict):
            for choice in frame.get("choices", []):
                out.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(out)


async def collect(handle: Any) -> tuple[list[int], Any]:
    """A request handle's tokens and its ``Finished`` event (a ``Failed`` one fails the test)."""
    from mlxd.engine.base import Failed, Finished, Token

    tokens = []
    async for event in handle.events():
        if isinstance(event, Token):
            tokens.append(event.token)
        elif isinstance(event, Finished | Failed):
            assert isinstance(event, Finished), event
            return tokens, event
    raise AssertionError("the stream ended without a final event")


def run_request(engine: Any, request: Any) -> tuple[list[int], Any]:
    """Submit ``request`` to an engine and return its tokens and its ``Finished`` event (a ``Failed`` one fails)."""

    async def go() -> tuple[list[int], Any]:
        return await collect(engine.submit(request))
    return asyncio.run(go())
