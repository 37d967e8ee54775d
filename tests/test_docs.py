"""The docs hold together: links resolve, quoted `kv-sidecar` commands parse, the README is short.

- Every relative Markdown link and image in README.md and docs/**/*.md points at a file (or
  folder) inside the repository, and a `#anchor` into a .md file names one of its headings
  (GitHub's slugs).
- Every `kv-sidecar ...` command quoted in them (fenced code blocks and inline code; a line that
  starts with `kv-sidecar` or `.venv/bin/kv-sidecar`, after an optional `$ ` prompt and
  `VAR=value` assignments; `\\` continuations joined) names a real subcommand path whose `--help`
  exits 0, and every `--option` it writes is one of that subcommand's options. In process, with
  typer's CliRunner against the CLI's app object: no subprocess per command.
- README.md stays at most 250 lines.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or ")".
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[^)]*)?\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
CLI_START = re.compile(r"^(?:\.venv/bin/)?kv-sidecar(?:\s|$)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Shell tokens after which the rest of a line is not the command's own arguments.
SHELL_STOPS = {"&", "&&", "|", "||", ";", ">", ">>", "<", "2>", "2>&1", "1>"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass(frozen=True)
class Text:
    """A stretch of prose (fenced blocks removed) or a fenced block, with its first line."""

    path: Path
    line: int  # 1-based line of the first line of `lines`
    lines: tuple[str, ...]
    fenced: bool


def split_blocks(path: Path) -> list[Text]:
    """Paragraphs of prose and fenced code blocks, each with where it starts."""
    out: list[Text] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    para: list[str] = []
    para_start = 0

    def flush() -> None:
        if para:
            out.append(Text(path, para_start + 1, tuple(para), False))
            para.clear()

    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            flush()
            marker = m.group(1)
            start = i
            i += 1
            body: list[str] = []
            while i < len(lines) and not lines[i].lstrip().startswith(marker):
                body.append(lines[i])
                i += 1
            out.append(Text(path, start + 2, tuple(body), True))
            i += 1  # the closing fence
            continue
        if not lines[i].strip():
            flush()
        else:
            if not para:
                para_start = i
            para.append(lines[i])
        i += 1
    flush()
    return out


def inline_code(block: Text) -> list[tuple[int, str]]:
    """(line, content) of every inline code span of a paragraph; spans may wrap lines."""
    joined = "\n".join(block.lines)
    spans = []
    for m in INLINE_CODE.finditer(joined):
        line = block.line + joined.count("\n", 0, m.start())
        spans.append((line, " ".join(m.group(2).split())))
    return spans


def prose_without_code(block: Text) -> str:
    """A paragraph with its inline code blanked (same length, so offsets keep their lines)."""
    joined = "\n".join(block.lines)
    return INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), joined)


# --- (a) links -------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped, spaces → -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "").replace("~", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # emphasis underscores, not snake_case
    kept = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LNM" or cat == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for block in split_blocks(path):
        if block.fenced:
            continue
        for line in block.lines:
            m = HEADING.match(line)
            if not m:
                continue
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str


def links(path: Path) -> list[Link]:
    found = []
    for block in split_blocks(path):
        if block.fenced:
            continue
        prose = prose_without_code(block)
        for m in INLINE_LINK.finditer(prose):
            line = block.line + prose.count("\n", 0, m.start())
            found.append(Link(path, line, m.group(1)))
        for offset, text in enumerate(prose.split("\n")):
            d = REFERENCE_DEF.match(text)
            if d:
                found.append(Link(path, block.line + offset, d.group(1)))
    return found


def link_problem(link: Link) -> str | None:
    target = link.target
    if SCHEME.match(target) or target.startswith("//"):
        return None  # http(s), mailto: not checked offline
    file_part, _, anchor = target.partition("#")
    if file_part:
        dest = (link.path.parent / file_part).resolve()
        if not dest.is_relative_to(ROOT):
            return f"points outside the repository ({dest})"
        if not dest.exists():
            return f"no such file: {rel(dest) if dest.is_relative_to(ROOT) else dest}"
    else:
        dest = link.path
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading with anchor #{anchor} in {rel(dest)}"
    return None


def test_docs_exist() -> None:
    names = {rel(p) for p in doc_files()}
    assert {
        "README.md",
        "docs/architecture.md",
        "docs/serving.md",
        "docs/operations.md",
        "docs/benchmarks.md",
        "docs/testing.md",
        "docs/devices.md",
    } <= names


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_relative_links_resolve(path: Path) -> None:
    problems = [
        f"{rel(link.path)}:{link.line}: ({link.target}) {problem}"
        for link in links(path)
        if (problem := link_problem(link))
    ]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_follow_github() -> None:
    assert github_slug("Routing by KV events (`--kv-events`)") == "routing-by-kv-events---kv-events"
    assert github_slug("On real engines (`tests/chaos/test_real_engines.py`)") == (
        "on-real-engines-testschaostest_real_enginespy"
    )
    assert github_slug("Worked example: Qwen3-Next, P TP 4 → D TP 2") == (
        "worked-example-qwen3-next-p-tp-4--d-tp-2"
    )


def test_a_broken_link_is_reported() -> None:
    """The checker itself: a missing file and a missing anchor are both caught."""
    doc = ROOT / "docs" / "architecture.md"
    assert link_problem(Link(doc, 1, "nope.md")) == "no such file: docs/nope.md"
    assert "no heading" in (link_problem(Link(doc, 1, "serving.md#no-such-heading")) or "")
    assert link_problem(Link(doc, 1, "serving.md#routing")) is None
    assert link_problem(Link(doc, 1, "https://example.com/x.md#y")) is None


# --- (b) quoted commands ---------------------------------------------------------------------


@dataclass(frozen=True)
class Quoted:
    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}: {self.text}"


def command_of(line: str) -> str | None:
    """The `kv-sidecar ...` part of a shell line, or None when the line runs something else."""
    text = line.strip()
    if text.startswith("$ "):
        text = text[2:].lstrip()
    # Leading VAR=value assignments (values without spaces, as the docs write them).
    while True:
        first = text.split(maxsplit=1)
        if first and ENV_ASSIGNMENT.match(first[0]) and len(first) == 2:
            text = first[1]
        else:
            break
    return text if CLI_START.match(text) else None


def quoted_commands(path: Path) -> list[Quoted]:
    found = []
    for block in split_blocks(path):
        if block.fenced:
            i = 0
            while i < len(block.lines):
                start = i
                joined = block.lines[i]
                while joined.rstrip().endswith("\\") and i + 1 < len(block.lines):
                    i += 1
                    joined = joined.rstrip()[:-1] + " " + block.lines[i].strip()
                cmd = command_of(joined)
                if cmd:
                    found.append(Quoted(path, block.line + start, cmd))
                i += 1
        else:
            for line, span in inline_code(block):
                cmd = command_of(span)
                if cmd:
                    found.append(Quoted(path, line, cmd))
    return found


def tokens_of(command: str) -> list[str]:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in prose: fall back to plain words
        words = command.split()
    out = []
    for word in words[1:]:  # words[0] is kv-sidecar itself
        if word in SHELL_STOPS or word.startswith((">", "2>")):
            break
        out.append(word)
    return out


# Typer builds (and, in recent releases, vendors) click commands: a group has `commands`, an
# option lists its flags in `opts` and `secondary_opts` (`--plot/--no-plot`).


@cache
def cli_app() -> Any:
    """The CLI's typer app, imported on first use (the link checks do not need it)."""
    from app.cli.main import app

    return app


