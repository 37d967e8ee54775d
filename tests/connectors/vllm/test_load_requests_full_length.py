"""``bench load``'s requests generate their drawn output length even where the model would
stop at its EOS token.

A request is judged complete only with every asked token (``load_stats.judge``), so an EOS
before ``max_tokens`` counted as a missed SLO: 6-15% of the answered requests in every
committed ``bench load`` run, which held every rate's attainment under the knee's 90%. Here on
the shared Llama pair (``llama_pd``, the only real engine in the default suite): among the
bench's own prompts, find ones the random model ends early when asked plainly, then send them
as ``bench load`` does. Both go to the pair's prefill engine alone, which keeps no prefix
cache: through the proxy, decode would cache these prompts' blocks, and the pair's later tests
count decode's cache hits (a CI run failed three of them so).
"""

from __future__ import annotations

import asyncio

import httpx

from app.bench.core.step import fire, prompt_of
from app.bench.core.systems import System
from app.bench.core.trial import stream
from app.bench.core.workload import Request
from app.harness.local_pd import LocalPD

RUNG = 7
PROMPT_TOKENS = 160
MAX_TOKENS = 128
CANDIDATES = 48  # ~14% of them end early at 128 tokens: none ending is a ~1e-3 chance


async def _plain(url: str) -> list[int]:
    """How many tokens each candidate prompt gets, asked with the model's EOS honoured."""
    async with httpx.AsyncClient(timeout=120) as client:
        answers = await asyncio.gather(
            *(
                stream(client, url, prompt_of(PROMPT_TOKENS, RUNG, i), MAX_TOKENS)
                for i in range(CANDIDATES)
            )
        )
    return [len(a["tokens"]) for a in answers]


def test_load_requests_get_every_drawn_token_past_the_models_eos(llama_pd: LocalPD) -> None:
    engine = llama_pd.prefill.url
    plain = asyncio.run(_plain(engine))
    early = [i for i, n in enumerate(plain) if n < MAX_TOKENS]
    assert early, f"none of {CANDIDATES} prompts ended at EOS: the check has nothing to show"
    requests = [Request(i, 0.0, PROMPT_TOKENS, MAX_TOKENS) for i in early[:4]]
    system = System("kv-sidecar", llama_pd, front=engine)
    answers, _ = asyncio.run(fire(system, requests, RUNG, 120.0, 1.0, 120.0))
    got = {a["index"]: (a["error"], len(a.get("tokens") or ())) for a in answers}
    assert got == {r.index: (None, MAX_TOKENS) for r in requests}, (
        f"plain lengths {[plain[r.index] for r in requests]}, bench load's: {got}"
    )
