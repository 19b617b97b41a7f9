"""`mlxd --log-file`: lines go to the file; SIGHUP reopens it (after logrotate or newsyslog moved it) and applies
the config's `[logging]` table again, without stopping the server."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from tests.helpers import free_port, serve_subprocess, write_config
from tests.helpers import log_lines as events


def complete(base: str) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2}
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200


def wait_for(condition, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def rotate(log: Path, proc, suffix: str) -> Path:
    """What logrotate does: move the file away, then send SIGHUP; returns where the old file went."""
    rotated = log.with_name(f"{log.name}.{suffix}")
    log.rename(rotated)
    proc.send_signal(signal.SIGHUP)
    wait_for(log.exists, "the log file to be created again")
    return rotated


def test_sighup_reopens_the_log_file_and_rereads_the_level(tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    log = tmp_path / "logs" / "mlxd.log"
    with serve_subprocess(config, port, args=["--log-file", str(log)]) as (base, proc):
        complete(base)
        wait_for(lambda: any(e["event"] == "request" for e in events(log)), "the first request line")
        assert any(e["event"] == "model_ready" for e in events(log))

        first = rotate(log, proc, "1")
        complete(base)
        wait_for(lambda: any(e["event"] == "request" for e in events(log)), "a request line in the new file")
        assert [e["event"] for e in events(first)].count("request") == 1  # nothing more went to the old one
        reloaded = [e for e in events(log) if e["event"] == "logging_reloaded"]
        assert reloaded and reloaded[0]["level"] == "info" and reloaded[0]["file"] == str(log)

        config.write_text(config.read_text().replace('[logging]\n', '[logging]\nlevel = "warning"\n'))
        second = rotate(log, proc, "2")
        complete(base)
        time.sleep(0.5)  # the request line, were it still logged, is written as the response ends
        assert [e["event"] for e in events(second)].count("request") == 1
        assert [e for e in events(log) if e["level"] == "info"] == []
        assert proc.poll() is None and httpx.get(base + "/health", timeout=10).status_code == 200
    assert proc.returncode == 0  # SIGTERM still drains and exits 0
    stderr = (tmp_path / f"server-{port}.log").read_text()
    assert '"event"' not in stderr, stderr[-2000:]


def test_a_config_broken_before_sighup_keeps_the_level_and_still_reopens(tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    log = tmp_path / "mlxd.log"
    with serve_subprocess(config, port, args=["--log-file", str(log)]) as (base, proc):
        config.write_text(config.read_text().replace('[logging]\n', '[logging]\nlevel = "loud"\n'))
        rotate(log, proc, "1")
        complete(base)
        wait_for(lambda: any(e["event"] == "request" for e in events(log)), "a request line in the new file")
        failed = [e for e in events(log) if e["event"] == "logging_reload_failed"]
        assert failed and "logging.level" in failed[0]["reason"]
        assert proc.poll() is None


def test_a_log_line_still_being_written_is_left_for_the_next_read(tmp_path):
    """Tests poll running servers' logs: the line a server is in the middle of writing is not parsed yet."""
    log = tmp_path / "mlxd.log"
    log.write_text('{"event": "a"}\nnot json\n{"interval_s": 10.')
    assert events(log) == [{"event": "a"}]
    log.write_text('{"event": "a"}\nnot json\n{"interval_s": 10.0}\n')
    assert events(log) == [{"event": "a"}, {"interval_s": 10.0}]
