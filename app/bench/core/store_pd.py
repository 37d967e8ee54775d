"""The store-equipped peer of ``bench turns``: vLLM's ``MooncakeConnector`` pair with vLLM's
``MooncakeStoreConnector`` beside it, as vLLM documents P/D with a store (``MultiConnector``;
docs/features/mooncake_store_connector_usage.md of vLLM 0.32).

Prefill: ``MooncakeConnector`` as producer, ``MooncakeStoreConnector`` as ``kv_both`` (it looks
the prompt up in the store and saves what it computed). Decode: ``MooncakeConnector`` as
consumer, ``MooncakeStoreConnector`` as consumer with ``save_decode_cache`` (it fills the
prompt's blocks missing from the store, then saves each block its answer completes). The
``MooncakeConnector`` child comes first: on decode it is the one that loads the prompt prefill
sent (``MultiConnector`` gives a request to the first child that matches tokens).

The pair has a Mooncake master of its own, started with it and stopped with it: every start is
an empty store. Each engine gives the store ``segment_bytes``, as each kv-sidecar sidecar gives
its pool ``pool_segment_bytes``: the same capacity. The CPU shims are ``core.store_peer``'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from app.bench.core.systems import MooncakePD
from app.harness.engines import Instance
from app.store.master import free_port, start_master

STORE_PEER = "mooncake-store"
STORE_MODULE = "app.bench.core.store_peer"
LOCAL_BUFFER_BYTES = 64 << 20  # the store registers the KV cache itself; this is for its gets


class MooncakeStorePD(MooncakePD):
    """``MooncakePD`` with vLLM's Mooncake store on both engines (``segment_bytes`` each)."""

    segment_bytes: int = 2 << 30
    _lookup_ports: dict[str, int] = {}  # noqa: RUF012 (set per start)

    def start_instances(self, instances: Sequence[Instance]) -> None:
        if self.master is None:
            self.master = start_master(0, log_path=self.work / "mooncake-master.log")
        config = self.work / "mooncake-store.json"
        config.write_text(json.dumps(store_config(self.master.rpc_address, self.segment_bytes)))
        self.engine_env = {**self.engine_env, "MOONCAKE_CONFIG_PATH": str(config)}
        # Each engine's store serves its scheduler's lookups on a socket named by this port;
        # two engines on one host must not share it.
        self._lookup_ports = {inst.role: free_port() for inst in instances}
        super().start_instances(instances)

    def ktc(self, inst: Instance) -> dict[str, Any]:
        mooncake = super().ktc(inst)
        producer = inst is self.prefill
        role = "kv_producer" if producer else "kv_consumer"
        store: dict[str, Any] = {
            "kv_connector": "BenchMooncakeStoreConnector",
            "kv_connector_module_path": STORE_MODULE,
            "kv_role": "kv_both" if producer else "kv_consumer",
            "kv_connector_extra_config": {
                "lookup_rpc_port": self._lookup_ports[inst.role],
                **({} if producer else {"save_decode_cache": True}),
            },
        }
        child = {k: v for k, v in mooncake.items() if k != "engine_id"}
        child |= {
            "kv_connector": "BenchStoreMooncakeConnector",
            "kv_connector_module_path": STORE_MODULE,
        }
        return {
            "kv_connector": "MultiConnector",
            "kv_role": role,
            "engine_id": mooncake["engine_id"],
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [child, store]},
        }


def store_config(master: str, segment_bytes: int) -> dict[str, Any]:
    """``MOONCAKE_CONFIG_PATH``'s file: embedded mode (each engine gives ``segment_bytes``),
    TCP over loopback (the CPU host has no RDMA; kv-sidecar's pool uses TCP as well)."""
    return {
        "mode": "embedded",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master,
        "global_segment_size": segment_bytes,
        "local_buffer_size": LOCAL_BUFFER_BYTES,
        "protocol": "tcp",
        "device_name": "",
    }
