"""The code style rules of ../shared/STYLE.md that a linter can check (ruff: complexity, blind except, print, imports)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install -e '.[test]'"
    targets = [name for name in ("mlxd", "tests", "benchmarks") if (ROOT / name).is_dir()]
    result = subprocess.run([ruff, "check", *targets], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
