"""Mapping between this project's engine types and TensorRT-LLM's LLM API objects.

The three request types of a disaggregated TensorRT-LLM deployment:
``context_only`` (a prefill engine: compute the prompt's KV, sample the first token and
return ``disaggregated_params`` with its ``opaque_state``), ``generation_only`` (a decode
engine: take those params back and fetch the KV through the cache transceiver), and
``context_and_generation`` (a decode engine prefilling locally).  The opaque state is
bytes; on the wire (the prefill job's reply) it travels base64-encoded, as in Dynamo.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Literal

from splitserve.contracts.engine import GenerateParams, OpaqueHandoff, TokenDelta
from splitserve.contracts.wire import FinishReason, TokenLogprobs

RequestType = Literal["context_only", "generation_only", "context_and_generation"]

# TensorRT-LLM's finish reasons in the contracts' vocabulary (an unknown one ended the
# request normally: EOS).
_FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.EOS, "end_id": FinishReason.EOS, "stop_words": FinishReason.STOP,
    "length": FinishReason.LENGTH, "cancelled": FinishReason.CANCELLED,
    "abort": FinishReason.CANCELLED, "timeout": FinishReason.CANCELLED}


def sampling_kwargs(p: GenerateParams, *, max_tokens: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.SamplingParams`` for one request.  A context
    phase (``max_tokens`` 1) keeps the request's stop conditions, ``ignore_eos`` and
    ``min_tokens`` included, as Dynamo's prefill handler does: without them the context
    phase may stop on EOS at its one token and never hand off."""
    kw: dict[str, Any] = {
        "max_tokens": max_tokens if max_tokens is not None else p.max_tokens,
        "temperature": p.temperature, "top_p": p.top_p, "ignore_eos": p.ignore_eos,
        "detokenize": False,
    }
    if p.stop_token_ids:
        kw["stop_token_ids"] = list(p.stop_token_ids)
    if p.min_tokens:
        kw["min_tokens"] = p.min_tokens
    if p.seed is not None:
        kw["seed"] = p.seed
    if p.top_k > 0:
        kw["top_k"] = p.top_k
    if p.min_p > 0:
        kw["min_p"] = p.min_p
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        if getattr(p, name) != neutral:
            kw[name] = getattr(p, name)
    if p.logprobs is not None:
        # TensorRT-LLM returns log-probabilities only for a count of at least one (0
        # reads as "off"); the sampled token's own comes with them, and the reader cuts
        # the alternatives back to the request's count.
        kw["logprobs"] = max(1, p.logprobs)
    return kw


def guided_kwargs(p: GenerateParams) -> dict[str, Any] | None:
    """Keyword arguments of ``GuidedDecodingParams`` for a request with a JSON schema
    (``json``: the schema's text, which TensorRT-LLM hands its grammar backend as is),
    or None for an unconstrained one."""
    if p.json_schema is None:
        return None
    return {"json": p.json_schema}


def _position(entry: Any, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """One position of ``CompletionOutput.logprobs``: a ``{token_id: Logprob(logprob,
    rank)}`` dict (the sampled token and the best alternatives), or a bare float where
    the engine kept only the sampled token's."""
    if not isinstance(entry, dict):
        return float(entry), []
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0,
                                                   -kv[1].logprob))
    return float(entry[token].logprob), [(int(t), float(lp.logprob)) for t, lp in ranked[:n]]


def handoff_from_params(params: Any) -> OpaqueHandoff:
    """A context result's ``DisaggregatedParams`` as a JSON-able handoff (every field,
    ``opaque_state`` base64-encoded)."""
    fields = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params)
    state = fields.get("opaque_state")
    if isinstance(state, (bytes, bytearray)):
        fields["opaque_state"] = base64.b64encode(bytes(state)).decode("ascii")
    return OpaqueHandoff(disaggregated_params=fields)


def params_fields(handoff: OpaqueHandoff, request_type: RequestType) -> dict[str, Any]:
    """The ``DisaggregatedParams`` fields for the generation request: the context
    result's, with ``opaque_state`` as bytes again and the request type replaced."""
    fields = dict(handoff.disaggregated_params or {})
    if not fields:
        raise ValueError("a generation_only request needs the context phase's params")
    state = fields.get("opaque_state")
    if isinstance(state, str):
        fields["opaque_state"] = base64.b64decode(state)
    fields["request_type"] = request_type
    return fields


class DeltaCursor:
    """TensorRT-LLM streams the cumulative token ids (and log-probabilities) of a
    request; this turns each ``RequestOutput`` into what is new since the last one.
    ``top_n``: the alternatives the request asked for per token (None: no logprobs)."""

    def __init__(self, top_n: int | None = None) -> None:
        self.seen = 0
        self.top_n = top_n

    def _logprobs(self, comp: Any, tokens: list[int], start: int) -> TokenLogprobs | None:
        if self.top_n is None or comp is None:
            return None
        entries = list(getattr(comp, "logprobs", None) or ())
        if len(entries) < len(tokens):
            raise RuntimeError(f"TensorRT-LLM sent {len(entries)} logprobs for "
                               f"{len(tokens)} tokens")
        out = TokenLogprobs()
        for entry, tok in zip(entries[start:len(tokens)], tokens[start:], strict=True):
            lp, top = _position(entry, tok, self.top_n)
            out.logprobs.append(lp)
            out.top.append(top)
        return out

    def delta(self, out: Any) -> TokenDelta:
        comp = out.outputs[0] if out.outputs else None
        tokens = list(comp.token_ids) if comp is not None else []
        new = tuple(int(t) for t in tokens[self.seen:])
        logprobs = self._logprobs(comp, tokens, self.seen)
        self.seen = len(tokens)
        reason = None
        if out.finished:
            raw = getattr(comp, "finish_reason", None) if comp is not None else "abort"
            reason = _FINISH.get(str(raw or "stop"), FinishReason.EOS)
        return TokenDelta(token_ids=new, finished=bool(out.finished), finish_reason=reason,
                          prompt_tokens=len(getattr(out, "prompt_token_ids", None) or ()),
                          cached_tokens=int(getattr(out, "cached_tokens", 0) or 0),
                          logprobs=logprobs)
