"""The packages under app/ form layers: no package imports from one that imports it back.

Every ``import app.X...`` / ``from app.X... import`` in ``app/X/**.py`` (anywhere in the file,
function bodies and ``TYPE_CHECKING`` blocks included) is an edge from the package holding the
file to package X; the graph must have no cycle."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"


def _target(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "app":
        return None
    return parts[1] if (APP / parts[1]).is_dir() else None


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files (relative to app/) that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for pkg_dir in sorted(p for p in APP.iterdir() if (p / "__init__.py").is_file()):
        pkg = pkg_dir.name
        edges = graph.setdefault(pkg, {})
        for path in sorted(pkg_dir.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            depth = len(path.relative_to(APP).parts) - 1  # package levels above the file
            for node in ast.walk(tree):
                modules: list[str] = []
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:  # relative: resolve against the file's package
                        base = ["app", *path.relative_to(APP).parts[:depth]]
                        base = base[: len(base) - (node.level - 1)]
                        modules = [".".join([*base, *(node.module or "").split(".")]).strip(".")]
                    elif node.module:
                        modules = [node.module]
                for module in modules:
                    target = _target(module)
                    if target is not None and target != pkg:
                        files = edges.setdefault(target, [])
                        rel = str(path.relative_to(APP))
                        if rel not in files:
                            files.append(rel)
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """A cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None


def test_find_cycle_reports_one() -> None:
    g = {"a": {"b": ["a/x.py"]}, "b": {"c": ["b/y.py"]}, "c": {"a": ["c/z.py"]}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None


def test_package_imports_have_no_cycle() -> None:
    graph = package_graph()
    assert graph, "no packages found under app/"
    cycle = find_cycle(graph)
    hops: list[str] = []
    if cycle is not None:
        hops = [f"{a} -> {b} ({', '.join(graph[a][b])})" for a, b in itertools.pairwise(cycle)]
        print("package import cycle:\n  " + "\n  ".join(hops))
    assert cycle is None, "package import cycle: " + "; ".join(hops)
