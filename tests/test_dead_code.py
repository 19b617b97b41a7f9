"""No dead code in mlxd: vulture (a maintained dead-code finder) over mlxd, its tests and benchmarks finds no
function, method, class, property or import of mlxd that nothing uses.

What vulture cannot see being used is named here, each with the reason: handlers Litestar routes by decorator,
stage classes the registry names as strings, the console script, and methods an upstream framework calls
(overrides of Litestar's DTO, Jinja's code generator, uvicorn's protocol and server, a module's ``__getattr__``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from vulture import Vulture

from mlxd.pipeline.registry import BUILTIN_STAGES

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("function", "method", "class", "property", "import")
ROUTE_DECORATORS = ["@get", "@post", "@put", "@delete", "@route", "@websocket"]
FRAMEWORK_HOOKS = [
    # Litestar's AbstractDTO (mlxd/api/body.py)
    "create_for_field_definition", "create_openapi_schema", "decode_bytes", "decode_builtins",
    "generate_field_definitions", "detect_nested_field",
    # Jinja's code generator and sandbox (mlxd/pipeline/template_env.py)
    "_body", "new_buffer", "concat",
    # uvicorn's HTTP protocol and server (mlxd/runtime/connections.py, mlxd/server.py)
    "data_received", "handle_exit",
    # PEP 562 module attributes (mlxd/cache/__init__.py)
    "__getattr__",
]


def _named_elsewhere() -> list[str]:
    """Stage classes and console scripts, named by strings in the registry and pyproject.toml."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].values()
    return [path.rpartition(":")[2] for path in [*BUILTIN_STAGES.values(), *scripts]]


def unused(root: Path, folders: list[str], ignore: list[str]) -> list[str]:
    """vulture's findings of the kinds above over ``folders`` of ``root``, as ``path:line: unused kind 'name'``."""
    finder = Vulture(ignore_names=ignore, ignore_decorators=ROUTE_DECORATORS)
    finder.scavenge([str(root / folder) for folder in folders])
    return [f"{Path(item.filename).relative_to(root)}:{item.first_lineno}: unused {item.typ} {item.name!r}"
            for item in finder.get_unused_code(min_confidence=60) if item.typ in KINDS]


def test_nothing_in_mlxd_is_unused() -> None:
    found = [line for line in unused(ROOT, ["mlxd", "tests", "benchmarks"], FRAMEWORK_HOOKS + _named_elsewhere())
             if line.startswith("mlxd/")]
    assert not found, "dead code (delete it, or name here why something unseen uses it):\n" + "\n".join(found)


def test_the_finder_sees_an_unused_function(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def used():\n    return 1\n\n\ndef forgotten():\n    return used()\n")
    (tmp_path / "pkg" / "b.py").write_text("from pkg.a import used\n\nprint(used())\n")
    assert unused(tmp_path, ["pkg"], []) == ["pkg/a.py:5: unused function 'forgotten'"]
