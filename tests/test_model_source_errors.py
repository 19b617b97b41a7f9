"""A config whose model is not there: the error names the file, `[model] source`, the path looked at, and how to
get the model (mlxd never downloads one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlxd.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "qwen3vl.toml"


def assert_explains(message: str, home: Path, config: str) -> None:
    assert f"{config}: [model] source: '~/models/Qwen3-VL-4B-Instruct-4bit' not found" in message, message
    assert f"{home}/models/Qwen3-VL-4B-Instruct-4bit does not exist" in message
    assert "never downloads" in message and "huggingface-cli download" in message and "mlx_vlm.convert" in message


def test_serving_a_config_without_its_model_says_what_to_do(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "MLXD_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "mlxd", "--config", "configs/qwen3vl.toml"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert_explains(result.stderr, tmp_path, "configs/qwen3vl.toml")


def test_check_config_says_the_same(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["check-config", str(CONFIG)]) == 2
    assert_explains(capsys.readouterr().err, tmp_path, str(CONFIG))
