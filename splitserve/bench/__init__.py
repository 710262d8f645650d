"""The library behind ``dynamo bench``: trace replay, sweeps, plots, graph runs.

Benchmark scripts live in ``benchmarks/`` (one home) and use this library; nothing here
is a script of its own.
"""
