"""``python -m app.bench.scaling``: one transfer's costs as the prompt grows."""
