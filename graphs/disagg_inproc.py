"""Disaggregated prefill and decode with the routing service inside the frontend
(`Frontend.routing: in_process`): no Router process, the frontend places each request on
a DecodeWorker itself.

    dynamo serve graphs.disagg_inproc:Frontend -f configs/mocker_disagg_inproc.yaml
"""

from splitserve.serve.catalog import DecodeWorker, Frontend, PrefillWorker

graph = Frontend.link(DecodeWorker).link(PrefillWorker)
