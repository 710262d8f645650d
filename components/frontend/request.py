"""The request as it moves through the frontend's stages, one type per stage.

    parse    → ``Parsed``      the validated body of one endpoint (``pipeline.parse``)
    prepare  → ``Prepared``    + prompt ids, output budget, request id, output plan
                               (``pipeline.prepare``)
    route    → ``WorkerCall``  one choice's request to a worker (``pipeline.worker_calls``);
                               a router's placement (``placed``) and a migration
                               (``resumed``) each return a new call, never edit one
    stream   → ``Event``       what one worker chunk adds to a choice (``pipeline.events``)
    render   → bytes / body    the endpoint's renderer (``render.renderer_for``)

Every stage reads the previous stage's value and returns its own; nothing is rewritten
in place, so a request can be followed by its type from the HTTP body to the wire dict
(``WorkerCall.to_wire``, the only place that dict is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from splitserve.contracts.wire import KV_SOURCE, RouteReply, worker_request

from .chat_output import OutputPlan
from .openai_types import ChatCompletionRequest, CompletionRequest


class Endpoint(StrEnum):
    """The three generating endpoints; each is served by the same stages and answered by
    its own renderer."""

    CHAT = "chat"
    COMPLETION = "completion"
    RESPONSES = "responses"

    @property
    def label(self) -> str:
        """The endpoint label of the frontend's request metrics."""
        return _LABELS[self]

    @property
    def prompt_param(self) -> str:
        """The body field that holds the prompt (named by context-length errors)."""
        return _PROMPT_PARAMS[self]

    @property
    def templated(self) -> bool:
        """The prompt goes through the chat template and the answer through the output
        plan (reasoning, content, tool calls)."""
        return self is not Endpoint.COMPLETION


_LABELS = {Endpoint.CHAT: "chat", Endpoint.COMPLETION: "completions",
           Endpoint.RESPONSES: "responses"}
_PROMPT_PARAMS = {Endpoint.CHAT: "messages", Endpoint.COMPLETION: "prompt",
                  Endpoint.RESPONSES: "input"}


@dataclass(frozen=True)
class Parsed:
    """A body validated for its endpoint (400s are raised before one exists)."""

    endpoint: Endpoint
    req: ChatCompletionRequest | CompletionRequest
    """The request the stages serve: a Responses request becomes the chat request it
    stands for."""
    priority: str
    """The priority class the client asked for (its header; "default" without one)."""
    responses: Any = None
    """The Responses request as the client sent it (``Endpoint.RESPONSES`` only)."""


@dataclass(frozen=True)
class Prepared(Parsed):
    """A parsed request, tokenised and fitted to the context window."""

    token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 1
    request_id: str = ""
    plan: OutputPlan = field(default_factory=OutputPlan)
    """How the answer's text splits into reasoning, content and tool calls."""
    base_model: str = ""
    """The served model whose workers serve the request: ``req.model`` itself, or the
    base model of the LoRA adapter ``req.model`` names."""
    lora: str | None = None
    """The LoRA adapter the request is served with (``req.model`` names one)."""

    @property
    def n(self) -> int:
        return self.req.n

    def choice_id(self, index: int) -> str:
        """Choice ``index``'s request id: choice i > 0 of a fan-out is ``id-i``."""
        return self.request_id if index == 0 else f"{self.request_id}-{index}"


