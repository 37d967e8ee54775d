"""``python -m app.bench.scaling`` runs the bench (``bench.main``)."""

from app.bench.scaling.bench import main

main()
