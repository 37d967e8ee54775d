"""``kv-sidecar bench chat-keys``: the share of each answer a conversation's next turn can
load when the client sends chat messages, through real models' tokenizers and templates."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from app.errors import ConfigError

# name=folder[:option=value] -> (name, folder, template options, thinking)
Spec = tuple[str, Path, dict[str, bool], bool]


def _spec(text: str) -> Spec:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(
            f"--tokenizer {text!r}: expected NAME=FOLDER[:thinking|:no-thinking], the folder "
            "holding tokenizer.json and tokenizer_config.json (with its chat_template)"
        )
    folder, _, mode = rest.partition(":")
    if mode not in ("", "thinking", "no-thinking"):
        raise ConfigError(f"--tokenizer {text!r}: mode {mode!r}, expected thinking or no-thinking")
    template = {"enable_thinking": False} if mode == "no-thinking" else {}
    return name, Path(folder), template, mode == "thinking"


def chat_keys_command(
    tokenizer: Annotated[
        list[str],
        typer.Option(
            help="NAME=FOLDER[:thinking|:no-thinking], repeatable. FOLDER holds a model's "
            "tokenizer.json and tokenizer_config.json; scripts/fetch_tokenizers.sh gets "
            "Qwen2.5, Qwen3, Llama 3, Gemma 3 and DeepSeek-V3's. thinking: the model reasons "
            "before each answer (the client sends the answer back without it); no-thinking: "
            "enable_thinking=False in the template."
        ),
    ],
    conversations: Annotated[int, typer.Option(help="Conversations.")] = 20,
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the messages.")] = 0,
    out: Annotated[Path, typer.Option(help="Where to write the JSON.")] = Path("chat-keys.json"),
) -> None:
    """Per template: the answer tokens the next turn shares with what decode stored."""
    specs = [_spec(t) for t in tokenizer]
    if conversations < 1 or turns < 2:
        raise ConfigError(f"need >= 1 conversation of >= 2 turns, got {conversations} x {turns}")
    # Heavy imports inside the command: see app/cli/main.py.
    from transformers import AutoTokenizer

    from app.bench.chat_keys.bench import ChatWorkload, measure, paragraphs, summarize
    from app.bench.core.host import NO_LINK, host_record
    from app.bench.core.result_file import print_host, write_result

    prose = paragraphs(Path(__file__).resolve().parents[2] / "docs")
    w = ChatWorkload(conversations, turns, seed)
    console = Console()
    table = Table(
        "template",
        "answer shared",
        "parted turns",
        "parted at",
        "gained / answer 16-blocks",
        "proxy hit",
        "where it parts",
    )
    templates: dict[str, object] = {}
    for name, folder, template, thinking in specs:
        if not (folder / "tokenizer_config.json").is_file():
            raise ConfigError(f"{folder}: no tokenizer_config.json (and its chat_template) there")
        tok = AutoTokenizer.from_pretrained(str(folder))
        rows = measure(tok, prose, w, thinking=thinking, template=template)
        s = summarize(rows)
        templates[name] = {
            "folder": str(folder),
            "summary": s,
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        table.add_row(
            name,
            f"{s['answer_shared_share']:.0%}",
            f"{s['parted_turns']}/{s['turns']}",
            str(s["parted_at_median"]),
            f"{s['gained_blocks']['16']}/{s['answer_blocks']['16']}",
            f"{s['proxy_hit_share_median']:.0%}",
            s["parted_example"][:60],
        )
    console.print(table)
    result = {"workload": dataclasses.asdict(w), "templates": templates}
    host = host_record(engines={}, link=NO_LINK)  # tokenizers only: no engine, no transfer
    write_result(out, result, host)
    print_host(host, console)
    console.print(f"wrote {out}")
