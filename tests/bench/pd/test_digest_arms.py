"""``bench pd --digest``'s pure parts: the shares it takes, and each arm against the base arm
(the handoff's difference, CPU per GB's ratio) with a paired interval over repetitions."""

from __future__ import annotations

import random
from typing import Any

import pytest

from app.bench.pd.bench import PDOptions, digest_name
from app.bench.pd.report import digest_line
from app.bench.pd.stats import METRICS, against_base
from app.cli.bench_pd import parse_shares
from app.errors import ConfigError

OFF, ALL = digest_name(0.0), digest_name(1.0)


def _trial(
    system: str, rep: int, handoff: float, cpu: float, counted: bool = True
) -> dict[str, Any]:
    return {
        **dict.fromkeys(METRICS, 1.0),
        "link": "unshaped",
        "workload": "2k",
        "system": system,
        "rep": rep,
        "counted": counted,
        "handoff_ms": handoff,
        "cpu_s_per_gib": cpu,
    }


def test_shares_parse_and_name_the_arms() -> None:
    assert parse_shares("") == ()
    assert parse_shares("0,0.125,1") == (0.0, 0.125, 1.0)
    assert PDOptions(digest=(0.0, 0.125)).systems == ("digest-0", "digest-0.125")
    assert PDOptions().systems == ("kv-sidecar", "mooncake")
    for bad in ("0", "0,0", "0,2", "off,all", "-0.1,1"):
        with pytest.raises(ConfigError, match="--digest"):
            parse_shares(bad)


def test_each_arm_against_the_base_with_a_paired_interval() -> None:
    """Reps drift together (a slow rep is slow for every arm); the digest adds 3 ms and 20% of
    CPU. The paired interval holds the 3 ms and not 0, though the drift (±10 ms) is larger."""
    rng = random.Random(1)
    trials = []
    for rep in range(12):
        drift = rng.uniform(-10, 10)
        noise = rng.uniform(-0.5, 0.5)
        trials.append(_trial(OFF, rep, 50 + drift, 1.0 + drift / 100))
        trials.append(_trial(ALL, rep, 53 + drift + noise, 1.2 * (1.0 + drift / 100)))
    trials.append(_trial(ALL, 12, 500.0, 9.0, counted=False))  # not counted: left out
    rows = {r["metric"]: r for r in against_base(trials, OFF, [ALL])}
    handoff = rows["handoff_ms"]
    assert handoff["how"] == "difference" and handoff["system"] == ALL and handoff["base"] == OFF
    iv = handoff["interval"]
    assert iv["units"] == 12 and 2.0 < iv["low"] <= iv["point"] <= iv["high"] < 4.0
    cpu = rows["cpu_s_per_gib"]["interval"]
    assert rows["cpu_s_per_gib"]["how"] == "ratio"
    assert cpu["point"] == pytest.approx(1.2, abs=0.01) and cpu["low"] > 1.1
    assert "digest-1 - digest-0 = " in digest_line(handoff)
    assert "[" in digest_line(handoff) and "12 reps" in digest_line(handoff)


def test_an_arm_without_a_paired_rep_says_so() -> None:
    trials = [_trial(OFF, 0, 50, 1.0), _trial(ALL, 1, 53, 1.2)]
    rows = against_base(trials, OFF, [ALL])
    assert all(r["interval"] is None for r in rows)
    assert digest_line(rows[0]).endswith("no paired repetition")
