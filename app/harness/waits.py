"""How long to wait for a prompt: from its length and prefills measured on the same engines.

A fixed wait (120 s for any completion) is either far too long for a short prompt or too short
for a long one: a 16k prompt on one CPU thread takes minutes. Every wait here is a bound on the
prefill's time derived from a measured one, never a guess of the machine's speed:

- a prefill of ``n`` tokens costs ``a·n + b·n²`` (the weights once per token, attention over
  everything before it) with ``a, b >= 0``. So from one measured prefill of ``m`` tokens in
  ``t`` seconds, ``t·max(n/m, (n/m)²)`` bounds the prefill of ``n`` tokens (linear below
  ``m``, quadratic above: attention grows at most that fast), whatever ``a`` and ``b`` are;
- each measured prefill gives a bound; the tightest (smallest) one counts. A measurement slowed
  by a busy machine only loosens the bound;
- a wait is then ``slack × (prefills × bound + decode steps)``; ``slack`` covers the other
  processes on shared cores. It is never shorter than ``floor_s``, the old fixed 120 s: a short
  prompt's first request (or one queued behind another test's engines) keeps the wait it had.

Before anything was measured the bound starts from ``PRIOR`` (what the old fixed 120 s wait
assumed of a 2048-token prompt): the same 120 s up to 2048 tokens, quadratic above. Callers
that know a prompt will be long measure a ladder first (``probe_ladder``), so no bound
stretches a measurement more than ``LADDER_STEP²`` in length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from app.errors import ConfigError


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill: ``tokens`` computed in ``seconds`` (wall time, on the engine the
    waits are for)."""

    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        if self.tokens < 1 or not self.seconds > 0:
            raise ConfigError(
                f"a prefill sample needs tokens >= 1 and seconds > 0; got {self.tokens} "
                f"tokens in {self.seconds} s"
            )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


PRIOR = PrefillSample(2048, 40.0)  # x slack 3: the old fixed 120 s at 2048 tokens
LADDER_FIRST = 2048  # vLLM's chunk on CPU: the first probe is one chunk
LADDER_STEP = 4  # each probe 4x the last: a bound at most 16x the measured time


@dataclass(frozen=True)
class WaitPolicy:
    slack: float = 3.0  # two shared cores, other tests' engines beside ours
    floor_s: float = 120.0  # no wait shorter than the old fixed one
    step_s: float = 0.1  # each decode step's engine overhead, beside its attention


def prefill_bound_s(samples: Iterable[PrefillSample], tokens: int) -> float:
    """The tightest upper bound on a ``tokens`` prefill that ``samples`` give (``PRIOR`` when
    there are none): see the module docstring."""
    measured = list(samples) or [PRIOR]
    return min(s.seconds * max(tokens / s.tokens, (tokens / s.tokens) ** 2) for s in measured)


def completion_wait_s(
    samples: Sequence[PrefillSample],
    tokens: int,
    max_tokens: int,
    prefills: int = 1,
    policy: WaitPolicy = WaitPolicy(),
) -> float:
    """How long a completion of a ``tokens`` prompt, ``max_tokens`` generated, may take when
    ``prefills`` such prompts are computed before it answers (N prompts at once; twice each
    where decode may compute a prompt again after a failed load).

    A decode step over ``n`` tokens costs at most twice the mean prefill cost per token at
    ``n`` (the marginal cost ``a + 2bn`` of the module docstring), plus ``step_s``."""
    bound = prefill_bound_s(samples, tokens)
    context = tokens + max_tokens
    decode = max_tokens * (2 * prefill_bound_s(samples, context) / context + policy.step_s)
    return max(policy.floor_s, policy.slack * (prefills * bound + decode))


def probe_ladder(
    lengths: Iterable[int], first: int = LADDER_FIRST, step: int = LADDER_STEP
) -> list[int]:
    """Prompt lengths to measure before prompts of ``lengths``: ``first``, ``first·step``, ...
    while below the longest's ``1/step`` (none when the longest is within ``step`` of
    ``first``). Measured first, then the prompts themselves shortest first, every prompt is
    within ``step²`` of a measured length (a probe's or a shorter prompt's): each probe costs
    at most ``1/step`` of the longest prompt's prefill."""
    longest = max(lengths, default=0)
    out: list[int] = []
    n = first
    while n * step < longest:
        out.append(n)
        n *= step
    return out


@dataclass
class PrefillClock:
    """The prefills measured on one pair of engines, and the waits they give."""

    policy: WaitPolicy = WaitPolicy()
    samples: list[PrefillSample] = field(default_factory=list)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= 1 and seconds > 0:
            self.samples.append(PrefillSample(tokens, seconds))

    def wait_s(self, tokens: int, max_tokens: int, prefills: int = 1) -> float:
        return completion_wait_s(self.samples, tokens, max_tokens, prefills, self.policy)

    def basis(self, tokens: int) -> str:
        """Which measurement bounds a ``tokens`` prefill, for a message that says why a wait
        ended: ``'a 2048-token prefill measured in 1.4 s'``."""
        measured = self.samples or [PRIOR]
        best = min(
            measured, key=lambda s: s.seconds * max(tokens / s.tokens, (tokens / s.tokens) ** 2)
        )
        how = "measured" if self.samples else "assumed (nothing measured yet)"
        return f"a {best.tokens}-token prefill {how} in {best.seconds:.1f} s"


def ceil_gib(nbytes: float) -> int:
    """Whole GiB holding ``nbytes`` (vLLM's ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB)."""
    return max(1, math.ceil(nbytes / 2**30))
