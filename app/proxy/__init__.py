"""The P/D router in front of vLLM instances (``kv-sidecar proxy``): decode first, DESIGN §2."""

from app.proxy.app import create_proxy
from app.proxy.config import Policy, ProxyConfig
from app.proxy.errors import NoHealthyInstance, ProxyError, TargetError

__all__ = [
    "NoHealthyInstance",
    "Policy",
    "ProxyConfig",
    "ProxyError",
    "TargetError",
    "create_proxy",
]
