"""``kv-sidecar bench soak``: a long run at a steady load; what grows."""
