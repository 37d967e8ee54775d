"""The packages under app/ form layers: no package imports from one that imports it back.

Every ``import app.X...`` / ``from app.X... import`` in ``app/X/**.py`` (anywhere in the file,
function bodies and ``TYPE_CHECKING`` blocks included) is an edge from the package holding the
file to package X; the graph must have no cycle.

Inside ``app/transfer`` the same holds file by file, and its sub-packages (rooms) import one way,
in the order ``TRANSFER_ROOMS`` lists them. No file of ``app/`` is longer than ``MAX_LINES``."""

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


# ---- app/transfer: rooms, and the files in them -------------------------------------------------

TRANSFER = APP / "transfer"
# The rooms (sub-packages) of app/transfer, lowest first: a room's files import from their own
# room and the rooms before it only.
TRANSFER_ROOMS = ["planning", "lanes", "wire", "control", "requests", "sidecar"]
# What may stay directly in app/transfer: the package's own __init__ (no sidecar entry is kept
# there; the sidecar is the last room).
TRANSFER_FLAT = {"__init__.py"}
MAX_LINES = 550


def _module_of(path: Path, root: Path) -> str:
    """``root/a/b/c.py`` -> ``a.b.c``; ``root/a/b/__init__.py`` -> ``a.b``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _named_modules(path: Path, root: Path) -> list[str]:
    """Every module name an import in ``path`` may mean, anywhere in the file (function bodies and
    ``TYPE_CHECKING`` blocks included), relative imports resolved against the file's package:
    ``from a.b import c`` names ``a.b`` and ``a.b.c`` (c may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).parts[:-1])  # an __init__'s package is its folder
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
    return names


def module_graph(package_dir: Path) -> dict[str, dict[str, list[str]]]:
    """Module -> the modules of the same package tree it imports -> [the importing file]. Only
    what a file names counts, not the parent packages Python runs on the way."""
    root = package_dir.parent
    while (root / "__init__.py").is_file():
        root = root.parent
    files = sorted(package_dir.rglob("*.py"))
    modules = {_module_of(f, root): f for f in files}
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for name in _named_modules(path, root):
            if name in modules and name != module:
                edges.setdefault(name, [str(path.relative_to(root))])
    return graph


def _room(module: str) -> str | None:
    """``app.transfer.wire.protocol`` -> ``wire``; None for ``app.transfer`` itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def wrong_way(graph: dict[str, dict[str, list[str]]], rooms: list[str]) -> list[str]:
    """Every import of a room's file from a later room (or from a room not in ``rooms``)."""
    bad = []
    for module, edges in sorted(graph.items()):
        for target in sorted(edges):
            a, b = _room(module), _room(target)
            if a is None or b is None or a == b:
                continue
            if a not in rooms or b not in rooms or rooms.index(b) > rooms.index(a):
                bad.append(f"{module} ({a}) imports {target} ({b})")
    return bad


def test_module_graph_resolves_relative_and_nested_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "app" / "transfer"
    for room in ("low", "high"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (tmp_path / "app" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "base.py").write_text("def f() -> None:\n    from ..high import top\n")
    (pkg / "high" / "top.py").write_text("from . import mid\nimport app.transfer.low.base\n")
    (pkg / "high" / "mid.py").write_text("from app.transfer.low.base import f\n")
    graph = module_graph(pkg)
    assert set(graph["app.transfer.low.base"]) == {"app.transfer.high", "app.transfer.high.top"}
    assert set(graph["app.transfer.high.top"]) == {
        "app.transfer.high",
        "app.transfer.high.mid",
        "app.transfer.low.base",
    }
    assert find_cycle(graph) is not None
    assert wrong_way(graph, ["low", "high"]) == [
        "app.transfer.low.base (low) imports app.transfer.high (high)",
        "app.transfer.low.base (low) imports app.transfer.high.top (high)",
    ]
    assert wrong_way(graph, ["high", "low"]) == [
        "app.transfer.high.mid (high) imports app.transfer.low.base (low)",
        "app.transfer.high.top (high) imports app.transfer.low.base (low)",
    ]


def test_transfer_is_split_into_rooms() -> None:
    flat = sorted(p.name for p in TRANSFER.glob("*.py") if p.name not in TRANSFER_FLAT)
    assert not flat, f"modules left directly in app/transfer: {flat}"
    folders = {p.parent.name for p in TRANSFER.glob("*/*.py")}
    packages = {p.name for p in TRANSFER.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= packages, f"folders without an __init__.py: {sorted(folders - packages)}"
    assert packages == set(TRANSFER_ROOMS), f"rooms {sorted(packages)}, listed {TRANSFER_ROOMS}"


def test_transfer_modules_have_no_cycle() -> None:
    graph = module_graph(TRANSFER)
    assert len(graph) > len(TRANSFER_ROOMS), "no modules found under app/transfer"
    cycle = find_cycle(graph)
    hops = [f"{a} -> {b}" for a, b in itertools.pairwise(cycle or [])]
    assert cycle is None, "import cycle in app/transfer: " + "; ".join(hops)


def test_transfer_rooms_import_one_way() -> None:
    bad = wrong_way(module_graph(TRANSFER), TRANSFER_ROOMS)
    assert not bad, f"rooms import one way ({' < '.join(TRANSFER_ROOMS)}): " + "; ".join(bad)


def test_no_long_files() -> None:
    long = {
        str(p.relative_to(APP.parent)): n
        for p in sorted(APP.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
