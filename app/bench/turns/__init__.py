"""``kv-sidecar bench turns``: multi-turn conversations against the store-equipped peer."""
