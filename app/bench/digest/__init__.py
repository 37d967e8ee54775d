"""``python -m app.bench.digest``: what the KV digest costs."""
