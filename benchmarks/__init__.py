"""jaxlens benchmarks: scripts with a ``main(argv) -> dict``; ``python -m benchmarks`` runs all."""
