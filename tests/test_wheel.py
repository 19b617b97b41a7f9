"""The built wheel, installed (not editable) into a fresh venv, serves a config that lives outside the repository.

A config with only ``[model]`` and ``[server] port`` must start: the built-in ``chat`` pipeline comes from the
installed package. The fresh venv gets mlxd from the wheel alone; its heavy dependencies (MLX, transformers, …)
are those of the environment running the tests, added after the venv's own site-packages the way
``--system-site-packages`` adds a base interpreter's, so that no download is needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, stop_process, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


def run(command: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(a fresh venv with the built mlxd wheel installed, the environment to run its commands in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # Build from a copy of the sources, so that the checkout gets no build/ or egg-info folders.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "mlxd", src / "mlxd", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(tmp / "dist")], tmp, env)
    (wheel,) = (tmp / "dist").glob("mlxd-*.whl")

    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env).strip())
    deps = sysconfig.get_paths()["purelib"]
    (site / "test_dependencies.pth").write_text(f"import site; site.addsitedir({deps!r})\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        tmp, env)
    return venv, env


def test_installed_wheel_serves_a_config_outside_the_repository(venv, tiny_model_dir, tmp_path):
    venv_dir, env = venv
    mlxd = venv_dir / "bin" / "mlxd"
    where = run([str(venv_dir / "bin" / "python"), "-c", "import mlxd; print(mlxd.__file__)"], tmp_path, env)
    assert Path(where.strip()).is_relative_to(venv_dir), f"mlxd imported from {where}, not from the wheel"

    port = free_port()
    config = tmp_path / "mlxd.toml"
    config.write_text(f'[model]\nsource = "{tiny_model_dir}"\n[server]\nport = {port}\n')

    out = run([str(mlxd), "check-config", str(config)], tmp_path, env)
    assert f"[server] port = {port}  (file)" in out
    assert "[engine] prefill_chunk = 512  (default)" in out
    pipeline_line = next(line for line in out.splitlines() if line.startswith("pipeline from "))
    assert Path(pipeline_line.removeprefix("pipeline from ").rstrip(":")).is_relative_to(venv_dir)

    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(mlxd), "--config", str(config)], cwd=tmp_path, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 60, log_path)
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        response = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
        })
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] >= 1
    finally:
        stop_process(proc)
