"""OpenBLAS on Linux: found (pip wheel first, then the system's), preloaded into a fresh process with what it needs,
faster than the wheel's BLAS, re-exec without loops, a warning when float32 runs on the reference BLAS.

Each check starts a subprocess, because ``LD_PRELOAD`` only takes effect when a process starts.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mlxd
from mlxd.errors import ConfigError
from mlxd.runtime.blas import (
    ENV_REEXECED,
    ENV_SETTING,
    bundled_gfortran,
    find_openblas,
    mapped_blas,
    pip_openblas,
    preload_environment,
    reference_blas_warning,
    system_openblas,
)
from tests.helpers import free_port, log_lines, serve_subprocess, write_config

ROOT = Path(mlxd.__file__).resolve().parent.parent

# Runs through the real entry-point path: maybe_reexec_with_openblas, then mlx in the re-executed process.
MATMUL_MODULE = """\
import json, os, statistics, sys, time
from mlxd.runtime.blas import maybe_reexec_with_openblas
maybe_reexec_with_openblas(sys.argv[1:], module="blas_matmul")
import mlx.core as mx
from mlxd.runtime.blas import mapped_blas

mx.random.seed(0)
a, b = mx.random.normal((512, 1024)), mx.random.normal((1024, 1024))
mx.eval(a, b, a @ b)  # warm-up
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    mx.eval(a @ b)
    times.append(time.perf_counter() - start)
maps = open("/proc/self/maps").read().splitlines()
gfortran = sorted({line.split()[-1] for line in maps if "libgfortran" in line})
print(json.dumps({"seconds": statistics.median(times), "blas": mapped_blas(), "gfortran": gfortran}))
"""


def _linux() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("OpenBLAS preloading is Linux-only (macOS uses Accelerate through Metal's build)")


def _pip_openblas() -> Path:
    _linux()
    lib = pip_openblas()
    if lib is None:
        pytest.skip(f"the cmeel-openblas wheel is not installed (a dependency on Linux x86-64; "
                    f"this is {platform.machine()})")
    return lib


def _openblas() -> Path:
    _linux()
    lib = find_openblas()
    if lib is None:
        pytest.skip("no OpenBLAS is installed (pip install cmeel-openblas, or apt-get install libopenblas0-pthread)")
    return lib


def _env(cache: Path, **changes: str | None) -> dict[str, str]:
    drop = ("LD_PRELOAD", "LD_LIBRARY_PATH", ENV_REEXECED, ENV_SETTING)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env["MLXD_CACHE_DIR"] = str(cache)
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


def _run_module(tmp_path: Path, name: str, source: str, args: list[str], **env: str | None):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    environment = _env(tmp_path / "cache", **env)
    environment["PYTHONPATH"] += os.pathsep + str(tmp_path)
    result = subprocess.run([sys.executable, "-m", name, *args], env=environment, capture_output=True, text=True,
                            timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    return result


def _matmul(tmp_path: Path, setting: str, repeats: int) -> dict:
    result = _run_module(tmp_path, "blas_matmul", MATMUL_MODULE, [str(repeats)], **{ENV_SETTING: setting})
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference BLAS bundled with mlx-cpu, timed once for the module."""
    _linux()
    run = _matmul(tmp_path_factory.mktemp("bundled"), "0", repeats=3)
    assert not any("libopenblas" in Path(path).name for path in run["blas"]), run["blas"]
    return run


def _speedup(slow: dict, fast: dict, name: str) -> float:
    ratio = slow["seconds"] / fast["seconds"]
    print(f"512x1024x1024 float32 matmul: bundled BLAS {slow['seconds'] * 1e3:.1f} ms, "
          f"{name} {fast['seconds'] * 1e3:.2f} ms, {ratio:.1f}x faster")
    return ratio


