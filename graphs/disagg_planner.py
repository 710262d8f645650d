"""Disaggregated prefill and decode with the planner scaling both pools.

    dynamo serve graphs.disagg_planner:Frontend -f configs/disagg_planner.yaml
"""

from splitserve.serve.catalog import DecodeWorker, Frontend, Planner, PrefillWorker, Router

serving = Frontend.link(Router).link(DecodeWorker).link(PrefillWorker)
planning = Frontend.link(Planner)
