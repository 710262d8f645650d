"""vLLM's NixlConnector with NIXL's progress thread off, for CPU hosts.

vLLM creates its NIXL agent with NIXL's default config, whose UCX progress thread spins
on a whole core even while nothing moves.  On a 2-core host with a prefill and a decode
engine, two such threads halved decode speed (18.6 tok/s alone, ~10 with both spinning,
19 with both off, in a two-process check).  Without the thread, UCX progresses only when
vLLM polls its transfers and notifications, once per engine step.  That suits a decode
engine (it steps while it waits for KV) but not an idle prefill engine: in the served
graph the decode engine's UCX connection to a prefill engine without the thread was
never answered and its reads hung.  Hence ``VllmKvTransfer.progress_thread``: off for
decode engines, on for prefill engines in the CPU config.

vLLM loads this module in its own worker process (``kv_connector_module_path``) and
looks the class up by the ``kv_connector`` name, so it keeps the name ``NixlConnector``
(vLLM's own checks for NIXL go by that name too).  Nothing happens at import time.
"""

from __future__ import annotations

import functools

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)


def _without_progress_thread() -> None:
    """Make vLLM's NIXL worker build its agent config with ``enable_prog_thread=False``
    (vLLM exposes no setting for it).  Called in the worker process, before the agent
    exists; idempotent."""
    make = base_worker.nixl_agent_config
    if make is None or isinstance(make, functools.partial):
        return  # NIXL unavailable (vLLM reports it) or already done
    base_worker.nixl_agent_config = functools.partial(make, enable_prog_thread=False)


class NixlConnector(_VllmNixlConnector):
    """vLLM's pull-mode NixlConnector, unchanged except for the agent's progress thread."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        if role == KVConnectorRole.WORKER:
            _without_progress_thread()
        super().__init__(vllm_config, role, kv_cache_config)