def test_pip_openblas_is_preloaded_with_the_mlx_wheels_gfortran_and_faster(tmp_path: Path, bundled: dict) -> None:
    lib = _pip_openblas()
    # MLXD_OPENBLAS=pip: the system's OpenBLAS is not searched, the wheel is found through its metadata.
    fast = _matmul(tmp_path, "pip", repeats=20)
    assert str(lib) in fast["blas"], fast["blas"]
    # libgfortran.so.5 is met by the mlx-cpu wheel's copy, not by a system library that a fresh machine lacks.
    gfortran = bundled_gfortran()
    assert gfortran is not None and fast["gfortran"] == [str(gfortran)], fast["gfortran"]
    assert (tmp_path / "cache" / "libs").is_dir()
    ratio = _speedup(bundled, fast, "pip OpenBLAS")
    assert ratio >= 5, ratio


def test_system_openblas_is_preloaded_and_faster(tmp_path: Path, bundled: dict) -> None:
    lib = system_openblas()
    fast = _matmul(tmp_path, "system", repeats=20)
    if lib is None:
        # The README asks for no Debian OpenBLAS: asked for and absent, it is not preloaded and nothing breaks.
        assert not any("libopenblas" in Path(path).name for path in fast["blas"]), fast["blas"]
        return
    assert any(Path(path).resolve() == lib.resolve() for path in fast["blas"]), fast["blas"]
    assert _speedup(bundled, fast, "system OpenBLAS") >= 5


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
    for setting, expected in (("pip", pip_openblas()), ("system", system_openblas())):
        monkeypatch.setenv(ENV_SETTING, setting)
        assert find_openblas() == expected
    monkeypatch.delenv(ENV_SETTING)
    assert find_openblas() == (pip_openblas() or system_openblas())  # the environment's own wheel first


def test_preload_environment_adds_gfortran_only_for_the_wheel(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path))
    plain = preload_environment(Path("/usr/lib/libopenblas.so.0"), {"LD_PRELOAD": "libm.so.6"})
    assert plain["LD_PRELOAD"] == "/usr/lib/libopenblas.so.0:libm.so.6" and "LD_LIBRARY_PATH" not in plain
    gfortran = bundled_gfortran()
    if gfortran is None:
        pytest.skip("the mlx-cpu wheel (and its libgfortran copy) is Linux-only")
    wheel = tmp_path / "site-packages" / "cmeel.prefix" / "lib" / "libopenblas.so.0"
    env = preload_environment(wheel, {"LD_LIBRARY_PATH": "/opt/lib"})
    folder, rest = env["LD_LIBRARY_PATH"].split(":", 1)
    assert rest == "/opt/lib" and Path(folder).parent == tmp_path / "libs"
    assert (Path(folder) / "libgfortran.so.5").resolve() == gfortran.resolve()
    assert env["LD_PRELOAD"] == f"{gfortran}:{wheel}"
    assert preload_environment(wheel, {})["LD_LIBRARY_PATH"] == folder  # a second start reuses the link


def test_openblas_workers_sleep_after_a_call_unless_the_environment_says_otherwise(tmp_path: Path) -> None:
    lib = Path("/usr/lib/libopenblas.so.0")
    assert preload_environment(lib, {})["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert preload_environment(lib, {"OPENBLAS_THREAD_TIMEOUT": "20"})["OPENBLAS_THREAD_TIMEOUT"] == "20"


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
    return _run_module(tmp_path, "blas_probe", PROBE, ["--flag", "x y"], **env).stdout.splitlines()


def _expected_preload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lib: Path, existing: str = "") -> str:
    """What the probe's re-executed process should see in LD_PRELOAD (its cache is ``tmp_path / "cache"``)."""
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    return preload_environment(lib, {"LD_PRELOAD": existing} if existing else {})["LD_PRELOAD"]


def test_reexec_happens_once_with_openblas_preloaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = _openblas()
    preload = _expected_preload(monkeypatch, tmp_path, lib)
    lines = _probe(tmp_path, LD_PRELOAD=None)
    # The first process replaced itself; the second saw the marker and went on, arguments intact.
    assert lines == ["start ", f"start {preload}", f"continue ['--flag', 'x y'] {preload}"]


