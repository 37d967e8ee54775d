"""``kv-sidecar bench routing``: routing policies under eviction."""