@cache
def root_command() -> Any:
    return typer.main.get_command(cli_app())


def subcommands(command: Any) -> dict[str, Any]:
    return dict(getattr(command, "commands", None) or {})


def resolve(tokens: list[str]) -> tuple[list[str], Any]:
    """The subcommand path the tokens name, and its command."""
    command = root_command()
    path: list[str] = []
    for word in tokens:
        sub = subcommands(command).get(word)
        if sub is None or word.startswith("-"):
            break
        path.append(word)
        command = sub
    return path, command


def option_names(command: Any) -> set[str]:
    names = {"--help"}
    for param in command.params:
        for flag in [*param.opts, *getattr(param, "secondary_opts", [])]:
            if flag.startswith("-"):
                names.add(flag)
    return names


def written_options(tokens: list[str]) -> list[str]:
    opts = []
    for word in tokens:
        word = word.strip("[](){},")
        if word.startswith("--") and len(word) > 2:
            opts.append(word.split("=", 1)[0])
    return opts


@cache
def help_exit(path: tuple[str, ...]) -> tuple[int, str]:
    result = CliRunner().invoke(cli_app(), [*path, "--help"])
    return result.exit_code, result.output


def all_quoted() -> list[Quoted]:
    return [q for path in doc_files() for q in quoted_commands(path)]


def test_commands_are_quoted() -> None:
    """The extraction finds what the docs quote (a silent regex would pass everything)."""
    quoted = all_quoted()
    paths = {tuple(resolve(tokens_of(q.text))[0]) for q in quoted}
    expected = {("serve",), ("proxy",), ("demo",), ("plan",), ("bench", "pd"), ("bench", "routing")}
    assert expected <= paths
    assert any(q.path.name == "README.md" for q in quoted)


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_quoted_commands_parse(path: Path) -> None:
    problems = []
    for q in quoted_commands(path):
        tokens = tokens_of(q.text)
        sub, command = resolve(tokens)
        code, _ = help_exit(tuple(sub))
        if code != 0:
            problems.append(f"{q.where()}\n    `kv-sidecar {' '.join(sub)} --help` exited {code}")
            continue
        known = option_names(command)
        unknown = [o for o in written_options(tokens) if o not in known]
        if unknown:
            name = " ".join(["kv-sidecar", *sub])
            problems.append(
                f"{q.where()}\n    {name} has no option {', '.join(unknown)} "
                f"(it has {', '.join(sorted(known))})"
            )
        # A word after the path that looks like a subcommand but is none (a typo'd `bench pdd`).
        rest = tokens[len(sub) :]
        if subcommands(command) and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
            problems.append(f"{q.where()}\n    {rest[0]!r} is not a subcommand of {sub}")
    assert not problems, "quoted commands that do not parse:\n" + "\n".join(problems)


def test_a_wrong_option_is_reported() -> None:
    """The checker itself: an option the subcommand lacks is caught, a real one is not."""
    tokens = tokens_of("kv-sidecar bench pd --quick --no-such-option 3 > out.txt")
    sub, command = resolve(tokens)
    assert sub == ["bench", "pd"]
    assert "--quick" in option_names(command)
    assert "--no-such-option" not in option_names(command)
    assert written_options(tokens) == ["--quick", "--no-such-option"]
    assert command_of("$ KVSIDECAR_X=1 .venv/bin/kv-sidecar serve --role decode") == (
        ".venv/bin/kv-sidecar serve --role decode"
    )
    assert command_of("kv-sidecar-proxy") is None


# --- (c) the README stays short --------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/"
    )
