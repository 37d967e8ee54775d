"""The P/D router in front of vLLM instances (``kv-sidecar proxy``)."""

from app.proxy.router import ProxyConfig, create_proxy

__all__ = ["ProxyConfig", "create_proxy"]
