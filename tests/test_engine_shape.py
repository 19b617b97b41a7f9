"""The engine's shape holds (issue 35): parts composed, not a chain of subclasses; no attribute probes of our own
objects; no import cycle between its modules; every command has one handler (plain Python, no model)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import mlxd.engine
from mlxd.engine import commands

ENGINE = Path(mlxd.engine.__file__).parent
# Bases that are not engine classes: data and protocol types, errors, threads.
ALLOWED_BASES = {"msgspec.Struct", "Protocol", "ValueError", "Exception", "threading.Thread"}


def modules() -> dict[str, ast.Module]:
    return {".".join(("mlxd", *path.relative_to(ENGINE.parent.parent / "mlxd").with_suffix("").parts)):
            ast.parse(path.read_text()) for path in ENGINE.rglob("*.py")}


def test_no_engine_class_extends_another():
    subclasses = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(base) for base in node.bases}
                subclasses += [f"{name}.{node.name}({base})" for base in bases - ALLOWED_BASES]
    assert subclasses == []


def test_no_attribute_probes_of_our_own_objects():
    probes = [f"{name}:{node.lineno}" for name, tree in modules().items() for node in ast.walk(tree)
              if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr")
              and node.args and ast.unparse(node.args[0]) == "self"]
    assert probes == []


def test_engine_modules_import_no_cycle():
    graph: dict[str, set[str]] = {}
    for name, tree in modules().items():
        imported = set()
        for node in tree.body:  # module level only: imports under TYPE_CHECKING or inside functions do not run
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlxd.engine"):
                imported.add(node.module)
        graph[name] = imported
    path: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        assert module not in path, " -> ".join([*path[path.index(module):], module])
        if module in done or module not in graph:
            return
        path.append(module)
        for other in graph[module]:
            visit(other)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)
    # The speculative step does not know the decode batch that owns it, not even for type hints.
    spec_imports = {node.module for node in ast.walk(modules()["mlxd.engine.speculative.step"])
                    if isinstance(node, ast.ImportFrom)}
    assert "mlxd.engine.step.batch" not in spec_imports


def test_every_command_has_one_handler():
    from mlxd.engine.core import EngineCore

    sent = set(typing.get_args(commands.Command))
    assert sent | {commands.ImagesEncoded} == {
        value for value in vars(commands).values()
        if isinstance(value, type) and value.__module__ == commands.__name__ and value is not commands.RequestSpec}
    source = ast.parse((ENGINE / "core.py").read_text())
    handled = next(node for node in ast.walk(source)
                   if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "self._handlers").value
    assert {ast.unparse(key) for key in handled.keys} == {c.__name__ for c in sent | {commands.ImagesEncoded}}
    assert EngineCore.apply.__doc__ and "only way" in EngineCore.apply.__doc__
