"""Prometheus metrics of one sidecar, in a registry of their own (one per admin app).

Counters and gauges are read from the sidecar's state at scrape time by a custom collector, so
the transfer path pays nothing for them. The two histograms need every observation: they are
passed to the sidecar with ``Sidecar.add_observer``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.api.views import queue_depth, readiness, versions
from app.transfer.sidecar.process import Sidecar
from app.transfer.wire.protocol import Status

# Loopback TCP moves a layer of a few MB in ~1-10 ms; RDMA in well under 1 ms.
LAYER_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SidecarCollector(Collector):
    """Everything that is already counted somewhere in the sidecar, read when scraped."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def collect(self) -> Iterator[Metric]:
        sc = self.sidecar
        s = sc.settings
        ready, _ = readiness(sc)

        info = GaugeMetricFamily(
            "kvsidecar_info",
            "Identity of this sidecar (value is always 1).",
            labels=["engine_id", "role", "epoch", "version", "protocol"],
        )
        v = versions()
        info.add_metric([s.engine_id, s.role, sc.epoch, v.kv_sidecar, str(v.protocol)], 1)
        yield info
        yield GaugeMetricFamily(
            "kvsidecar_ready", "1 when ready to transfer (GET /readyz is 200).", value=int(ready)
        )
        yield GaugeMetricFamily(
            "kvsidecar_start_time_seconds", "Start of this sidecar, Unix time.", value=sc.started
        )

        yield from self._groups()
        yield from self._requests()

        expired = CounterMetricFamily(
            "kvsidecar_deadline_expirations",
            "Requests ended EXPIRED because their deadline passed.",
            value=sc.counters.get("expired", 0),
        )
        yield expired
        yield CounterMetricFamily(
            "kvsidecar_handshakes",
            "Successful handshakes with decode peers.",
            value=sc.counters.get("handshakes", 0),
        )
        yield CounterMetricFamily(
            "kvsidecar_duplicate_dones",
            "Repeated Done messages (a prefill retried after a lost ack), acknowledged again.",
            value=sc.counters.get("duplicate_dones", 0),
        )
        mismatches = CounterMetricFamily(
            "kvsidecar_kv_digest_mismatches",
            "KV digest mismatches (issue 51), by group kind and side: the request failed and "
            "decode recomputes it.",
            labels=["kind", "side"],
        )
        digested = CounterMetricFamily(
            "kvsidecar_kv_digest_bytes", "Bytes of KV digested, by side.", labels=["side"]
        )
        # Every side always has a sample (0 included): "nothing digested with the setting off"
        # is then a value a scrape reads, not an absent series.
        digested_by_side = {"prefill": 0, "decode": 0}
        pool = () if sc.pool is None else (sc.pool.digests,)
        if pool:
            digested_by_side["pool"] = 0
        for stats in (sc.send.digests, sc.recv.digests, *pool):
            for (kind, side), n in stats.mismatches.items():
                mismatches.add_metric([kind, side], n)
            for side, n in stats.bytes.items():
                digested_by_side[side] = digested_by_side.get(side, 0) + n
        for side, n in digested_by_side.items():
            digested.add_metric([side], n)
        yield mismatches
        yield digested
        for name, help_text in (
            (
                "quarantined",
                "Decode requests ended while a sender might still write, held back "
                "from the engine until every sender drained or was lost.",
            ),
            (
                "refused_claims",
                "Claims refused: prefill named blocks, an epoch or a request that "
                "decode does not hold for it.",
            ),
            (
                "refused_targets",
                "Decode targets prefill refused before connecting anywhere: unsigned, forged, "
                "of an older format, or signed for another transfer or another prompt.",
            ),
            ("leases_lost", "Peers declared lost because they were silent past the lease."),
            ("generations", "Engine re-registrations that started a new generation (epoch)."),
            (
                "unconfirmed_sends",
                "Prefill sends whose writes outlived their deadline: decode was told nothing "
                "and the engine got the blocks back only once Mooncake answered the writes.",
            ),
        ):
            yield CounterMetricFamily(f"kvsidecar_{name}", help_text, value=sc.counters[name])
        yield GaugeMetricFamily(
            "kvsidecar_quarantine_requests",
            "Decode requests in quarantine now.",
            value=sum(
                1
                for a in list(sc.agents.values())
                for r in list(a.recvs.values())
                if r.quarantined_at is not None
            ),
        )
        yield from self._layer_signals()
        yield from self._sockets()
        yield from self._mooncake()
        yield from self._peers()
        yield from self._pool()

    def _layer_signals(self) -> Iterator[Metric]:
        signals = CounterMetricFamily(
            "kvsidecar_layer_signals",
            "Layers the engine signalled, per rank: during the forward pass (written while it "
            "computes) or only at the step's end (after it; a push that is not layer-wise).",
            labels=["rank", "when"],
        )
        for rank, agent in sorted(self.sidecar.agents.items()):
            log = agent.step_log
            signals.add_metric([str(rank), "forward"], log.in_forward)
            signals.add_metric([str(rank), "step_end"], log.at_step_end)
        yield signals

    def _groups(self) -> Iterator[Metric]:
        labels = ["group", "spec"]
        nbytes = CounterMetricFamily(
            "kvsidecar_group_bytes", "Bytes written, per KV cache group.", labels=labels
        )
        descs = CounterMetricFamily(
            "kvsidecar_group_descriptors",
            "Transfer descriptors written, per KV cache group.",
            labels=labels,
        )
        layers = CounterMetricFamily(
            "kvsidecar_group_layers_sent",
            "Layer writes that moved at least one descriptor, per KV cache group.",
            labels=labels,
        )
        transfers = CounterMetricFamily(
            "kvsidecar_group_transfers",
            "Per-layer writes by outcome, per KV cache group.",
            labels=[*labels, "status"],
        )
        sums: dict[tuple[str, str], list[int]] = {}
        for agent in list(self.sidecar.agents.values()):
            kinds = {g.index: g.kind.value for g in agent.desc.groups}
            for index, st in list(agent.groups.items()):
                key = (str(index), kinds.get(index, "unknown"))
                acc = sums.setdefault(key, [0, 0, 0, 0, 0])
                acc[0] += st.bytes
                acc[1] += st.descriptors
                acc[2] += st.layers_sent
                acc[3] += st.transfers_ok
                acc[4] += st.transfers_failed
        for key, (b, d, n, ok, failed) in sorted(sums.items()):
            nbytes.add_metric(list(key), b)
            descs.add_metric(list(key), d)
            layers.add_metric(list(key), n)
            transfers.add_metric([*key, "ok"], ok)
            transfers.add_metric([*key, "failed"], failed)
        yield from (nbytes, descs, layers, transfers)

    def _requests(self) -> Iterator[Metric]:
        total = CounterMetricFamily(
            "kvsidecar_requests",
            "Requests reported to the engine in a final state.",
            labels=["side", "state"],
        )
        inflight = GaugeMetricFamily(
            "kvsidecar_requests_in_flight",
            "Requests admitted and not yet in a final state.",
            labels=["side", "state"],
        )
        queue = GaugeMetricFamily(
            "kvsidecar_stream_queue_depth",
            "Layer tasks waiting for the stream thread (full = back-pressure).",
            labels=["rank"],
        )
        capacity = GaugeMetricFamily(
            "kvsidecar_stream_queue_capacity", "Bound of the stream queue.", labels=["rank"]
        )
        held = GaugeMetricFamily(
            "kvsidecar_held_sends",
            "Sends waiting for decode's target (bounded by max_held_sends).",
            labels=["rank"],
        )
        held_blocks = GaugeMetricFamily(
            "kvsidecar_held_blocks",
            "Engine blocks pinned by sends waiting for decode's target (max_held_blocks).",
            labels=["rank"],
        )
        held_age = GaugeMetricFamily(
            "kvsidecar_held_oldest_age_seconds",
            "Age of the oldest send waiting for decode's target (0: none).",
            labels=["rank"],
        )
        now = time.monotonic()
        ended: dict[tuple[str, str], int] = {}
        live: dict[tuple[str, str], int] = {
            (side, st.name): 0 for side in ("send", "recv") for st in Status if not st.terminal
        }
        for rank, agent in sorted(self.sidecar.agents.items()):
            for (side, state), n in list(agent.terminal.items()):
                ended[(side, state.name)] = ended.get((side, state.name), 0) + n
            for side, table in (("send", agent.sends), ("recv", agent.recvs)):
                for req in list(table.values()):
                    if not req.state.terminal:
                        live[(side, req.state.name)] += 1
            if agent.stream is not None:
                queue.add_metric([str(rank)], queue_depth(agent.stream.queue))
                capacity.add_metric([str(rank)], agent.stream.queue.maxsize)
            waiting = agent.held_sends()
            held.add_metric([str(rank)], len(waiting))
            held_blocks.add_metric([str(rank)], sum(r.block_count for r in waiting))
            held_age.add_metric([str(rank)], max((now - r.created for r in waiting), default=0.0))
        for key, n in sorted(ended.items()):
            total.add_metric(list(key), n)
        for key, n in sorted(live.items()):
            inflight.add_metric(list(key), n)
        yield from (total, inflight, queue, capacity, held, held_blocks, held_age)

    def _sockets(self) -> Iterator[Metric]:
        frames = CounterMetricFamily(
            "kvsidecar_frames", "Frames received on a ZMQ socket.", labels=["socket"]
        )
        rejected = CounterMetricFamily(
            "kvsidecar_rejected_frames",
            "Frames that did not authenticate, decode, or had an unknown protocol version.",
            labels=["socket"],
        )
        unauthenticated = CounterMetricFamily(
            "kvsidecar_unauthenticated_frames",
            "Frames refused because their HMAC, version or timestamp did not check (also in "
            "rejected_frames): a peer with another key, clock skew, or a stranger.",
            labels=["socket"],
        )
        errors = CounterMetricFamily(
            "kvsidecar_handler_errors",
            "Messages whose handler raised (answered with an error).",
            labels=["socket"],
        )
        for name, server in (
            ("control", self.sidecar.control),
            ("engine", self.sidecar.engine_server),
        ):
            if server is None:
                continue
            c = server.counters()
            frames.add_metric([name], c.get("frames", 0))
            rejected.add_metric([name], c.get("rejected", 0))
            errors.add_metric([name], c.get("handler_errors", 0))
            unauthenticated.add_metric([name], c.get("unauthenticated_frames", 0))
        yield from (frames, rejected, unauthenticated, errors)

    def _mooncake(self) -> Iterator[Metric]:
        engine = self.sidecar.engine
        if engine is None:
            return
        c = engine.counters()
        for key, doc in (
            ("submits", "Mooncake submissions (a descriptor polling, a batch spinning)."),
            ("descriptors", "Descriptors Mooncake confirmed written."),
            ("bytes", "Bytes Mooncake confirmed written."),
            ("failures", "Mooncake write calls that raised."),
            ("reopens", "Per-peer sending lanes replaced after a failed write."),
        ):
            yield CounterMetricFamily(f"kvsidecar_mooncake_{key}", doc, value=c.get(key, 0))

    def _pool(self) -> Iterator[Metric]:
        svc = self.sidecar.pool
        if svc is None:
            return
        c = svc.client.counters()
        yield CounterMetricFamily(
            "kvsidecar_pool_lookups", "Pool lookups served.", value=svc.lookups
        )
        yield CounterMetricFamily(
            "kvsidecar_pool_hit_tokens", "Tokens served by pool hits.", value=svc.hit_tokens
        )
        keys = CounterMetricFamily(
            "kvsidecar_pool_keys", "Pool keys by outcome.", labels=["outcome"]
        )
        for outcome, value in (
            ("hit", c.hits),
            ("miss", c.misses),
            ("put", c.keys_put),
            ("skipped", c.keys_skipped),
            ("got", c.keys_got),
            ("backpressure", c.backpressure),
            ("failed", c.failures),
            ("timeout", c.timeouts),
        ):
            keys.add_metric([outcome], value)
        yield keys
        nbytes = CounterMetricFamily(
            "kvsidecar_pool_bytes", "Bytes moved to and from the pool.", labels=["direction"]
        )
        nbytes.add_metric(["put"], c.bytes_put)
        nbytes.add_metric(["get"], c.bytes_got)
        yield nbytes
        calls = svc.calls
        for name, doc, value in (
            ("loads", "Engine loads from the pool.", calls.loads),
            ("load_keys", "Keys engine loads fetched.", calls.keys),
            ("load_bytes", "Bytes engine loads fetched.", calls.bytes),
            (
                "load_local_blocks",
                "Blocks a hit needs that loads left alone: the engine's own cache held them.",
                calls.local_blocks,
            ),
            ("saves", "Engine stores into the pool (a request's computed prompt).", calls.saves),
            (
                "saves_cut",
                "Stores of a shorter prefix than computed: blocks a hit needs were given back.",
                calls.saves_cut,
            ),
        ):
            yield CounterMetricFamily(f"kvsidecar_pool_{name}", doc, value=value)
        late = svc.running.counters
        calls_late = CounterMetricFamily(
            "kvsidecar_pool_late_calls",
            "Engine saves and loads whose store call ran past the pool's timeout (the engine "
            "kept their blocks), and what became of them.",
            labels=["outcome"],
        )
        for outcome, value in (
            ("load", late.late_loads),
            ("save", late.late_saves),
            ("released", late.released),
            ("stuck", late.stuck),
        ):
            calls_late.add_metric([outcome], value)
        yield calls_late
        yield GaugeMetricFamily(
            "kvsidecar_pool_late_running",
            "Store calls past their timeout still running now (their buffers held).",
            value=c.late_running,
        )

    def _peers(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "kvsidecar_peer_failures",
            "Failed handshakes and unanswered control messages, per decode peer.",
            labels=["peer"],
        )
        for p in list(self.sidecar.peers.values()):
            failures.add_metric([p.endpoint], p.failures)
        yield failures


class SidecarMetrics:
    """The registry of one admin app: the collector plus the two latency histograms."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SidecarCollector(sidecar))
        self.layer_seconds = Histogram(
            "kvsidecar_layer_transfer_seconds",
            "Per layer and peer: planning and Mooncake submit until the writes completed.",
            buckets=LAYER_BUCKETS,
            registry=self.registry,
        )
        self.handshake_seconds = Histogram(
            "kvsidecar_handshake_seconds",
            "Successful handshakes with a decode peer, Hello to validated metadata.",
            buckets=HANDSHAKE_BUCKETS,
            registry=self.registry,
        )
        self._detach = [
            sidecar.add_observer("layer", self.layer_seconds.observe),
            sidecar.add_observer("handshake", self.handshake_seconds.observe),
        ]

    def close(self) -> None:
        """Detach the histograms from the sidecar (a later app brings its own)."""
        for detach in self._detach:
            detach()
        self._detach = []
