"""``kv-sidecar demo --engine vllm``: the same P/D flow with two real vLLM engines.

A tiny random-weight model (written once), two vLLM OpenAI servers with ``KVSidecarConnector``,
two sidecars, the proxy, Mooncake over loopback. Each prompt is answered once by the prefill
engine alone (the reference, on decode's compute path: ``LocalPD.reference``) and once through
the proxy; the summary says whether they match and what moved, and shows the last request's
layers against prefill's forward pass (``layer_timeline``), as a table and a PNG.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from app.cli import layer_timeline
from app.errors import ConfigError
from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import TINY_MODELS, write_tiny_model

TIMES = ("target_ms", "prefill_ms", "total_ms")


NEW_MESSAGE = 48  # tokens of the next turn's message (--pool)
REFERENCE_SALT = "kvs-demo-reference"  # the next turn's reference: its own pool and cache keys


def succeeded(summary: dict[str, Any]) -> bool:
    """Every output equals the reference and decode computed only each prompt's last token;
    with the pool, the next turn also equals its reference and loaded its history."""
    n = summary["requests"]
    turn = summary.get("next_turn")
    ok_turn = turn is None or (turn["matches_reference"] and turn["prefill_loaded"] > 0)
    return bool(
        summary["matches_reference"] == n and summary["decode_recomputed_tokens"] == 0 and ok_turn
    )


def _pool_keys(admin: str) -> int:
    stats = httpx.get(f"{admin}/v1/pool", timeout=10).json()
    return int(stats["keys_put"]) + int(stats["keys_skipped"])


def next_turn(
    pd: LocalPD, prompt: list[int], answer: list[int], max_tokens: int, keys_before: int
) -> dict[str, Any]:
    """The conversation's next turn: decode stored the first request's prompt and answer in the
    pool; the history plus a new message goes through the proxy, and prefill loads the history
    instead of computing it. Its reference is prefill alone under a salt of its own (nothing
    loaded, nothing cached)."""
    deadline = time.monotonic() + 30
    while _pool_keys(pd.decode.admin) <= keys_before:  # decode stores after the answer
        if time.monotonic() > deadline:
            raise ConfigError("decode stored nothing in the pool within 30 s")
        time.sleep(0.2)
    message = [(i * 53 + 7) % 1000 + 1 for i in range(NEW_MESSAGE)]
    seed = [*prompt, *answer, *message]
    ref = pd.completion(pd.prefill.url, seed, max_tokens + 1, cache_salt=REFERENCE_SALT)
    first, *rest = ref["choices"][0]["token_ids"]
    turn = [*seed, first]  # as LocalPD.reference: decode computes only the last token
    before = prompt_tokens_by_source(pd.prefill.url)
    out = pd.complete(pd.proxy, turn, max_tokens)
    after = prompt_tokens_by_source(pd.prefill.url)
    delta = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    return {
        "history_tokens": len(prompt) + len(answer),
        "new_tokens": len(turn) - len(prompt) - len(answer),
        "prefill_loaded": delta.get("external_kv_transfer", 0),
        "prefill_computed": delta.get("local_compute", 0),
        "prefill_cached": delta.get("local_cache_hit", 0),
        "matches_reference": out == rest,
    }


def run_vllm_demo(
    kind: str,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    work: Path | None,
    pool: bool = False,
) -> dict[str, Any]:
    """Start the pair, send prompts both ways, summarize; with ``pool`` (a Mooncake master,
    decode storing answers), then the first conversation's next turn. Raises ConfigError on
    bad input."""
    if kind not in TINY_MODELS:
        raise ConfigError(f"--vllm-model {kind!r}: expected one of {sorted(TINY_MODELS)}")
    root = work or Path(tempfile.mkdtemp(prefix="kvs-vllm-demo-"))
    model = write_tiny_model(root / f"model-{kind}", kind)
    pd = LocalPD(
        model,
        root / "run",
        kind=kind,
        pool=pool,
        pool_tails=pool,
        connector_extra={"pool_save_answers": True} if pool else {},
    )
    try:
        pd.start()
        seeds = [
            [(i * 37 + r * 101) % 1000 + 1 for i in range(prompt_tokens - 1 + 17 * r)]
            for r in range(requests)
        ]
        prompts, reference = zip(*(pd.reference(s, max_tokens) for s in seeds), strict=True)
        before = prompt_tokens_by_source(pd.decode.url)
        keys = _pool_keys(pd.decode.admin) if pool else 0
        t0 = time.monotonic()
        answers = [pd.completion(pd.proxy, p, max_tokens) for p in prompts]
        seconds = time.monotonic() - t0
        after = prompt_tokens_by_source(pd.decode.url)
        # Decode computes each prompt's last token itself; anything more is a failed transfer
        # that vLLM recomputed (the output is still right, so only this counter shows it).
        computed = int(after.get("local_compute", 0) - before.get("local_compute", 0))
        # The last request's layers against prefill's forward pass, from both sidecars.
        rid = answers[-1]["kv_transfer_params"]["kv_sidecar_request_id"]
        tl = layer_timeline.fetch(pd.prefill.admin, pd.decode.admin, rid)
        png = layer_timeline.plot(tl, root / "layer-timeline.png")
        transfers = httpx.get(f"{pd.proxy}/v1/transfers", timeout=10).json()["transfers"]
        groups = httpx.get(f"{pd.prefill.admin}/v1/groups", timeout=10).json()["groups"]
        outputs = [a["choices"][0]["token_ids"] for a in answers]
        turn = next_turn(pd, prompts[0], outputs[0], max_tokens, keys) if pool else None
        return {
            "model": kind,
            "engine_start_s": round(pd.started_s, 1),
            "requests": requests,
            "matches_reference": sum(o == r for o, r in zip(outputs, reference, strict=True)),
            "decode_computed_tokens": computed,
            "decode_recomputed_tokens": computed - requests,
            "outputs": outputs,
            "bytes": sum(g["bytes"] for g in groups),
            "descriptors": sum(g["descriptors"] for g in groups),
            "seconds": round(seconds, 3),
            "transfers": [
                {
                    k: t.get(k)
                    for k in ("transfer_id", "status", "target_ms", "prefill_ms", "total_ms")
                }
                for t in transfers[-requests:]
            ],
            "next_turn": turn,
            "layer_timeline": tl.as_dict(),
            "timeline_png": None if png is None else str(png),
            "logs": str(root / "run"),
        }
    finally:
        pd.close()


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    console = Console()
    table = Table(title=f"vLLM P/D demo ({summary['model']})")
    for col in ("request", "output tokens", "target ms", "prefill ms", "total ms"):
        table.add_column(col)
    for i, (out, t) in enumerate(zip(summary["outputs"], summary["transfers"], strict=False)):
        table.add_row(
            str(i), str(out), *(f"{t[k] or 0:.1f}" for k in ("target_ms", "prefill_ms", "total_ms"))
        )
    console.print(table)
    layer_timeline.print_table(console, layer_timeline.from_dict(summary["layer_timeline"]))
    if summary["timeline_png"]:
        console.print(f"layer timeline drawn to {summary['timeline_png']}")
    else:
        console.print("no layer timeline PNG: install matplotlib (the 'bench' extra)")
    s = summary
    console.print(
        f"{s['matches_reference']}/{s['requests']} equal the prefill engine's own output; "
        f"decode recomputed {s['decode_recomputed_tokens']} prompt tokens; "
        f"{s['bytes']:,} B in "
        f"{s['descriptors']:,} descriptors; engines up in {s['engine_start_s']} s; "
        f"logs in {s['logs']}"
    )
    t = s.get("next_turn")
    if t is not None:
        ok = "[green]equals[/]" if t["matches_reference"] else "[red]DIFFERS from[/]"
        console.print(
            f"next turn ({t['history_tokens']} tokens of history stored by decode, "
            f"{t['new_tokens']} new): prefill loaded {t['prefill_loaded']} from the pool, "
            f"computed {t['prefill_computed']}; the answer {ok} prefill's own"
        )
