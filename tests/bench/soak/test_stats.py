"""``bench soak``'s verdicts: growth after warm-up, and every request ended once on both sides."""

from __future__ import annotations

import pytest

from app.bench.soak.stats import delta, ended_once, grew, growth, labelled
from app.errors import ConfigError


def _samples(rss: list[float], every_s: float = 10.0) -> list[dict]:
    return [
        {"t": i * every_s, "usage": {"proxy": {"rss_mib": v, "fds": 40, "threads": 12}}}
        for i, v in enumerate(rss)
    ]


def test_start_up_growth_is_not_counted_but_a_climbing_level_is() -> None:
    # 100 -> 200 MiB during warm-up (t < 30 s), then flat with one busy moment: holds.
    flat = growth(_samples([100, 150, 200, 200, 201, 240, 204, 202]), 30, 20, 70)
    assert flat["proxy/rss_mib"]["base"] == pytest.approx(200.5)
    assert flat["proxy/rss_mib"]["max"] == 240
    assert grew(flat) == []
    # The same, then a leak: the last 20 s sit 15% above the baseline.
    leak = growth(_samples([100, 150, 200, 200, 201, 215, 230, 230]), 30, 20, 70)
    assert leak["proxy/rss_mib"]["late"] == 230
    assert leak["proxy/rss_mib"]["ratio"] == pytest.approx(230 / 200.5)
    assert grew(leak) == ["proxy/rss_mib"]


def test_samples_after_the_load_ended_are_not_the_late_level() -> None:
    # The drain (t > 45 s) frees what the load held: it must not hide a climb during the load.
    g = growth(_samples([0, 100, 100, 130, 130, 100, 100]), 10, 10, 45)
    assert g["proxy/rss_mib"]["late"] == 130
    assert grew(g) == ["proxy/rss_mib"]


def test_a_growth_of_exactly_ten_percent_still_holds() -> None:
    assert grew(growth(_samples([0, 100, 100, 110, 110]), 10, 10, 40)) == []
    assert grew(growth(_samples([0, 100, 100, 110.5, 110.5]), 10, 10, 40)) == ["proxy/rss_mib"]


def test_a_load_too_short_for_two_windows_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="expected a load longer than warm-up"):
        growth(_samples([1, 2, 3, 4]), 10, 20, 40)


PAGE = """# HELP kvsidecar_requests Requests reported to the engine in a final state.
kvsidecar_requests_total{side="send",state="DONE"} 12.0
kvsidecar_requests_total{side="send",state="FAILED"} 1.0
kvsidecar_requests_in_flight{side="send",state="WRITING"} 0.0
kvsidecar_requests_created 1.7e9
"""


def test_labelled_reads_each_label_set_of_one_metric() -> None:
    assert labelled(PAGE, "kvsidecar_requests") == {
        "side=send,state=DONE": 12.0,
        "side=send,state=FAILED": 1.0,
    }
    assert labelled(PAGE, "kvsidecar_requests_in_flight") == {"side=send,state=WRITING": 0.0}


def test_delta_counts_new_label_sets_from_zero() -> None:
    assert delta({"a": 3.0, "b": 1.0}, {"a": 5.0, "b": 1.0, "c": 2.0}) == {"a": 2.0, "c": 2.0}


def test_every_ok_transfer_ends_done_on_both_sides() -> None:
    send = {"side=send,state=DONE": 10.0}
    recv = {"side=recv,state=DONE": 10.0}
    idle = {"side=send,state=WRITING": 0.0, "side=recv,state=WAITING": 0.0}
    ok = {"outcome=ok": 10.0}
    assert ended_once(send, recv, idle, idle, ok) == []
    assert ended_once(send, {"side=recv,state=DONE": 9.0}, idle, idle, ok) == [
        "recv: 9 ended DONE, expected 10 (the proxy's ok)"
    ]
    stuck = {"side=recv,state=WAITING": 1.0}
    assert ended_once(send, recv, idle, stuck, ok) == [
        "recv: still in flight after the drain: {'side=recv,state=WAITING': 1.0}"
    ]


def test_a_transfer_the_proxy_ended_otherwise_ends_once_on_decode_and_at_most_once_on_prefill() -> (
    None
):
    # Prefill answered 500 before its sidecar had a send; the proxy told decode to stop.
    transfers = {"outcome=ok": 9.0, "outcome=prefill_failed": 1.0}
    send = {"side=send,state=DONE": 9.0}
    recv = {"side=recv,state=DONE": 9.0, "side=recv,state=ABORTED": 1.0}
    assert ended_once(send, recv, {}, {}, transfers) == []
    # The same ABORTED recv with the proxy saying every transfer went well: not accounted for.
    assert ended_once(send, recv, {}, {}, {"outcome=ok": 10.0}) == [
        "send: 9 ended DONE, expected 10 (the proxy's ok)",
        "recv: 9 ended DONE, expected 10 (the proxy's ok)",
        "recv: 1 ended other than DONE, expected 0 (the proxy's others)",
    ]
    # Decode's side must end the failed one: missing there is a request never ended.
    assert ended_once(send, {"side=recv,state=DONE": 9.0}, {}, {}, transfers) == [
        "recv: 0 ended other than DONE, expected 1 (the proxy's others)"
    ]
