"""The benches: ``core`` (what two or more benches use) and one package per bench on top of it.

A bench imports ``app.bench.core`` and never another bench (tests/bench/test_bench_layers.py)."""
