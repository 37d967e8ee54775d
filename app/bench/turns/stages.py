"""Where a turn's TTFT goes, for ``bench turns``.

Every system: prefill's forward time, vLLM's own ``iteration elapsed time`` of the steps in
which prefill computed the prompt (``bench turns`` runs each engine's worker in its own
process, where that figure spans the model's execution), and TTFT minus it: the part of the
turn that is not prefill's compute. kv-sidecar's turns answer before prefill's step ends (decode
starts at the last layer's KV, while prefill still runs that layer's MLP), so that part can be
small or negative.

kv-sidecar, from its sidecars' own stamps (Unix seconds, this host), four stages that add up to
the TTFT: ``to_forward`` (sent → prefill's forward announced: the proxy, the pool's lookup and
load, vLLM's step that takes a finished load), ``forward`` (→ the last layer signalled),
``handoff`` (→ decode's record DONE), ``first_token`` (→ the first token at the client: decode's
step and the stream back); and ``pool_load``, the pool's load itself (part of ``to_forward``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.bench.core.stats import Iteration

STAGES = ("to_forward", "forward", "handoff", "first_token")


def prefill_forward_ms(steps: Sequence[Iteration]) -> float | None:
    """The elapsed time of the steps that computed prompt tokens (None: none was logged)."""
    busy = [s.elapsed_ms for s in steps if s.context_tokens > 0 and s.elapsed_ms is not None]
    return sum(busy) if busy else None


def sidecar_stages(
    sent: float,
    first: float,
    timeline: Mapping[str, Any],
    pool_calls: Sequence[Mapping[str, Any]],
) -> dict[str, float | None]:
    """The stages (ms) of one turn from its transfer's timeline (``sidecar_timeline``:
    ``forward_began``, ``last_signalled``, ``d_done``) and the prefill sidecar's recent pool
    calls; a stage whose stamps are missing is None."""
    marks = [
        sent,
        timeline.get("forward_began"),
        timeline.get("last_signalled"),
        timeline.get("d_done"),
        first,
    ]
    out: dict[str, float | None] = {
        name: None if a is None or b is None else 1e3 * (b - a)
        for name, a, b in zip(STAGES, marks, marks[1:], strict=False)
    }
    loads = [
        c for c in pool_calls if c.get("kind") == "load" and sent <= float(c["started_at"]) <= first
    ]
    out["pool_load"] = (
        1e3 * sum(float(c["ended_at"]) - float(c["started_at"]) for c in loads) if loads else None
    )
    return out
