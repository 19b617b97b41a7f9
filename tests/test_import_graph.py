"""No import circles in mlxd: the graph of its modules' imports of each other (at the top of a module or inside a
function, where a circle only shows at run time; ``if TYPE_CHECKING:`` blocks aside) has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files(package: Path) -> dict[str, Path]:
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _typing_only(tree: ast.Module) -> set[int]:
    return {id(node) for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}


def _imported(node: ast.AST, package: str, root: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == root]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, *([base] if base else [])])
    if base.split(".")[0] != root:
        return []
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of ``package`` it imports (``from a import b`` counts as an import
    of ``a.b`` when that is a module, else of ``a``)."""
    modules = module_files(package)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _typing_only(tree)
        home = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) not in skip:
                found = _imported(node, home, package.name)
                # `from a import b`: the module a.b if there is one, else a (b is a name in it).
                targets |= {owner(t) for t in found[1:] if t in modules} or {owner(t) for t in found[:1]}
                if isinstance(node, ast.Import):
                    targets |= {owner(t) for t in found}
        graph[name] = targets - {name, None}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module, each sorted."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    groups = {tuple(sorted(w for w in graph if w in reach[v] and v in reach[w])) for v in graph if v in reach[v]}
    return sorted(list(group) for group in groups if len(group) > 1)


def test_mlxd_has_no_import_circle() -> None:
    graph = import_graph(ROOT / "mlxd")
    assert len(graph) > 100 and "mlxd.api.app" in graph["mlxd.cli"] | graph["mlxd.server"]
    found = cycles(graph)
    assert not found, "import circles (each a group of modules that import each other, maybe inside functions): " + \
        "; ".join(" <-> ".join(group) for group in found)


def test_the_check_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "sub" / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import pkg.a\n"
                                          "def g():\n    from pkg import a\n")
    (package / "d.py").write_text("from pkg.sub.c import g\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
