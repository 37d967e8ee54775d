"""``kv-sidecar bench load``: both systems under open-loop load; goodput at an SLO."""
