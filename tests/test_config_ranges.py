"""``mlxd check-config`` refuses every value that would crash or exhaust the process, or fail every request, naming
the file and the field; a config that is not UTF-8 is an error naming the file, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli import load_everything
from mlxd.errors import ConfigError

# (table, line) -> the field the error must name.
BAD = [
    ("server", "max_body_bytes = -1", "server.max_body_bytes"),
    ("server", "max_body_bytes = 0", "server.max_body_bytes"),
    ("server", "max_body_bytes = 4294967296", "server.max_body_bytes"),
    ("server", "port = 70000", "server.port"),
    ("server", "port = -1", "server.port"),
    ("server", "keepalive_s = 0", "server.keepalive_s"),
    ("server", "keepalive_s = -1.0", "server.keepalive_s"),
    ("server", "keepalive_s = inf", "server.keepalive_s"),
    ("server", "drain_timeout_s = nan", "server.drain_timeout_s"),
    ("server", 'host = ""', "server.host"),
    ("model.sampling", "temperature = -0.5", "model.sampling.temperature"),
    ("model.sampling", "temperature = 1e9", "model.sampling.temperature"),
    ("model.sampling", "top_p = 0.0", "model.sampling.top_p"),
    ("model.sampling", "top_p = 1.5", "model.sampling.top_p"),
    ("model.sampling", "top_k = -1", "model.sampling.top_k"),
    ("model.sampling", "min_p = 2.0", "model.sampling.min_p"),
    ("model.sampling", "repetition_penalty = -1.0", "model.sampling.repetition_penalty"),
    ("model.sampling", "max_tokens = 0", "model.sampling.max_tokens"),
    ("model.sampling", "max_tokens = -5", "model.sampling.max_tokens"),
    ("engine", "prefill_chunk = 1000000", "engine.prefill_chunk"),
    ("engine", "prefill_chunk = 0", "engine.prefill_chunk"),
    ("engine", "max_running = 1000000", "engine.max_running"),
    ("engine", "max_running = -1", "engine.max_running"),
    ("engine", "max_waiting = 100000000", "engine.max_waiting"),
    ("engine", "step_token_budget = 100000000", "engine.step_token_budget"),
    ("engine", "warmup_tokens = 100000", "engine.warmup_tokens"),
    ("engine", "max_n = 100000", "engine.max_n"),
    ("engine", "max_queue_wait_s = inf", "engine.max_queue_wait_s"),
    ("engine.speculative", "max_step_tokens = 1000000", "engine.speculative.max_step_tokens"),
    ("engine.speculative", "ngram_min = 3\nngram_max = 2", "engine.speculative.ngram_min"),
    ("model", "context_length = 1000000000", "model.context_length"),
    ("vision", "max_images = 100000", "vision.max_images"),
    ("vision", "remote_timeout_s = inf", "vision.remote_timeout_s"),
]


def config_with(tmp_path: Path, table: str, line: str) -> Path:
    tables = {"model": 'source = "x"', table: line} if table != "model" else {"model": f'source = "x"\n{line}'}
    path = tmp_path / "bad.toml"
    path.write_text("".join(f"[{name}]\n{body}\n" for name, body in tables.items()))
    return path


@pytest.mark.parametrize(("table", "line", "field"), BAD, ids=[line for _, line, _ in BAD])
def test_out_of_range_values_are_config_errors_naming_file_and_field(tmp_path, table, line, field):
    path = config_with(tmp_path, table, line)
    with pytest.raises(ConfigError) as info:
        load_everything(path)
    assert info.value.message.startswith(f"{path}: {field}:"), info.value.message


@pytest.mark.parametrize(("table", "line"), [
    ("server", "port = 65535"), ("server", "max_body_bytes = 1"), ("engine", "prefill_chunk = 8192"),
    ("engine", "max_running = 1024"), ("model.sampling", "temperature = 2.0"), ("model.sampling", "top_p = 1.0"),
    ("model.sampling", "top_k = 0"), ("model.sampling", "min_p = 0.0"), ("model.sampling", "max_tokens = 1"),
])
def test_values_at_the_bounds_are_accepted(tmp_path, table, line):
    load_everything(config_with(tmp_path, table, line))


def run_check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxd", "check-config", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_check_config_names_file_and_field_without_a_traceback(tmp_path):
    path = config_with(tmp_path, "engine", "prefill_chunk = 1000000")
    result = run_check_config(path)
    assert result.returncode != 0
    assert f"{path}: engine.prefill_chunk:" in result.stderr and "<= 8192" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_config_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[model]\nsource = "x"\nname = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_everything(path)
    assert info.value.message.startswith(f"{path}: not UTF-8")
    result = run_check_config(path)
    assert result.returncode != 0 and f"{path}: not UTF-8" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_config_that_is_a_folder_names_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_everything(tmp_path)
    assert info.value.message.startswith(f"{tmp_path}: cannot read")


def test_a_flag_out_of_range_is_refused_naming_the_setting(tmp_path, tiny_model_dir):
    path = tmp_path / "ok.toml"
    path.write_text(f'[model]\nsource = "{tiny_model_dir}"\n')
    result = subprocess.run([sys.executable, "-m", "mlxd", "check-config", str(path), "--port", "70000"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "server.port" in result.stderr and "65535" in result.stderr
    assert "Traceback" not in result.stderr
