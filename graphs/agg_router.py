"""Aggregated serving behind the KV-aware router.

    dynamo serve graphs.agg_router:Frontend -f configs/agg_router.yaml
"""

from splitserve.serve.catalog import Frontend, Router, Worker

graph = Frontend.link(Router).link(Worker)