def test_reexec_keeps_an_existing_preload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = _openblas()
    other = "libm.so.6"  # harmless to preload
    lines = _probe(tmp_path, LD_PRELOAD=other)
    assert lines[-1] == f"continue ['--flag', 'x y'] {_expected_preload(monkeypatch, tmp_path, lib, other)}"
    assert lines[-1].endswith(f"{lib}:{other}")


def test_a_library_that_does_not_load_is_skipped_with_a_warning(tmp_path: Path) -> None:
    _linux()
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not an ELF file")
    result = _run_module(tmp_path, "blas_probe", PROBE, [], **{ENV_SETTING: str(broken)})
    assert result.stdout.splitlines() == ["start ", "continue [] "]  # no re-exec, so no crash
    assert f"cannot preload {broken}" in result.stderr


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({ENV_REEXECED: "1"}, "already re-executed"),
        ({ENV_SETTING: "0"}, "disabled"),
        ({"LD_PRELOAD": "PRELOADED"}, "already preloaded"),
    ],
)
def test_reexec_guard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], reason: str) -> None:
    lib = _openblas()
    if env.get("LD_PRELOAD") == "PRELOADED":
        # Preloaded the way mlxd preloads it (the pip wheel's library needs the gfortran that comes with it): a bare
        # LD_PRELOAD of the pip library alone leaves libgfortran.so.5 unresolved and Python cannot start.
        monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
        preload = preload_environment(lib, {})
        env = {key: preload[key] for key in ("LD_PRELOAD", "LD_LIBRARY_PATH") if key in preload}
    lines = _probe(tmp_path, **env)
    assert len(lines) == 2 and lines[0].startswith("start") and lines[1].startswith("continue"), reason
    assert lines[1] == f"continue ['--flag', 'x y'] {env.get('LD_PRELOAD', '')}", reason


def test_reference_blas_warning_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv(ENV_SETTING, raising=False)
    bundled_only = ["/venv/site-packages/mlx_cpu.libs/libblas-0.so.3"]
    warning = reference_blas_warning("float32", "Device(cpu, 0)", bundled_only)
    assert warning is not None and "pip install cmeel-openblas" in warning and "libopenblas0-pthread" in warning
    assert reference_blas_warning("float32", "Device(cpu, 0)", ["/x/cmeel.prefix/lib/libopenblas.so.0"]) is None
    assert reference_blas_warning("mlx.core.float16", "Device(cpu, 0)", bundled_only) is None
    assert reference_blas_warning("float32", "Device(gpu, 0)", bundled_only) is None
    monkeypatch.setenv(ENV_SETTING, "0")
    assert f"unset {ENV_SETTING}" in reference_blas_warning("float32", "Device(cpu, 0)", bundled_only)


def test_serving_without_openblas_logs_one_warning(tmp_path: Path, tiny_model_dir: Path) -> None:
    _linux()
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    with serve_subprocess(config, port, env={ENV_SETTING: "0", "LD_PRELOAD": ""}):
        pass
    lines = log_lines(tmp_path / f"server-{port}.log")
    ready = next(line for line in lines if line.get("event") == "model_ready")
    assert ready["dtype"] == "float32" and not any("libopenblas" in lib for lib in ready["blas"])
    warnings = [line for line in lines if line.get("event") == "reference_blas"]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning", warnings
    assert "pip install cmeel-openblas" in warnings[0]["message"]


def test_the_printed_environment_preloads_openblas_for_any_process(tmp_path: Path) -> None:
    """`eval "$(mlxd openblas-env)"` (the README's recipe for preloading OpenBLAS yourself) starts Python with it."""
    lib = _openblas()
    script = (f'eval "$({sys.executable} -m mlxd openblas-env)" && {sys.executable} -c "'
              'import mlx.core as mx; from mlxd.runtime.blas import mapped_blas; '
              'mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); print(mapped_blas())"')
    result = subprocess.run(["bash", "-c", script], env=_env(tmp_path / "cache"), capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert str(lib) in result.stdout