@dataclass(frozen=True)
class WorkerCall:
    """One choice's request to a worker, typed; ``to_wire`` builds the dict that goes on
    the wire (Dynamo's PreprocessedRequest shape, read by ``contracts.wire.WorkerRequest``).
    """

    model: str
    token_ids: tuple[int, ...]
    max_tokens: int
    request_id: str
    priority: str
    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = 1.0
    top_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    """Further SamplingOptions fields (penalties, bias, top-k, guided decoding)."""
    output: Mapping[str, Any] = field(default_factory=dict)
    """OutputOptions fields (log-probabilities)."""
    priority_level: int | None = None
    """The class's level in the placing router's priority table (None: not placed by a
    router that ranks)."""
    prefill_locally: bool = False
    kv_source: Mapping[str, Any] | None = None
    """Where a drained replica parked this request's KV (a resumed request only)."""
    lora: str | None = None
    """The LoRA adapter to serve the request with (``model`` is then its base model)."""
    tpot_ms: float | None = None
    """The TPOT target of the class the router placed it in (for the decode worker)."""

    @classmethod
    def of_choice(cls, p: Prepared, index: int, model: str,
                  eos_token_ids: list[int]) -> WorkerCall:
        """Choice ``index`` of ``p`` for the workers of ``model`` (the base model of an
        adapter request, which carries ``p.lora``): the request's sampling, and with a
        seed, seed + index (choices of one seeded request differ, and repeat across
        requests)."""
        s = p.req
        seed = s.seed
        if seed is not None and index:
            seed = (seed + index + 2**63) % 2**64 - 2**63  # stay a signed 64-bit integer
        output: dict[str, Any] = {}
        if s.top_logprobs_asked() is not None:
            output["logprobs"] = s.top_logprobs_asked()
        if s.prompt_logprobs_asked() is not None:
            output["prompt_logprobs"] = s.prompt_logprobs_asked()
        return cls(model=model, token_ids=tuple(p.token_ids), max_tokens=p.max_tokens,
                   request_id=p.choice_id(index), priority=p.priority,
                   eos_token_ids=tuple(eos_token_ids),
                   temperature=s.temperature if s.temperature is not None else 1.0,
                   top_p=s.top_p, seed=seed, min_tokens=s.min_tokens,
                   sampling=s.sampling_fields(), output=output, lora=p.lora)

    def placed(self, reply: RouteReply, max_tokens: int) -> WorkerCall:
        """This call as the router placed it: its resolved class and level, its output
        budget (the router's cap, never above ``max_tokens``) and whether the worker
        prefills locally."""
        capped = reply.max_tokens if reply.max_tokens is not None else max_tokens
        return dataclasses.replace(self, priority=reply.class_name,
                                   priority_level=reply.class_level,
                                   max_tokens=min(capped, max_tokens),
                                   prefill_locally=bool(reply.prefill_locally),
                                   tpot_ms=reply.tpot_ms)

    def resumed(self, prompt: tuple[int, ...], generated: list[int], max_tokens: int,
                min_tokens: int, kv_source: Mapping[str, Any] | None) -> WorkerCall:
        """The call that continues after ``generated`` (the tokens the client has):
        ``prompt`` plus them, what is left of the budget; with ``kv_source`` (a drained
        replica kept the KV of all of them but the last) the next worker reads that KV
        instead of recomputing it."""
        ids = (*prompt, *generated)
        keep_kv = kv_source is not None and kv_source.get("tokens") == len(ids) - 1
        return dataclasses.replace(
            self, token_ids=ids, max_tokens=max_tokens - len(generated),
            min_tokens=max(0, min_tokens - len(generated)) if min_tokens else self.min_tokens,
            kv_source=kv_source if keep_kv else None)

    def to_wire(self) -> dict[str, Any]:
        """The dict sent to the worker (plain dict: it goes straight onto the wire)."""
        wire = worker_request(model=self.model, token_ids=list(self.token_ids),
                              max_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed,
                              eos_token_ids=list(self.eos_token_ids),
                              request_id=self.request_id, priority=self.priority,
                              sampling=dict(self.sampling), min_tokens=self.min_tokens,
                              output=dict(self.output), lora=self.lora)
        own = wire["extra_args"]["splitserve"]
        if self.priority_level is not None:
            own["priority_level"] = self.priority_level
        if self.prefill_locally:
            own["prefill_locally"] = True
        if self.tpot_ms is not None:
            own["tpot_ms"] = self.tpot_ms
        if self.kv_source is not None:
            own[KV_SOURCE] = dict(self.kv_source)
        return wire
