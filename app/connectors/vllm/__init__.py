"""vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``) backed by a kv-sidecar.

Load it with ``--kv-transfer-config '{"kv_connector": "KVSidecarConnector",
"kv_connector_module_path": "app.connectors.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"sidecar": "ipc:///run/kvs/engine.ipc"}}'``.
"""

from app.connectors.vllm.connector import KVSidecarConnector

__all__ = ["KVSidecarConnector"]
