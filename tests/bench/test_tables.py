"""docs/benchmarks.md's marked tables are what their committed JSON gives
(``kv-sidecar bench tables``; ``app.bench.core.tables``): a figure edited by hand, or a result
committed without its table made again, fails here."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from app.bench.core.tables import Table, differences, marked, regenerate
from app.cli.bench_tables import DOC, renders
from app.cli.main import app
from app.errors import BenchError


def _sums(result: Mapping[str, Any]) -> Table:
    return Table(("a", "sum"), tuple((str(a), str(sum(b))) for a, b in result["rows"]))


DOC_TEXT = """# Results

<!-- table sums bench/r.json -->
| a | sum |
|---|---|
| x | 1 |

After.
"""


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "r.json").write_text(json.dumps({"rows": [["x", [1, 2]], ["y", [5]]]}))
    path = tmp_path / "doc.md"
    path.write_text(DOC_TEXT)
    return path


def test_the_committed_tables_match_their_data() -> None:
    text = DOC.read_text()
    kinds = {m.kind for m in marked(text)}
    assert kinds == set(renders()), f"table kinds in {DOC.name}: {kinds}"
    assert differences(text, DOC.parent, renders()) == []


def test_a_stale_table_is_named_and_made_again(doc: Path) -> None:
    text = doc.read_text()
    assert differences(text, doc.parent, {"sums": _sums}) == ["line 3: sums bench/r.json"]
    new = regenerate(text, doc.parent, {"sums": _sums})
    assert new == DOC_TEXT.replace("| x | 1 |\n", "| x | 3 |\n| y | 5 |\n")
    assert differences(new, doc.parent, {"sums": _sums}) == []


def test_a_marker_without_its_table_gets_one(doc: Path) -> None:
    text = DOC_TEXT.replace("| a | sum |\n|---|---|\n| x | 1 |\n", "")
    new = regenerate(text, doc.parent, {"sums": _sums})
    table = "| a | sum |\n|---|---|\n| x | 3 |\n| y | 5 |\n"
    assert f"<!-- table sums bench/r.json -->\n{table}\nAfter." in new


def test_an_unknown_kind_or_missing_data_is_an_error(doc: Path) -> None:
    with pytest.raises(BenchError, match="kind 'sums', expected one of \\['other'\\]"):
        regenerate(DOC_TEXT, doc.parent, {"other": _sums})
    with pytest.raises(BenchError, match="not there"):
        regenerate(DOC_TEXT.replace("r.json", "gone.json"), doc.parent, {"sums": _sums})


def test_the_command_checks_then_makes_the_tables(doc: Path) -> None:
    # The command's own kinds: a routing table over a copy of the committed routing result.
    data = DOC.parent / "bench" / "routing-2routers-avx2.json"
    (doc.parent / "bench" / "routing.json").write_text(data.read_text())
    doc.write_text("<!-- table routing bench/routing.json -->\n| stale |\n")
    runner = CliRunner()
    checked = runner.invoke(app, ["bench", "tables", "--check", "--doc", str(doc)])
    assert checked.exit_code == 1, checked.output
    assert "line 1: routing bench/routing.json: differs" in checked.output
    made = runner.invoke(app, ["bench", "tables", "--doc", str(doc)])
    assert made.exit_code == 0, made.output
    assert "| prefill tokens computed | 13392 [12049–15952] |" in doc.read_text()
    again = runner.invoke(app, ["bench", "tables", "--check", "--doc", str(doc)])
    assert again.exit_code == 0, again.output
