"""The daemon's lifecycle as an operator sees it: a huge prompt never stalls the server, a missing or unloadable
model exits non-zero, SIGTERM drains within `drain_timeout_s` and exits 0 (skipping the interpreter's teardown), a
second signal exits at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn

from mlxd.api.app import create_app
from mlxd.cli import load_everything
from mlxd.daemon import Daemon
from tests.helpers import free_port, log_lines, serve_subprocess, sse_events, wait_healthy, write_config

NO_EOS = {"0": -100.0, "2": -100.0}  # the tiny tokenizer's end-of-sequence ids: keep long requests going


@contextlib.contextmanager
def serve_in_thread(config_path: Path) -> Iterator[tuple[str, Daemon]]:
    """The app under uvicorn on a thread of this process: real sockets, and the daemon object at hand."""
    config, pipeline = load_everything(config_path)
    port = free_port()
    daemon = Daemon(config, pipeline, base_dir=config_path.parent)
    server = uvicorn.Server(uvicorn.Config(create_app(daemon), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not (daemon.ready and _healthy(base)):
            assert time.monotonic() < deadline and daemon.state != "failed", daemon.error
            time.sleep(0.1)
        yield base, daemon
    finally:
        server.should_exit = True
        thread.join(30)


def _healthy(base: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(base + "/health", timeout=2).status_code == 200
    return False


class TokenizerSpy:
    """Wraps the template stage's tokenizer and records the size of every text handed to it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.sizes: list[int] = []

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self.sizes.append(len(text))
        return self._tokenizer.encode(text, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict], *args: Any, **kwargs: Any) -> Any:
        self.sizes.append(sum(len(str(m.get("content") or "")) for m in messages))
        return self._tokenizer.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def template_stage(daemon: Daemon) -> Any:
    return next(stage for name, stage in daemon.pipeline.stages if name == "template")


