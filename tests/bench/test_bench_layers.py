"""app/bench is a core and benches on top of it: a bench imports ``app.bench.core`` and never
another bench; the core imports no bench.

Every module under ``app/bench/`` is parsed with ``ast``; an edge is any import in it (function
bodies and ``TYPE_CHECKING`` blocks included, relative imports resolved, ``from app.bench import
X`` naming package X) and any string constant that is a module path under ``app.bench`` (what
``python -m`` starts and vLLM's ``kv_connector_module_path`` loads). Only ``__init__.py`` sits
directly in ``app/bench``: every other module is in the core or in a bench."""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "app" / "bench"
CORE = "core"
MODULE_PATH = re.compile(r"app\.bench(\.\w+)+")


def _imported(path: Path, root: Path) -> list[str]:
    """The ``app.bench`` modules ``path`` names: imports anywhere, and module-path strings."""
    package = ["app", "bench", *path.relative_to(root).parts[:-1]]
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against the file's package, one level up per extra dot
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            out.append(base)
            # ``from app.bench import pd``: the names may be packages themselves
            out += [f"{base}.{a.name}" for a in node.names if base == "app.bench"]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_PATH.fullmatch(node.value)
        ):
            out.append(node.value)
    return [m for m in out if m.startswith("app.bench.")]


def violations(root: Path) -> list[str]:
    """Every import that breaks the layers, as ``file -> module (why)``; [] when none does."""
    found: list[str] = []
    benches = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} - {CORE}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) == 1:
            if rel.name != "__init__.py":
                found.append(f"{rel}: a module outside the core and every bench")
            continue
        unit = rel.parts[0]
        for module in _imported(path, root):
            target = module.split(".")[2]
            if target not in benches or target == unit:
                continue
            why = "the core imports a bench" if unit == CORE else "a bench imports another bench"
            found.append(f"{rel} -> {module} ({why})")
    return found


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_finds_each_kind_of_crossing(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "__init__.py": "",
            "flat.py": "",
            "core/__init__.py": "",
            "core/a.py": "def f():\n    from app.bench.pd import bench\n",
            "core/b.py": 'CHILD = ("-m", "app.bench.load.bench")\n',
            "pd/__init__.py": "",
            "pd/bench.py": "from app.bench.core.a import f\nfrom app.bench import load\n",
            "pd/report.py": "from .bench import f\nfrom ..load import bench\n",
            "load/__init__.py": "",
            "load/bench.py": "import app.bench.core.b\nfrom app.bench.load import bench\n",
        },
    )
    assert violations(root) == [
        "core/a.py -> app.bench.pd (the core imports a bench)",
        "core/b.py -> app.bench.load.bench (the core imports a bench)",
        "flat.py: a module outside the core and every bench",
        "pd/bench.py -> app.bench.load (a bench imports another bench)",
        "pd/report.py -> app.bench.load (a bench imports another bench)",
    ]


def test_benches_import_the_core_and_no_other_bench() -> None:
    assert (BENCH / CORE / "__init__.py").is_file()
    found = violations(BENCH)
    assert found == [], "app/bench layers broken:\n  " + "\n  ".join(found)
