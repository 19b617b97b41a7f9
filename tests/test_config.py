"""Config and pipeline validation: every error names the file, the table or stage index, and the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli import load_everything, main
from mlxd.errors import ConfigError
from mlxd.pipeline.registry import BUILTIN_STAGES

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str, name: str = "mlxd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_everything(path)
    return info.value.message


@pytest.mark.parametrize("name", ["default.toml", "qwen3vl.toml"])
def test_shipped_configs_validate(name):
    config, pipeline = load_everything(ROOT / "configs" / name)
    assert [t for t, _ in pipeline.stages] == list(BUILTIN_STAGES)
    assert config.model.source


def test_unknown_field_names_file_table_and_field(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[server]\nprot = 1\n')
    message = error_of(path)
    assert str(path) in message and "server" in message and "`prot`" in message


def test_wrong_type_names_field(tmp_path):
    message = error_of(write(tmp_path, '[model]\nsource = "x"\n[server]\nport = "eighty"\n'))
    assert "server.port" in message and "Expected `int`" in message


def test_missing_model_table(tmp_path):
    assert "`model`" in error_of(write(tmp_path, "[server]\nport = 1\n"))


def test_invalid_toml(tmp_path):
    assert "invalid TOML" in error_of(write(tmp_path, "[model\n"))


def test_unknown_stage_lists_known_names(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "normalize"\n'
                           '[[pipeline.stages]]\ntype = "teleport"\n')
    message = error_of(path)
    assert "stage 1" in message and "'teleport'" in message
    assert all(name in message for name in BUILTIN_STAGES)


def test_bad_stage_option_names_stage_and_field(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "prefill"\nchunk_size = 0\n')
    message = error_of(path)
    assert "stage 0 (prefill)" in message and "chunk_size" in message
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "prefill"\nchunk = 8\n')
    assert "unknown field `chunk`" in error_of(path)


def test_pipeline_file_errors_name_that_file(tmp_path):
    (tmp_path / "pipelines").mkdir()
    bad = write(tmp_path / "pipelines", '[[stages]]\ntype = "decode"\nfast = true\n', "mine.toml")
    message = error_of(write(tmp_path, 'pipeline = "mine"\n[model]\nsource = "x"\n'))
    assert str(bad) in message and "stage 0 (decode)" in message and "`fast`" in message


def test_missing_pipeline_says_where_it_looked(tmp_path):
    message = error_of(write(tmp_path, 'pipeline = "nowhere"\n[model]\nsource = "x"\n'))
    assert "'nowhere' not found" in message and "nowhere.toml" in message


def test_import_path_that_is_not_a_stage(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "json:dumps"\n')
    assert "not a class" in error_of(path)


def test_check_config_cli_prints_pipeline(capsys):
    assert main(["check-config", str(ROOT / "configs" / "default.toml")]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "prefill" in out and "chunk_size" in out


def test_check_config_cli_fails_with_message(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "prefill"\nchunk_size = -1\n')
    result = subprocess.run([sys.executable, "-m", "mlxd", "check-config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert str(path) in result.stderr and "stage 0 (prefill)" in result.stderr and "chunk_size" in result.stderr


def test_help_explains_commands():
    result = subprocess.run([sys.executable, "-m", "mlxd", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "check-config" in result.stdout and "--port" in result.stdout and "--config" in result.stdout


def test_http_layer_does_not_import_mlx():
    code = "import sys, mlxd.api.app; print(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
