"""The package names its connector in vLLM's factory through vLLM's own plugin loading.

Every real-engine test (``app.harness.local_pd``) names the connector without a module path,
so each engine they start is the check that vLLM's processes load the plugin.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="the registry is vLLM's")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins


def test_the_installed_entry_point_names_the_connector() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kv_sidecar"]
    assert ep.value == "app.connectors.vllm.plugin:register"
    load_general_plugins()
    load_general_plugins()  # vLLM may load plugins more than once in a process
    cls = KVConnectorFactory.get_connector_class_by_name("KVSidecarConnector")
    assert cls.__module__ == "app.connectors.vllm.connector"
