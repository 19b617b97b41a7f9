"""OpenBLAS on Linux: found, preloaded into a fresh process, faster than the wheel's BLAS, re-exec without loops.

Each check starts a subprocess, because ``LD_PRELOAD`` only takes effect when a process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mlxd
from mlxd.errors import ConfigError
from mlxd.runtime.blas import ENV_REEXECED, ENV_SETTING, find_openblas, mapped_blas

ROOT = Path(mlxd.__file__).resolve().parent.parent

MATMUL_SCRIPT = """\
import json, statistics, time
import mlx.core as mx
from mlxd.runtime.blas import mapped_blas

mx.random.seed(0)
a, b = mx.random.normal((512, 512)), mx.random.normal((512, 512))
mx.eval(a, b, a @ b)  # warm-up
times = []
for _ in range({repeats}):
    start = time.perf_counter()
    mx.eval(a @ b)
    times.append(time.perf_counter() - start)
print(json.dumps({{"seconds": statistics.median(times), "blas": mapped_blas()}}))
"""


def _openblas() -> Path:
    if not sys.platform.startswith("linux"):
        pytest.skip("OpenBLAS preloading is Linux-only (macOS uses Accelerate through Metal's build)")
    lib = find_openblas()
    if lib is None:
        pytest.skip("OpenBLAS is not installed (Debian: apt-get install libopenblas0-pthread)")
    return lib


def _env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV_REEXECED, ENV_SETTING)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


def _run_matmul(env: dict[str, str], repeats: int) -> dict:
    script = MATMUL_SCRIPT.format(repeats=repeats)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_preloaded_openblas_is_mapped_and_faster() -> None:
    lib = _openblas()
    fast = _run_matmul(_env(LD_PRELOAD=str(lib)), repeats=20)
    assert any("libopenblas" in Path(path).name for path in fast["blas"]), fast["blas"]

    slow = _run_matmul(_env(), repeats=3)
    assert not any("libopenblas" in Path(path).name for path in slow["blas"]), slow["blas"]
    ratio = slow["seconds"] / fast["seconds"]
    message = (
        f"512x512 float32 matmul: bundled BLAS {slow['seconds'] * 1e3:.1f} ms, "
        f"OpenBLAS {fast['seconds'] * 1e3:.2f} ms, {ratio:.1f}x faster"
    )
    print(message)
    assert ratio > 2, message


def test_find_openblas_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_SETTING, "0")
    assert find_openblas() is None
    forced = tmp_path / "libopenblas.so.0"
    forced.write_bytes(b"")
    monkeypatch.setenv(ENV_SETTING, str(forced))
    assert find_openblas() == forced
    monkeypatch.setenv(ENV_SETTING, str(tmp_path / "missing.so"))
    with pytest.raises(ConfigError, match="missing.so"):
        find_openblas()


def test_mapped_blas_lists_no_openblas_in_a_plain_process() -> None:
    # The test runner was not started with OpenBLAS preloaded (unless a developer did so on purpose).
    if "libopenblas" not in os.environ.get("LD_PRELOAD", ""):
        assert not any("libopenblas" in path for path in mapped_blas())


PROBE = """\
import os, sys
print("start", os.environ.get("LD_PRELOAD", ""), flush=True)
from mlxd.runtime.blas import maybe_reexec_with_openblas
maybe_reexec_with_openblas(sys.argv[1:], module="blas_probe")
print("continue", sys.argv[1:], os.environ.get("LD_PRELOAD", ""), flush=True)
"""


def _probe(tmp_path: Path, **env: str | None) -> list[str]:
    (tmp_path / "blas_probe.py").write_text(textwrap.dedent(PROBE))
    environment = _env(**env)
    environment["PYTHONPATH"] += os.pathsep + str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "blas_probe", "--flag", "x y"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_reexec_happens_once_with_openblas_preloaded(tmp_path: Path) -> None:
    lib = _openblas()
    lines = _probe(tmp_path, LD_PRELOAD=None)
    # The first process replaced itself; the second saw the marker and went on, arguments intact.
    assert lines == ["start ", f"start {lib}", f"continue ['--flag', 'x y'] {lib}"]


def test_reexec_keeps_an_existing_preload(tmp_path: Path) -> None:
    lib = _openblas()
    other = "libm.so.6"  # harmless to preload
    lines = _probe(tmp_path, LD_PRELOAD=other)
    assert lines[-1] == f"continue ['--flag', 'x y'] {lib}:{other}"


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({ENV_REEXECED: "1"}, "already re-executed"),
        ({ENV_SETTING: "0"}, "disabled"),
        ({"LD_PRELOAD": "PRELOADED"}, "already preloaded"),
    ],
)
def test_reexec_guard(tmp_path: Path, env: dict[str, str], reason: str) -> None:
    lib = _openblas()
    env = {k: v.replace("PRELOADED", str(lib)) for k, v in env.items()}
    lines = _probe(tmp_path, **env)
    assert len(lines) == 2 and lines[0].startswith("start") and lines[1].startswith("continue"), reason
    assert lines[1] == f"continue ['--flag', 'x y'] {env.get('LD_PRELOAD', '')}", reason