def test_ten_megabyte_prompt_is_refused_without_tokenizing_and_health_stays_fast(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, model_extra="context_length = 2048")
    with serve_in_thread(config) as (base, daemon):
        stage = template_stage(daemon)
        spy = stage.tokenizer = TokenizerSpy(stage.tokenizer)
        huge = "lorem ipsum " * (10 * 1024 * 1024 // 12)
        result: dict[str, Any] = {}

        def post() -> None:
            started = time.monotonic()
            body = {"model": "tiny", "messages": [{"role": "user", "content": huge}]}
            result["response"] = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            result["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=post)
        thread.start()
        latencies = []
        with httpx.Client(base_url=base, timeout=10) as health:
            while thread.is_alive() or len(latencies) < 5:
                started = time.monotonic()
                assert health.get("/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.01)
        thread.join()
        response = result["response"]
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["type"] == "context_length_exceeded" and error["param"] == "messages"
        assert "2048-token context" in error["message"]
        assert all(size < 1_000_000 for size in spy.sizes), spy.sizes  # never rendered nor tokenized
        print(f"10 MB prompt refused in {result['seconds']:.2f} s; /health max latency {max(latencies) * 1000:.0f} ms "
              f"over {len(latencies)} calls")
        assert max(latencies) < 0.5
        # A prompt that fits is still served, through the same tokenizer.
        ok = httpx.post(base + "/v1/chat/completions", timeout=60,
                        json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert ok.status_code == 200 and spy.sizes


def test_missing_model_exits_non_zero_before_binding(tmp_path):
    config = write_config(tmp_path, tmp_path / "no-such-model", port=free_port())
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mlxd", "--config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "not found" in result.stderr
    assert time.monotonic() - started < 60
    checked = subprocess.run([sys.executable, "-m", "mlxd", "check-config", str(config)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 2 and "not found" in checked.stderr


def test_unloadable_model_exits_one(tmp_path):
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    port = free_port()
    config = write_config(tmp_path, folder, port=port)
    result = subprocess.run([sys.executable, "-m", "mlxd", "--config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert any(e["event"] == "model_load_failed" for e in events)
    assert any(e["event"] == "shutdown" and e.get("exit_code") == 1 for e in events)


def _stream(base: str, body: dict, out: dict, key: int) -> None:
    """Read a stream into ``out[key]``; a connection cut short is recorded, not raised (a thread cannot raise)."""
    try:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            out[key] = {"status": response.status_code, "text": ""}
            for chunk in response.iter_text():
                out[key]["text"] += chunk
    except httpx.HTTPError as e:
        out.setdefault(key, {"status": None, "text": ""})["cut"] = type(e).__name__


def _has_text(entry: dict | None) -> bool:
    return entry is not None and '"text":"' in entry["text"].replace('"text":""', "")


def test_sigterm_drains_then_exits_zero(tiny_model_dir, tmp_path):
    port = free_port()
    extra = "[engine]\nmax_running = 8\n"
    config = write_config(tmp_path, tiny_model_dir, port=port, extra=extra)
    text = config.read_text().replace("keepalive_s = 0.5", "keepalive_s = 0.5\ndrain_timeout_s = 2")
    config.write_text(text)
    with serve_subprocess(config, port) as (base, proc):
        long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20000, "temperature": 0,
                "logit_bias": NO_EOS}
        short = {**long, "max_tokens": 24}
        out: dict[int, dict] = {}
        threads = [threading.Thread(target=_stream, args=(base, long, out, i)) for i in range(5)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while not all(_has_text(out.get(i)) for i in range(5)):
            assert time.monotonic() < deadline, out
            time.sleep(0.05)
        # The short ones start last, so that they are still running when the signal comes.
        shorts = [threading.Thread(target=_stream, args=(base, short, out, i)) for i in range(5, 8)]
        for thread in shorts:
            thread.start()
        while not all(i in out for i in range(5, 8)):
            assert time.monotonic() < deadline, out
            time.sleep(0.01)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(base + "/v1/completions", json=short, timeout=10)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "service_unavailable"
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        code = proc.wait(30)
        elapsed = time.monotonic() - signalled
        for thread in threads + shorts:
            thread.join(10)
    print(f"SIGTERM with 8 streams: exit {code} after {elapsed:.2f} s (drain_timeout_s = 2)")
    assert code == 0 and elapsed < 2 + 6
    for i in range(8):
        frames = sse_events(out[i]["text"])
        assert frames[-1] == "[DONE]", out[i]["text"][-300:]
        last = frames[-2]
        if i < 5:
            assert last["error"]["type"] == "service_unavailable" and "drain" in last["error"]["message"]
        else:
            assert last["choices"][0]["finish_reason"] == "length", last
    log = (tmp_path / f"server-{port}.log").read_text()
    events = [msgspec.json.decode(line) for line in log.splitlines() if line.startswith("{")]
    done = [e for e in events if e["event"] == "drain" and e.get("phase") == "done"]
    assert done and done[0]["num_aborted"] == 5
    assert any(e["event"] == "shutdown" and e.get("previous_state") == "draining" for e in events)


def test_second_signal_exits_at_once(tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    log_path = tmp_path / "second-signal.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlxd", "--config", str(config)], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 180, log_path)
        out: dict[int, dict] = {}
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20000, "temperature": 0,
                "logit_bias": NO_EOS}
        thread = threading.Thread(target=_stream, args=(base, body, out, 0), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not _has_text(out.get(0)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # drain_timeout_s is 30: this alone would wait
        time.sleep(0.5)
        assert proc.poll() is None
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(10)
        assert code == 128 + signal.SIGTERM and time.monotonic() - signalled < 3
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("field", ["drain_timeout_s"])
def test_drain_timeout_is_validated(tmp_path, tiny_model_dir, field):
    from mlxd.errors import ConfigError

    config = write_config(tmp_path, tiny_model_dir)
    config.write_text(config.read_text().replace("keepalive_s = 0.5", f"keepalive_s = 0.5\n{field} = -1"))
    with pytest.raises(ConfigError, match=f"server.{field}"):
        load_everything(config)


def test_engine_thread_ending_turns_health_503_and_exits_non_zero(tiny_model_dir, tmp_path):
    from tests.engine_killer import KILL_LENGTH

    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    log_path = tmp_path / "killer.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.engine_killer", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 180, log_path)
        body = {"model": "tiny", "prompt": list(range(5, 5 + KILL_LENGTH)), "max_tokens": 8, "stream": True}
        started = time.monotonic()
        reply = httpx.post(base + "/v1/completions", json=body, timeout=30)
        frames = sse_events(reply.text)
        assert frames[-1] == "[DONE]" and frames[-2]["error"]["type"] == "service_unavailable", reply.text[-500:]
        with contextlib.suppress(httpx.HTTPError):  # the process may already be gone
            health = httpx.get(base + "/health", timeout=5)
            assert health.status_code == 503 and "engine stopped" in health.json()["error"]
        code = proc.wait(30)
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"engine thread ended: exit {code} after {elapsed:.2f} s")
    assert code == 1 and elapsed < 15
    events = log_lines(log_path)
    assert any(e["event"] == "engine_failed" for e in events)
    assert any(e["event"] == "shutdown" and e.get("exit_code") == 1 for e in events)


def test_health_reports_a_dead_engine(tiny_model_dir, tmp_path):
    from litestar.testing import TestClient

    from mlxd.engine.factory import make_engine
    from tests.engine_killer import KILL_LENGTH, KillingModel

    config, pipeline = load_everything(write_config(tmp_path, tiny_model_dir))
    reasons: list[str] = []
    daemon = Daemon(config, pipeline,
                    make_engine=lambda engine_config, model, drafter: make_engine(engine_config, KillingModel(model),
                                                                              drafter))
    daemon.on_fatal = reasons.append
    with TestClient(create_app(daemon), timeout=60) as client:
        daemon.wait_loaded(120)
        assert client.get("/health").status_code == 200
        body = {"model": "tiny", "prompt": list(range(5, 5 + KILL_LENGTH)), "max_tokens": 8}
        killed = client.post("/v1/completions", json=body)
        assert killed.status_code == 503 and killed.json()["error"]["type"] == "service_unavailable"
        health = client.get("/health")
        assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1
        assert health.json()["status"] == "failed" and "engine stopped" in health.json()["error"]
        assert "EngineKilled" in reasons[0]
        later = client.post("/v1/completions", json={**body, "prompt": "hello"})
        assert later.status_code == 503


def test_a_clean_stop_ends_the_process_without_the_interpreter_teardown(tiny_model_dir, tmp_path):
    """On an NVIDIA GPU, MLX's C++ teardown aborted every stop (exit 134); mlxd skips it once serving has stopped.
    A ``sitecustomize`` module registers an exit handler that marks a file: it runs in a normal Python exit (the
    control) and must not run when mlxd stops."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    marker = tmp_path / "teardown-ran"
    (hooks / "sitecustomize.py").write_text(
        f"import atexit, pathlib\natexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('ran'))\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])}
    control = subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, **env}, timeout=60)
    assert control.returncode == 0 and marker.exists()
    marker.unlink()
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    with serve_subprocess(config, port, env=env) as (base, proc):
        reply = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 4},
                           timeout=30)
        assert reply.status_code == 200
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
    assert not marker.exists()
    log = (tmp_path / f"server-{port}.log").read_text()
    events = [msgspec.json.decode(line) for line in log.splitlines() if line.startswith("{")]
    assert any(e["event"] == "shutdown" for e in events)  # the last line was written before the process ended
