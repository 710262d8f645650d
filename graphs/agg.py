"""Aggregated serving: the frontend calls workers directly (round-robin).

    dynamo serve graphs.agg:Frontend -f configs/agg.yaml
"""

from splitserve.serve.catalog import Frontend, Worker

graph = Frontend.link(Worker)
