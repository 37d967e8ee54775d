"""What the pool costs: ``kv-sidecar bench pool-vs-direct`` and ``python -m
app.bench.pool.saves``."""
