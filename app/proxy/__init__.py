"""The P/D router in front of vLLM instances (``kv-sidecar proxy``): concurrent or decode first."""

from app.proxy.app import create_proxy
from app.proxy.config import Flow, Policy, ProxyConfig
from app.proxy.errors import NoHealthyInstance, ProxyError, TargetError

__all__ = [
    "Flow",
    "NoHealthyInstance",
    "Policy",
    "ProxyConfig",
    "ProxyError",
    "TargetError",
    "create_proxy",
]
