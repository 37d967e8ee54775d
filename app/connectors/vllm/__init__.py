"""vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``) backed by a kv-sidecar.

Installed, the package registers the connector by name (``plugin.register``, a
``vllm.general_plugins`` entry point): ``--kv-transfer-config '{"kv_connector":
"KVSidecarConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"sidecar":
"ipc:///run/kvs/engine.ipc"}}'``. Where it is only on ``PYTHONPATH``, add
``"kv_connector_module_path": "app.connectors.vllm"``.
"""

from app.connectors.vllm.connector import KVSidecarConnector

__all__ = ["KVSidecarConnector"]
