"""Disaggregated prefill and decode behind the KV-aware router (same shape as
graphs.disagg; its configs use the KV-aware policies and several decode workers).

    dynamo serve graphs.disagg_router:Frontend -f configs/disagg_router.yaml
"""

from splitserve.serve.catalog import DecodeWorker, Frontend, PrefillWorker, Router

graph = Frontend.link(Router).link(DecodeWorker).link(PrefillWorker)
