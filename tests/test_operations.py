"""Operations: memory given back after bursts, signals that must not kill the daemon, a re-exec that the working
directory cannot shadow, interrupted GGUF conversions cleaned up, early disconnects logged as info."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxd.runtime.blas import ENV_REEXECED
from mlxd.runtime.heap import HeapTrimmer, rss_bytes
from tests.helpers import free_port, stop_process, wait_healthy, write_config
from tests.helpers import log_lines as events

linux_glibc = pytest.mark.skipif(sys.platform != "linux", reason="malloc_trim and /proc are Linux (glibc) only")


@linux_glibc
def test_the_trimmer_gives_back_what_a_burst_freed_in_the_middle_of_the_heap():
    trimmer = HeapTrimmer()
    # Blocks above pymalloc's 512 bytes come from malloc; keeping every tenth one alive leaves the freed memory in
    # the middle of the heap, where free() itself never gives it back.
    blocks = [bytes(16_000) + bytes([i % 256]) for i in range(20_000)]  # 320 MB
    kept = blocks[::10]
    grown = rss_bytes()
    del blocks
    freed = rss_bytes()
    assert grown - freed < 100 << 20  # freeing alone gave little back
    given_back = trimmer.trim_if_grown()
    assert given_back is not None and given_back > 250 << 20, given_back
    assert trimmer.trim_if_grown() is None  # nothing grew since: no second trim
    assert len(kept) == 2_000


SHADOW = 'raise SystemExit("{name}.py in the working directory was imported instead of the installed {name}")\n'


@pytest.fixture(scope="module")
def shadowed_daemon(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, int, subprocess.Popen, Path]]:
    """The daemon started the way a service starts it, from a working directory holding ``litestar.py`` and
    ``msgspec.py`` that end any process importing them."""
    cwd = tmp_path_factory.mktemp("shadowing")
    for name in ("litestar", "msgspec"):
        (cwd / f"{name}.py").write_text(SHADOW.format(name=name))
    port = free_port()
    config = write_config(cwd, tiny_model_dir, port=port)
    log = cwd / "mlxd.log"
    mlxd = Path(sys.executable).with_name("mlxd")  # the console script: no working directory on sys.path
    with open(cwd / "out.log", "wb") as out:
        proc = subprocess.Popen([str(mlxd), "--config", str(config), "--log-file", str(log)], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items()
                                                                if k not in ("PYTHONPATH", ENV_REEXECED)})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 120, cwd / "out.log")
        yield base, port, proc, log
    finally:
        stop_process(proc)


def complete(base: str) -> str:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}
    response = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@linux_glibc
def test_a_module_in_the_working_directory_does_not_shadow_a_dependency_after_the_reexec(shadowed_daemon):
    base, _, proc, _ = shadowed_daemon
    cwd = Path(f"/proc/{proc.pid}/cwd").resolve()
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    assert f"{ENV_REEXECED}=1".encode() in environ  # the process serving is the re-executed one
    complete(base)
    # The control: `python -m` from that folder imports the fake module.
    control = subprocess.run([sys.executable, "-m", "mlxd", "check-config", "mlxd.toml"], cwd=cwd,
                             capture_output=True, text=True, timeout=60, check=False)
    assert control.returncode != 0 and "in the working directory was imported" in control.stderr


@linux_glibc
def test_sigusr1_and_sigusr2_are_logged_and_ignored(shadowed_daemon):
    base, _, proc, log = shadowed_daemon
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR1):
        proc.send_signal(sig)
        time.sleep(0.3)  # two of one kind pending at once would be delivered as one
    assert proc.poll() is None
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    complete(base)
    ignored = [e["signal"] for e in events(log) if e["event"] == "signal_ignored"]
    assert ignored == ["SIGUSR1", "SIGUSR2", "SIGUSR1"]


def test_a_client_that_leaves_before_its_body_is_read_is_an_info_line(shadowed_daemon):
    base, port, _, log = shadowed_daemon
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b'{"model": "tiny", "prompt": "' + b"a" * 70_000)
            time.sleep(0.3)
    deadline = time.monotonic() + 10
    while len([e for e in events(log) if e["event"] == "client_disconnected"]) < 3:
        assert time.monotonic() < deadline, "no client_disconnected lines"
        time.sleep(0.1)
    lines = [e for e in events(log) if e["event"] == "client_disconnected"]
    assert all(e["level"] == "info" and "exception" not in e for e in lines), lines
    assert not [e for e in events(log) if e["level"] == "error"]
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_interrupted_gguf_conversions_are_removed_when_the_daemon_next_loads_a_gguf(tmp_path):
    from mlxd.models import gguf, gguf_temp

    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF stand-in: the converted folder below is already there")
    cache = tmp_path / "cache"
    target = cache / f"model-{gguf._content_digest(source)[:16]}-c{gguf.CONVERTER_VERSION}"
    target.mkdir(parents=True)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    dead = int(ended.stdout)
    day_old = time.time() - 2 * gguf_temp.STALE_TEMP_S
    folders = {  # name: (age, removed?)
        f".{target.name}.tmp-{gguf_temp._HOST}-{dead}-k2j4h1x_": (None, True),
        f".{target.name}.tmp-{gguf_temp._HOST}-{os.getpid()}-a8sd7f6g": (None, False),  # a conversion running now
        f".{target.name}.tmp-otherhost-{dead}-q1w2e3r4": (None, False),  # maybe running on that machine
        f".{target.name}.tmp-otherhost-{dead}-z9x8c7v6": (day_old, True),
        f".{target.name}.ab12cd34": (None, False),  # an older converter's, maybe running
        f".{target.name}.ef56gh78": (day_old, True),
        ".not-a-conversion": (day_old, False),
    }
    for name, (age, _) in folders.items():
        (cache / name).mkdir()
        (cache / name / "model.safetensors").write_bytes(b"half written")
        if age is not None:
            os.utime(cache / name, (age, age))
    assert gguf.ensure_converted(source, cache) == target
    left = {path.name for path in cache.iterdir()}
    assert left == {target.name} | {name for name, (_, removed) in folders.items() if not removed}
