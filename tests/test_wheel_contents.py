"""The package is the product: the wheel built from this checkout holds mlxd and its data files, and none of the
test scaffolding (``tests/``, ``tests/support``'s tiny models and fixture templates, the old ``mlxd/testing``);
nothing in ``mlxd/`` imports from ``tests``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCAFFOLDING = ("tiny", "tiny_vlm", "tiny_hybrid", "oracle_drafter", "tool_templates", "vlm_templates",
               "harmony_template")


def _source_tree(dest: Path) -> Path:
    """The checkout's tracked files (what a clean clone builds from), copied: the build writes nothing into the
    working tree, and a stale ``build/`` there cannot leak old files into the wheel."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def test_the_wheel_holds_the_package_and_no_test_scaffolding(tmp_path: Path) -> None:
    source = _source_tree(tmp_path / "src")
    assert (source / "tests" / "support" / "tiny.py").is_file()  # the scaffolding is there to be left out
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w",
                            str(tmp_path / "dist")], capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mlxd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"mlxd/cli.py", "mlxd/pipelines/chat.toml", "mlxd/engine/core.py"} <= set(names), names[:20]
    assert any(name.startswith("mlxd/api/static/") for name in names)
    tops = {name.split("/")[0] for name in names}
    assert tops == {"mlxd", wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"}, tops
    leaked = [name for name in names if name.startswith(("tests/", "mlxd/testing/"))
              or Path(name).stem in SCAFFOLDING or "/support/" in name or "/fixtures/" in name]
    assert not leaked, f"test scaffolding in the wheel: {leaked}"


def _imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("tests."):
            found.add(node.value)  # importlib.import_module("tests.support...")
    return found


def test_nothing_in_mlxd_imports_from_tests() -> None:
    users = {str(path.relative_to(ROOT)): sorted(name for name in _imports_of(path) if name.split(".")[0] == "tests")
             for path in (ROOT / "mlxd").rglob("*.py")}
    assert len(users) > 100
    assert not {path: names for path, names in users.items() if names}
    assert not (ROOT / "mlxd" / "testing").exists()
