"""Connections are bounded before any key is checked: header size, header and body read deadlines, a connection limit
below the descriptor limit, and refused connections logged once per interval (mlxd/runtime/connections.py)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxd.runtime.descriptors import MAX_DERIVED_CONNECTIONS, accept_backlog, connection_limit
from tests.helpers import free_port, serve_subprocess, stop_process, wait_healthy, write_config
from tests.helpers import log_lines as events

TIMEOUTS = "header_timeout_s = 2\nbody_timeout_s = 2\n"
# Long enough for the test to open every connection the server takes before the first of them expires.
HEADER_TIMEOUT = 6
# mlx-lm sets the descriptor limit to (2048, 4096) when mlx_lm.utils is imported, which fails under a lower hard
# limit: the daemon lowers its limit after that import (and, without OpenBLAS, is not re-executed, which would
# import it again).
LOWERED = ("import resource, sys, mlx_lm.utils; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
           "from mlxd.cli import main; sys.exit(main(sys.argv[1:]))")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def connect(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    chunks = []
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, read off a connection that stays open."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, int, subprocess.Popen, Path]]:
    tmp = tmp_path_factory.mktemp("connections")
    port = free_port()
    config = write_config(tmp, tiny_model_dir, port=port, server_extra=TIMEOUTS)
    log = tmp / "mlxd.log"
    with serve_subprocess(config, port, args=["--log-file", str(log)]) as (base, proc):
        yield base, port, proc, log


def test_headers_above_the_limit_get_431_and_below_it_are_served(server):
    _, port, _, _ = server
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    with connect(port, head + b"X-Pad: " + b"a" * 60_000 + b"\r\n\r\n") as sock:
        assert read_all(sock, 10).startswith(b"HTTP/1.1 200 ")
    with connect(port, head + b"X-Pad: " + b"a" * 70_000 + b"\r\n\r\n") as sock:
        assert read_all(sock, 10).startswith(b"HTTP/1.1 431 ")
    with connect(port, head + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(70)) + b"\r\n") as sock:
        assert read_all(sock, 10).startswith(b"HTTP/1.1 431 ")


def test_invalid_requests_get_400_and_are_counted_not_logged_each(server):
    _, port, _, log = server
    for _ in range(50):
        with connect(port, b"NOT HTTP AT ALL\r\n\r\n") as sock:
            assert read_all(sock, 10).startswith(b"HTTP/1.1 400 ")
    assert "Invalid HTTP request" not in log.read_text()


def test_a_256_mb_header_is_refused_without_being_read(server):
    base, port, proc, _ = server
    before = rss_bytes(proc.pid)
    sent, chunk = 0, b"a" * (1 << 20)
    with connect(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ") as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            while sent < 256 << 20:
                sock.sendall(chunk)
                sent += len(chunk)
        answer = read_all(sock, 10)
    assert sent < 32 << 20, f"the server took {sent >> 20} MB of one header"  # what loopback buffers hold, at most
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert rss_bytes(proc.pid) - before < 32 << 20
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_an_upload_that_never_finishes_gets_408_after_the_body_deadline(server):
    _, port, _, _ = server
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    with connect(port, head + b'{"model": "tiny", "prompt": "') as sock:
        started = time.monotonic()
        answer = read_all(sock, 15)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert 1.5 < waited < 6


def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_header_deadline(server):
    _, port, _, _ = server
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 100
    with connect(port) as sock:
        started, answer = time.monotonic(), b""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
                if time.monotonic() - started > 6:
                    break
        answer = read_all(sock, 5)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert 1.5 < waited < 6


def test_keep_alive_requests_on_one_connection_are_still_served(server):
    _, port, _, _ = server
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(port) as sock:
        for _ in range(3):
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(1)  # together longer than the header deadline: it runs per request, not per connection


def test_a_pipelined_request_waits_for_the_response_before_it_without_its_header_clock_running(server):
    _, port, _, _ = server
    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1500}).encode()
    first = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n" % len(body) + body)
    with connect(port, first + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n") as sock:  # the second, half sent
        started = time.monotonic()
        answer = read_response(sock)
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 1500
        sock.sendall(b"\r\n")  # the second request completes in time: its clock started with the first's answer
        assert read_response(sock).startswith(b"HTTP/1.1 200 "), f"the first took {took:.1f} s"


def dropped(log: Path) -> list[dict]:
    return [e for e in events(log) if e["event"] == "connections_dropped"]


def exhaust(port: int, log: Path, num: int = 400) -> list[socket.socket]:
    """Connections that each sent part of a request line, opened one after another until the server logs that it
    refused one (out of descriptors, or at its connection limit), or a connect fails."""
    socks = []
    for _ in range(num):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            socks.append(sock)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        except OSError:
            break
        if any(set(line) - {"header_timeout", "interval_s", "event", "level", "timestamp"} for line in dropped(log)):
            break
    return socks


@pytest.mark.parametrize("max_connections", [0, 1000], ids=["derived-limit", "limit-above-descriptors"])
def test_descriptor_exhaustion_floods_no_log_and_new_clients_are_served_after_the_header_deadline(
        tiny_model_dir, tmp_path, max_connections):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port,
                          server_extra=f"header_timeout_s = {HEADER_TIMEOUT}\nmax_connections = {max_connections}\n")
    log, out = tmp_path / "mlxd.log", tmp_path / "out.log"
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-c", LOWERED.format(n=128), "--config", str(config), "--log-file", str(log)],
            stdout=stdout, stderr=subprocess.STDOUT, env={**os.environ, "MLXD_OPENBLAS": "0"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 120, out)
        size = log.stat().st_size + out.stat().st_size
        socks = exhaust(port, log)
        opened = time.monotonic()
        served = None
        while served is None and time.monotonic() - opened < 20:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    served = time.monotonic() - opened
            time.sleep(0.2)
        growth = log.stat().st_size + out.stat().st_size - size
        for sock in socks:
            sock.close()
        assert proc.poll() is None
    finally:
        stop_process(proc)
    assert served is not None and served < HEADER_TIMEOUT + 4, f"no new client served {served} s after the exhaustion"
    assert growth < 100_000, f"the log grew by {growth} bytes"
    lines = dropped(log)
    assert sum(e.get("header_timeout", 0) for e in lines) > 0, lines
    assert any(e.get("connection_limit" if max_connections == 0 else "accept_emfile") for e in lines), lines
    limits = next(e for e in events(log) if e["event"] == "connection_limits")
    assert limits["max_connections"] == (64 if max_connections == 0 else 1000)


def test_the_connection_limit_leaves_a_reserve_of_descriptors():
    assert connection_limit(0, 128) == 64  # at least 64 kept
    assert connection_limit(0, 4096) == 4096 - 512  # an eighth kept
    assert connection_limit(0, 1 << 20) == MAX_DERIVED_CONNECTIONS
    assert connection_limit(300, 128) == 300  # a setting is used as it is (start-up warns when it is too high)
    assert accept_backlog(128, 64) == 32 and accept_backlog(1 << 20, 4096) == 2048 and accept_backlog(128, 300) == 16


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    script = ("import resource; from mlxd.runtime.descriptors import raise_descriptor_limit; "
              "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 200)); "
              "print(raise_descriptor_limit((64, 200)), resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "DescriptorLimit(soft=200, hard=200, was_soft=64, was_hard=200) (200, 200)"


def _lower_hard_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def _may_raise_hard_limits() -> bool:
    probe = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))"
    return subprocess.run([sys.executable, "-c", probe], preexec_fn=_lower_hard_limit, capture_output=True,
                          timeout=60, check=False).returncode == 0


@pytest.mark.parametrize("command", [["check-config"], ["--config"]], ids=["check-config", "serve"])
def test_a_hard_descriptor_limit_below_what_mlx_lm_sets_is_a_config_error_naming_the_fix(tmp_path, command):
    if _may_raise_hard_limits():  # privileged (CAP_SYS_RESOURCE): the check raises the limit for mlx-lm instead
        script = ("import resource; from mlxd.runtime.descriptors import check_mlx_lm_can_load; "
                  "check_mlx_lm_can_load(); import mlx_lm.utils; print(resource.getrlimit(resource.RLIMIT_NOFILE))")
        result = subprocess.run([sys.executable, "-c", script], preexec_fn=_lower_hard_limit, capture_output=True,
                                text=True, timeout=120, check=False)
        assert result.stdout.strip() == "(2048, 4096)", result.stderr[-2000:]
        return
    config = tmp_path / "mlxd.toml"
    config.write_text('[model]\nsource = "embedded:smollm2-135m"\n')
    result = subprocess.run([sys.executable, "-m", "mlxd", *command, str(config)], preexec_fn=_lower_hard_limit,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "the hard limit on open files is 1024" in result.stderr and "ulimit -Hn" in result.stderr
