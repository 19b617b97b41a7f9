"""Start-up tells what it is doing (issue 37 item 6): a log line when each phase starts and ends, progress lines
during long ones, a progress bar on a terminal, and no "PyTorch was not found" from mlxd's own commands."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time

import structlog

from mlxd.runtime import progress
from tests.helpers import free_port, serve_subprocess, write_config


def test_check_config_prints_no_pytorch_notice(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir)
    result = subprocess.run([sys.executable, "-m", "mlxd", "check-config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    assert "PyTorch was not found" not in result.stdout + result.stderr


def test_only_the_pytorch_notice_is_dropped(caplog):
    from mlxd.log import quiet_pytorch_notice

    quiet_pytorch_notice()
    quiet_pytorch_notice()  # twice adds one filter
    logger = logging.getLogger("transformers")
    assert sum(type(f).__name__ == "_DropMessage" for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="transformers"):
        logger.warning("PyTorch was not found. Models won't be available and only tokenizers, ...")
        logger.warning("some other advice")
    assert [r.getMessage() for r in caplog.records] == ["some other advice"]


def test_the_tokenizer_length_notice_is_dropped(caplog, tiny_model_dir):
    """A prompt longer than the tokenizer's trained length is served when the context allows it; transformers'
    "will result in indexing errors" would only mislead an operator reading the log."""
    from transformers import AutoTokenizer

    from mlxd.log import quiet_pytorch_notice

    quiet_pytorch_notice()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.model_max_length = 8
    with caplog.at_level(logging.WARNING):
        ids = tokenizer.encode("one two three four five six seven eight nine ten eleven twelve")
    assert len(ids) > 8
    assert not [r for r in caplog.records if "sequence length" in r.getMessage()]
    logging.getLogger("transformers.tokenization_utils_base").warning("another tokenizer notice")
    assert [r.getMessage() for r in caplog.records] == ["another tokenizer notice"]


def test_daemon_logs_its_phases_in_order_with_durations(tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port, extra="[engine]\nmax_running = 4\n")
    with serve_subprocess(config, port):
        pass
    lines = []
    for raw in (tmp_path / f"server-{port}.log").read_text().splitlines():
        if raw.startswith("{"):
            lines.append(json.loads(raw))
    assert not any("PyTorch was not found" in json.dumps(line) for line in lines)
    events = [(line["event"], line.get("phase")) for line in lines
              if line["event"] in ("phase_start", "phase_end", "memory_budget", "model_ready")]
    assert events == [("phase_start", "loading"), ("phase_end", "loading"), ("memory_budget", None),
                      ("phase_start", "warm_up"), ("phase_end", "warm_up"),
                      ("phase_start", "pipeline_warm_up"), ("phase_end", "pipeline_warm_up"), ("model_ready", None)]
    ends = {line["phase"]: line for line in lines if line["event"] == "phase_end"}
    assert ends["loading"]["seconds"] >= 0 and ends["loading"]["folder"] == str(tiny_model_dir)
    assert ends["warm_up"]["seconds"] >= 0 and ends["warm_up"]["max_running"] == 4


def test_converting_a_gguf_file_is_a_phase_and_a_converted_one_is_not(tmp_path):
    from mlxd.models.default_model import locate_default_gguf
    from mlxd.models.gguf import ensure_converted

    gguf = locate_default_gguf(download=False)
    with structlog.testing.capture_logs() as logs:
        folder = ensure_converted(gguf, tmp_path)
        assert ensure_converted(gguf, tmp_path) == folder  # cached: no phase
    phases = [(e["event"], e["phase"], e["gguf"]) for e in logs if e["event"].startswith("phase_")]
    assert phases == [("phase_start", "converting", str(gguf)), ("phase_end", "converting", str(gguf))]
    assert logs[-1]["seconds"] > 0 and logs[-1]["size_bytes"] == gguf.stat().st_size


def test_progress_is_logged_at_most_every_interval_and_drawn_on_a_terminal(monkeypatch):
    clock = iter([0.0, 0.5, 2.5, 3.0, 4.6, 5.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    terminal = io.StringIO()
    monkeypatch.setattr(progress, "console_terminal", lambda: terminal)
    with structlog.testing.capture_logs() as logs:
        with progress.phase("warm_up"):
            for i in range(1, 5):
                progress.step(i, 4)  # at 0.5, 2.5, 3.0 and 4.6 s
    told = [(e["step"], e["seconds"]) for e in logs if e["event"] == "phase_progress"]
    assert told == [(2, 2.5), (4, 4.6)]
    assert [e["event"] for e in logs] == ["phase_start", "phase_progress", "phase_progress", "phase_end"]
    assert logs[-1]["seconds"] == 5.0
    drawn = terminal.getvalue()
    assert "\rwarm_up [" + "#" * 30 + "] 4/4" in drawn and drawn.endswith("\r\033[K")
    assert "] 1/4" in drawn and "] 3/4" in drawn


def test_no_bar_when_not_a_terminal_and_steps_outside_a_phase_are_ignored(monkeypatch, capsys):
    progress.step(1, 2)  # no phase: nothing happens
    with structlog.testing.capture_logs() as logs:
        with progress.phase("loading"):
            progress.step(1, 1)
    assert [e["event"] for e in logs] == ["phase_start", "phase_end"]
    assert "loading [" not in capsys.readouterr().err


def test_a_failing_phase_says_so():
    with structlog.testing.capture_logs() as logs:
        try:
            with progress.phase("converting"):
                raise ValueError("bad file")
        except ValueError:
            pass
    assert [(e["event"], e["phase"]) for e in logs] == [("phase_start", "converting"), ("phase_failed", "converting")]


def test_a_phase_without_steps_still_says_it_is_running(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.05)
    with structlog.testing.capture_logs() as logs:
        with progress.phase("loading"):
            time.sleep(0.4)
        time.sleep(0.2)  # nothing after the end
    events = [e["event"] for e in logs]
    assert events[0] == "phase_start" and events[-1] == "phase_end"
    ticks = [e for e in logs if e["event"] == "phase_progress"]
    assert 3 <= len(ticks) <= 8 and all("step" not in e for e in ticks)
    assert [e["seconds"] for e in ticks] == sorted(e["seconds"] for e in ticks)
