"""Every script in ``benchmarks/`` is a maintained tool: it answers ``--help`` with exit status 0, prints its usage,
and does so before it imports MLX, mlx-lm or mlx-vlm (no model is loaded, no device is touched) and before it
re-executes itself with OpenBLAS preloaded; ``benchmarks/README.md`` has a line for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

# Runs a script as ``python SCRIPT --help`` would, then reports its exit status and what it had imported by then.
RUNNER = """
import json, runpy, sys
path = sys.argv[1]
sys.argv = [path, "--help"]
sys.path.insert(0, __import__("os").path.dirname(path))
try:
    runpy.run_path(path, run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code or 0
heavy = sorted(name for name in ("mlx.core", "mlx_lm", "mlx_vlm") if name in sys.modules)
print("\\n" + json.dumps({"code": code, "heavy": heavy}))
"""


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_help_exits_zero_without_loading_mlx(script: Path) -> None:
    result = subprocess.run([sys.executable, "-c", RUNNER, str(script)], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"code": 0, "heavy": []}, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_listed_in_readme(script: Path) -> None:
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert f"`{script.name}`" in readme
