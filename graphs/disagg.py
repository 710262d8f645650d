"""Disaggregated prefill and decode behind the router.

    dynamo serve graphs.disagg:Frontend -f configs/disagg.yaml
"""

from splitserve.serve.catalog import DecodeWorker, Frontend, PrefillWorker, Router

graph = Frontend.link(Router).link(DecodeWorker).link(PrefillWorker)
