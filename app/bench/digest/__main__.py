"""``python -m app.bench.digest`` runs the bench (``bench.main``)."""

from app.bench.digest.bench import main

main()
