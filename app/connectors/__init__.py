"""Inference-engine connectors that drive a kv-sidecar."""
