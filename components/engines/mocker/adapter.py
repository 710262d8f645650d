"""Dynamo's mocker engines behind the engine interface, for the decode coordinator and
the prefill loop (``components/worker/coordinator.py``, ``prefill_loop.py``).

A mocker replica owns one child process per role (``children.py``): a decode worker has a
decode-mode engine (requests prefilled remotely) and an aggregated one (local prefills: a
decode-mode mocker does not simulate prefill compute); a prefill worker has a
prefill-mode engine.  The handoff is the prefill engine's opaque
``disaggregated_params``; the prefill worker's first token is streamed by ``decode``
before the decode-mode engine continues with one token less.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from splitserve.contracts.kit.waiting import poll_until
from splitserve.contracts.engine import (
    EngineCapabilities,
    EngineHandoff,
    EngineInfo,
    GenerateParams,
    KvEventSink,
    LoadSample,
    OpaqueHandoff,
    PrefillResult,
    TokenDelta,
    TorchBlocksHandoff,
    WithoutFailureReport,
    WithoutHandoffFirst,
    WithoutLora,
    WithoutKvMoves,
    WithoutKvPush,
    WithoutPrefixLookup,
)
from splitserve.contracts.wire import FinishReason

# Dynamo's mocker speaks Dynamo's LLMEngineOutput, whose finish reasons are the
# contracts' vocabulary itself: ``FinishReason.from_wire`` reads them.


def engine_request(model: str, request_id: str, params: GenerateParams, *,
                   max_tokens: int | None = None, handoff: Any = None) -> dict[str, Any]:
    """The request a mocker child receives (Dynamo's PreprocessedRequest shape)."""
    req: dict[str, Any] = {
        "model": model, "token_ids": list(params.token_ids),
        "stop_conditions": {"max_tokens": max_tokens or params.max_tokens,
                            "ignore_eos": params.ignore_eos},
        "sampling_options": {"temperature": params.temperature, "top_p": params.top_p,
                             "seed": params.seed},
        "eos_token_ids": list(params.stop_token_ids), "annotations": [],
        "extra_args": {"splitserve": {"request_id": request_id}},
    }
    if handoff is not None:
        req["prefill_result"] = {"disaggregated_params": handoff}
    return req


def kv_usage_estimate(tokens_in_flight: int, block_size: int, num_blocks: int) -> float:
    """KV use of a mocker replica, whose engines do not report it to us: the blocks the
    in-flight requests need (prompt + max_tokens, at most) over one engine's capacity,
    clamped to [0, 1]."""
    return min(1.0, math.ceil(tokens_in_flight / block_size) / num_blocks)


def usage_of(chunk: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a mocker chunk's ``completion_usage``."""
    usage = chunk.get("completion_usage")
    if not isinstance(usage, dict):
        return 0, 0
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0)


class MockerEngine(WithoutFailureReport, WithoutPrefixLookup, WithoutHandoffFirst,
                   WithoutKvPush, WithoutKvMoves, WithoutLora):
    """The mocker children of one replica as an ``Engine``.

    ``children`` maps roles to ``EngineChild``-like objects (``stream(request,
    idle_timeout_s)``): ``local`` and ``decode`` on a decode worker, ``prefill`` on a
    prefill worker.  It prefills locally only with a ``local`` child; the children
    move their KV themselves, publish their own KV events, and end the replica through
    its host when they exit, so no optional ability is needed here.
    """

    info: EngineInfo

    def __init__(self, children: dict[str, Any], model: str, block_size: int,
                 num_blocks: int, idle_timeout_s: float) -> None:
        self.children, self.model = children, model
        self.block_size, self.num_blocks = block_size, num_blocks
        self.idle_timeout_s = idle_timeout_s
        self.info = EngineInfo(name="mocker", kv_block_size=block_size,
                               capabilities=EngineCapabilities(
                                   local_prefill="local" in children, pushes_kv=False,
                                   handoff_before_prefill=False, prefix_lookup=False,
                                   moves_kv=False, reports_failure=False,
                                   local_prefill_own_batch=True))
        self.active = 0
        self.tokens_in_flight = 0

    async def start(self) -> None:
        """Nothing to do: the shell starts the children and waits for their registration."""

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        await poll_until(lambda: not self.active, drain_timeout_s)

    def validate(self, params: GenerateParams) -> None:
        """Nothing is checked before queueing (as before the check was declared): the
        request goes to the children as it is."""

    async def _stream(self, role: str, request: dict[str, Any], params: GenerateParams,
                      skip_first_usage: bool = False) -> AsyncIterator[TokenDelta]:
        cost = len(params.token_ids) + params.max_tokens
        self.active += 1
        self.tokens_in_flight += cost
        try:
            async for chunk in self.children[role].stream(request, self.idle_timeout_s):
                reason = chunk.get("finish_reason")
                if reason == FinishReason.ERROR or chunk.get("error"):
                    raise RuntimeError(f"{role} engine: {chunk.get('error') or chunk}")
                prompt, cached = usage_of(chunk)
                yield TokenDelta(token_ids=tuple(chunk.get("token_ids") or ()),
                                 finished=reason is not None,
                                 finish_reason=FinishReason.from_wire(reason) if reason
                                 else None,
                                 prompt_tokens=prompt or len(params.token_ids),
                                 cached_tokens=cached)
                if reason is not None:
                    return
        finally:
            self.active -= 1
            self.tokens_in_flight -= cost

    def generate(self, request_id: str, params: GenerateParams) -> AsyncIterator[TokenDelta]:
        """Aggregated: the replica's aggregated engine prefills and decodes."""
        return self._stream("local", engine_request(self.model, request_id, params), params)

    async def prefill(self, request_id: str, params: GenerateParams,
                      destination: TorchBlocksHandoff | None = None) -> PrefillResult:
        """The prefill-mode engine answers one token carrying ``disaggregated_params``
        when the simulated prefill is done and ends its stream after the simulated KV
        transfer, so the result returns when the KV would have arrived."""
        t0 = time.monotonic()
        first: dict[str, Any] | None = None
        t_first = t0
        request = engine_request(self.model, request_id, params, max_tokens=1)
        async for chunk in self.children["prefill"].stream(request, self.idle_timeout_s):
            if chunk.get("finish_reason") == FinishReason.ERROR or chunk.get("error"):
                raise RuntimeError(f"prefill engine error: {chunk}")
            if first is None and chunk.get("token_ids"):
                first, t_first = chunk, time.monotonic()
        if first is None:
            raise RuntimeError("prefill engine ended without a token")
        return PrefillResult(
            first_token=first["token_ids"][0],
            handoff=OpaqueHandoff(disaggregated_params=first.get("disaggregated_params")),
            cached_tokens=usage_of(first)[1], compute_s=t_first - t0,
            transfer_s=time.monotonic() - t_first)

    async def decode(self, request_id: str, params: GenerateParams, handoff: EngineHandoff,
                     first_token: int | None = None) -> AsyncIterator[TokenDelta]:
        """The prefill's first token, then the rest on the decode-mode engine."""
        if not isinstance(handoff, OpaqueHandoff) or first_token is None:
            raise ValueError("a mocker decode needs an opaque handoff and the first token")
        done = params.max_tokens == 1
        yield TokenDelta(token_ids=(first_token,), finished=done,
                         finish_reason=FinishReason.LENGTH if done else None,
                         prompt_tokens=len(params.token_ids))
        if done:
            return
        request = engine_request(self.model, request_id, params,
                                 max_tokens=params.max_tokens - 1,
                                 handoff=handoff.disaggregated_params)
        async for d in self._stream("decode", request, params):
            yield d

    async def abort(self, request_id: str) -> None:
        """Closing a child's stream cancels the request there; nothing else to do."""

    async def run_kv_events(self, sink: KvEventSink,
                            ready: asyncio.Event | None = None) -> None:
        """The children publish their KV events to Dynamo themselves."""
        if ready is not None:
            ready.set()

    def load(self) -> LoadSample:
        """No KV figures come back from the children: the blocks the in-flight requests
        need (prompt + max_tokens at most) stand in for KV use."""
        usage = kv_usage_estimate(self.tokens_in_flight, self.block_size, self.num_blocks)
        return LoadSample(active=self.active, waiting=0,
                          kv_used_blocks=round(usage * self.num_blocks),
                          kv_total_blocks=self.num_blocks)

    def inflight(self) -> int:
        return self.active
