"""Waits that scale with the prompt's length and measured prefills (pure logic, no engines)."""

from __future__ import annotations

import pytest

from app.bench.core.systems import check_kv_memory, kv_cache_env, memory_total
from app.errors import ConfigError
from app.harness.waits import (
    PRIOR,
    PrefillClock,
    PrefillSample,
    WaitPolicy,
    completion_wait_s,
    prefill_bound_s,
    probe_ladder,
)

NO_SLACK = WaitPolicy(slack=1.0, floor_s=0.0, step_s=0.0)


def test_bound_is_linear_below_a_sample_and_quadratic_above() -> None:
    s = [PrefillSample(2048, 2.0)]
    assert prefill_bound_s(s, 1024) == pytest.approx(1.0)
    assert prefill_bound_s(s, 2048) == pytest.approx(2.0)
    assert prefill_bound_s(s, 8192) == pytest.approx(32.0)  # 4x the length: 16x the time


def test_bound_holds_for_any_linear_plus_quadratic_cost() -> None:
    """t(n) = a·n + b·n² with a, b >= 0: one measurement bounds every other length."""
    for a, b in ((1e-3, 0.0), (0.0, 1e-7), (5e-4, 3e-8)):
        samples = [PrefillSample(2048, a * 2048 + b * 2048**2)]
        for n in (100, 2048, 16384, 131072):
            assert prefill_bound_s(samples, n) >= (a * n + b * n * n) * (1 - 1e-9)


def test_the_tightest_sample_counts() -> None:
    near, far = PrefillSample(32768, 40.0), PrefillSample(2048, 1.0)
    # from 2048: 1.0 * 32² = 1024 s; from 32768: 40 * 2² = 160 s
    assert prefill_bound_s([far, near], 65536) == pytest.approx(160.0)


def test_nothing_measured_keeps_the_old_120_s_up_to_2048_tokens() -> None:
    assert completion_wait_s([], PRIOR.tokens, 0) == pytest.approx(120.0)
    assert completion_wait_s([], 512, 16) == pytest.approx(120.0)  # never shorter than it was
    assert completion_wait_s([], 4096, 0) == pytest.approx(480.0)


def test_waits_grow_with_length_prompts_and_decoded_tokens() -> None:
    s = [PrefillSample(4096, 4.0)]
    base = completion_wait_s(s, 4096, 16, 1, NO_SLACK)
    assert completion_wait_s(s, 65536, 16, 1, NO_SLACK) > 200 * base  # 16x the length
    assert completion_wait_s(s, 4096, 16, 4, NO_SLACK) == pytest.approx(4 * 4.0 + base - 4.0)
    assert completion_wait_s(s, 4096, 160, 1, NO_SLACK) > base
    policy = WaitPolicy(slack=3.0, floor_s=30.0, step_s=0.0)
    assert completion_wait_s(s, 4096, 0, 1, policy) == pytest.approx(30.0)  # the floor
    assert completion_wait_s(s, 16384, 0, 1, policy) == pytest.approx(3 * 4.0 * 16)


def test_a_clock_learns_from_what_it_observed() -> None:
    clock = PrefillClock()
    before = clock.wait_s(65536, 16)
    assert "assumed" in clock.basis(65536)
    clock.observe(16384, 8.0)
    clock.observe(0, 1.0)  # nothing computed: not a sample
    assert len(clock.samples) == 1
    assert clock.wait_s(65536, 16) < before / 10
    assert clock.basis(65536) == "a 16384-token prefill measured in 8.0 s"


def test_a_sample_needs_tokens_and_time() -> None:
    with pytest.raises(ConfigError, match="seconds > 0"):
        PrefillSample(10, 0.0)


@pytest.mark.parametrize(
    ("lengths", "probes"),
    [
        ([512, 2048, 8192], []),
        ([16384], [2048]),
        ([32768, 65536], [2048, 8192]),
        ([131072], [2048, 8192]),
        ([], []),
    ],
)
def test_probe_ladder(lengths: list[int], probes: list[int]) -> None:
    assert probe_ladder(lengths) == probes


def test_every_prompt_is_within_step_squared_of_a_measured_length() -> None:
    for longest in (9000, 40000, 65536, 131072):
        probes = probe_ladder([longest])
        assert probes and longest <= 16 * max(probes)
        assert max(probes) * 4 < longest  # no probe costs more than a quarter of the prompt


def test_kv_cache_space_follows_the_length() -> None:
    model = {
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 4,
    }
    # 4 layers x K,V x 4 heads x 128 x 2 bytes = 8 KiB a token, and a quarter more
    assert kv_cache_env(model, 2048) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert kv_cache_env(model, 65536 + 80) == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # 0.63 GiB
    assert kv_cache_env(model, 131072) == {"VLLM_CPU_KVCACHE_SPACE": "2"}  # 1.25 GiB
    assert kv_cache_env(model, 65536, "float32") == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert kv_cache_env({**model, "num_hidden_layers": 16}, 65536) == {
        "VLLM_CPU_KVCACHE_SPACE": "3"  # 2.5 GiB
    }


def test_kv_caches_that_do_not_fit_the_host_are_refused_at_start() -> None:
    check_kv_memory({"VLLM_CPU_KVCACHE_SPACE": "2"}, 24 << 30)  # 4 x 2 + 4 GiB
    with pytest.raises(ConfigError, match=r"4 engines x 6 GiB of KV cache \+ 4 GiB need 28 GiB"):
        check_kv_memory({"VLLM_CPU_KVCACHE_SPACE": "6"}, 24 << 30)
    assert memory_total() > 1 << 30
