"""Benchmarks as a product: trace replay, sweeps, plots (``dynamo bench``)."""
