"""``kv-sidecar bench faults``: faults injected under load, and how goodput comes back."""
