"""``bench load``'s workload, pure and seeded: Poisson arrivals, long-tailed prompt lengths,
uniform output lengths, and the ladder of rates from the unloaded service time."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from app.errors import ConfigError

# Token ids drawn for prompts and messages: below the tiny models' vocabularies, above their
# special ids.
TOKEN_IDS = (10, 1000)


@dataclass(frozen=True)
class Lengths:
    """Prompt tokens ~ lognormal (``median``, ``sigma``) clipped to [``lo``, ``hi``]; output
    tokens uniform in [``out_lo``, ``out_hi``]."""

    median: int = 1024
    sigma: float = 0.8  # P(prompt > 4 x median) ~ 4%: the long tail a real mix has
    lo: int = 128
    hi: int = 8192
    out_lo: int = 16
    out_hi: int = 128

    def fit(self, max_model_len: int, margin: int = 64) -> Lengths:
        """The same shape within ``max_model_len`` (prompt + output + ``margin``): the clip
        comes down, the median with it in proportion when the clip had to move."""
        room = max_model_len - self.out_hi - margin
        if room < self.lo:
            raise ConfigError(f"max model length {max_model_len} leaves no room for prompts")
        if self.hi <= room:
            return self
        scale = room / self.hi
        median = max(self.lo, int(self.median * scale))
        return Lengths(median, self.sigma, self.lo, room, self.out_lo, self.out_hi)

    @property
    def longest(self) -> int:
        return self.hi + self.out_hi


@dataclass(frozen=True)
class Request:
    index: int  # its place in the step's sequence (unique prompt per index and rate)
    at_s: float  # send time, seconds after the step's start
    prompt_tokens: int
    max_tokens: int


def draw_lengths(rng: random.Random, lengths: Lengths) -> tuple[int, int]:
    raw = rng.lognormvariate(math.log(lengths.median), lengths.sigma)
    prompt = min(lengths.hi, max(lengths.lo, round(raw)))
    return prompt, rng.randint(lengths.out_lo, lengths.out_hi)


def schedule(
    rate: float, duration_s: float, seed: int, lengths: Lengths, min_requests: int = 1
) -> tuple[Request, ...]:
    """Open-loop arrivals at ``rate`` per second for ``duration_s`` (at least ``min_requests``,
    arriving past the duration if needed): exponential gaps, one ``random.Random(seed)`` for
    gaps and lengths, so a seed is one sequence on every machine and for every system.

    One seed at two rates gives the same lengths in the same order, the arrival times scaled
    by the rates' ratio (an exponential gap is one uniform draw over the rate): a ladder's
    rungs then differ only in load, and the SLO's attainment falls with the rate instead of
    following which rung drew the longer prompts."""
    if rate <= 0 or duration_s <= 0:
        raise ConfigError("a rate step needs a positive rate and duration")
    rng = random.Random(seed)
    out: list[Request] = []
    t = rng.expovariate(rate)
    while t < duration_s or len(out) < min_requests:
        prompt, outputs = draw_lengths(rng, lengths)
        out.append(Request(len(out), t, prompt, outputs))
        t += rng.expovariate(rate)
    return tuple(out)


def ladder(service_s: float, fractions: Sequence[float]) -> tuple[float, ...]:
    """Rates (requests/s) as ``fractions`` of one request's unloaded service rate
    (1 / ``service_s``), 3 significant digits: the same ladder, in load, on any machine."""
    if service_s <= 0 or not math.isfinite(service_s):
        raise ConfigError(f"unloaded service time {service_s!r}: nothing to derive rates from")
    rates = sorted({float(f"{f / service_s:.3g}") for f in fractions if f > 0})
    if not rates:
        raise ConfigError("no positive load fraction for the ladder")
    return tuple(rates)


QUICK_LENGTHS = Lengths(median=256, sigma=0.8, lo=64, hi=1024, out_lo=8, out_hi=32)


def random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    """``n`` token ids drawn from ``rng`` in ``TOKEN_IDS``."""
    return tuple(rng.randrange(*TOKEN_IDS) for _ in range(n))
