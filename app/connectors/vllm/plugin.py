"""vLLM general plugin: registers ``KVSidecarConnector`` with vLLM's connector factory by name.

Installed with the package (entry point group ``vllm.general_plugins``), so
``--kv-transfer-config '{"kv_connector": "KVSidecarConnector", ...}'`` works without
``kv_connector_module_path``. vLLM calls plugins in every process it starts, perhaps more than
once in one process: registering is idempotent, and nothing is imported until vLLM makes a
connector.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVSidecarConnector"


def register() -> None:
    """Name the connector in vLLM's ``KVConnectorFactory`` (lazily loaded, as vLLM's own)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "app.connectors.vllm.connector", "KVSidecarConnector"
    )
