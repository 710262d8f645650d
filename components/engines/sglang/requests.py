"""Mapping between this project's engine types and SGLang's request and output dicts.

``sglang.Engine.async_generate`` takes token ids and a sampling-params dict and, with
``stream=True`` and ``incremental_streaming_output``, yields one dict per step whose
``output_ids`` are only the new tokens and whose ``meta_info`` carries the finish reason
and the prompt / cached token counts.
"""

from __future__ import annotations

import secrets
from typing import Any

from splitserve.components.engines.interface import (
    GenerateParams,
    SglangBootstrapHandoff,
    TokenDelta,
)

# SGLang finish types -> the interface's
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def new_bootstrap_room() -> int:
    """A bootstrap room id: random, non-negative, below 2**63 (SGLang keys its transfer
    state by room, so two live requests must never share one)."""
    return secrets.randbits(63)


def sampling_params(p: GenerateParams, *, max_new_tokens: int | None = None) -> dict[str, Any]:
    """SGLang's sampling-params dict for one request.

    The stop token ids end generation like EOS (SGLang also stops on the model's EOS
    unless ``ignore_eos``); no text is produced: the frontend owns detokenisation.
    """
    sp: dict[str, Any] = {
        "n": 1, "temperature": p.temperature, "top_p": p.top_p,
        "max_new_tokens": max_new_tokens if max_new_tokens is not None else p.max_tokens,
        "ignore_eos": p.ignore_eos, "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if p.stop_token_ids:
        sp["stop_token_ids"] = list(p.stop_token_ids)
    if p.min_tokens:
        sp["min_new_tokens"] = p.min_tokens
    if p.seed is not None:
        sp["sampling_seed"] = p.seed
    sp.update(_shaping(p))
    return sp


def _shaping(p: GenerateParams) -> dict[str, Any]:
    """SGLang's names for the penalties, cuts and bias a request sets (only those)."""
    sp: dict[str, Any] = {}
    if p.top_k > 0:
        sp["top_k"] = p.top_k
    if p.min_p > 0:
        sp["min_p"] = p.min_p
    if p.min_tokens:
        sp["min_new_tokens"] = p.min_tokens
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(p, name):
            sp[name] = getattr(p, name)
    if p.repetition_penalty != 1.0:
        sp["repetition_penalty"] = p.repetition_penalty
    if p.logit_bias:
        sp["logit_bias"] = {str(t): b for t, b in p.logit_bias}
    return sp


def generate_kwargs(request_id: str, p: GenerateParams, *, max_new_tokens: int | None = None,
                    handoff: SglangBootstrapHandoff | None = None) -> dict[str, Any]:
    """Keyword arguments of one ``Engine.async_generate`` call.

    ``handoff`` makes it a disaggregated request: a prefill engine (with
    ``max_new_tokens=1``) and the decode engine get the same bootstrap triple; SGLang
    pairs them by room and moves the KV itself.
    """
    kw: dict[str, Any] = {
        "input_ids": list(p.token_ids),
        "sampling_params": sampling_params(p, max_new_tokens=max_new_tokens),
        "stream": True, "rid": request_id,
    }
    if handoff is not None:
        kw.update(bootstrap_host=handoff.bootstrap_host,
                  bootstrap_port=handoff.bootstrap_port,
                  bootstrap_room=handoff.bootstrap_room)
    return kw


def to_delta(out: dict[str, Any]) -> TokenDelta:
    """One streamed SGLang output dict as a TokenDelta.

    An ``abort`` finish whose message names an error (SGLang reports engine-side
    failures as aborts with a status code) becomes ``error``.
    """
    meta = out.get("meta_info") or {}
    fin = meta.get("finish_reason")
    reason = None
    if fin:
        kind = fin.get("type", "stop") if isinstance(fin, dict) else str(fin)
        reason = _FINISH.get(kind, "error")
        if reason == "abort" and isinstance(fin, dict) and int(fin.get("status_code") or 0) >= 500:
            reason = "error"
    return TokenDelta(
        token_ids=tuple(int(t) for t in out.get("output_ids") or ()),
        finished=fin is not None and fin != {}, finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0))


def finish_message(out: dict[str, Any]) -> str:
    """SGLang's own words for why a request ended (empty when it did not say)."""
    fin = (out.get("meta_info") or {}).get("finish_reason")
    return str(fin.get("message") or "") if isinstance(fin, dict) else ""
