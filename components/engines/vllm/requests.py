"""Mapping between this project's engine types and vLLM's request and output objects."""

from __future__ import annotations

import json
from typing import Any

from splitserve.contracts.engine import GenerateParams, TokenDelta
from splitserve.contracts.wire import FinishReason, TokenLogprobs

# vLLM's finish reasons (``vllm.v1.engine.FINISH_REASON_STRINGS``) in the contracts'
# vocabulary.  vLLM's ``stop`` is a stop token here (the adapter sends no stop strings);
# ``repetition`` (a repetitive pattern cut short) ended it without an error.
_FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.EOS, "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED, "error": FinishReason.ERROR,
    "repetition": FinishReason.EOS}

# What a prefill engine is asked for with NixlConnector: keep the KV for a remote
# decode engine to pull (the decode side gets the prefill output's params back).
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def sampling_params(p: GenerateParams, *, max_tokens: int | None = None,
                    kv_transfer_params: dict[str, Any] | None = None):
    """vLLM ``SamplingParams`` for one request, streaming deltas of token ids only.

    The stop token ids end generation like EOS (vLLM stops on the model's EOS by itself
    unless ``ignore_eos``); text is not detokenized here: the frontend owns text.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    return SamplingParams(
        n=1, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
        max_tokens=max_tokens if max_tokens is not None else p.max_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        detokenize=False, skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA, extra_args=extra,
        top_k=p.top_k, min_p=p.min_p, min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias) if p.logit_bias else None,
        logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
        structured_outputs=_structured(p))


def _structured(p: GenerateParams):
    """vLLM's structured-output params for a request with a JSON schema (else None)."""
    if p.json_schema is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=json.loads(p.json_schema))


def prompt(p: GenerateParams) -> dict[str, Any]:
    """vLLM's tokens prompt (the frontend already tokenised and templated it)."""
    return {"prompt_token_ids": list(p.token_ids)}


def generate_kwargs(request_id: str, p: GenerateParams,
                    lora_request: Any = None) -> dict[str, Any]:
    """``AsyncLLM.generate``'s keyword arguments besides the prompt and sampling params.

    ``priority``: vLLM's scheduler, run with ``--scheduling-policy priority``
    (``engine_args.extra_engine_args: {scheduling_policy: priority}``), serves lower
    values first, ties by arrival, as the request's level counts (0 = the most important
    class): it goes in as is.  Under vLLM's default ``fcfs`` policy it is ignored.
    ``lora_request``: the ``LoRARequest`` of the adapter ``p.lora`` names (the engine's
    ``LoraTable`` builds it); none for the base model."""
    kw: dict[str, Any] = {"request_id": request_id, "priority": p.priority}
    if lora_request is not None:
        kw["lora_request"] = lora_request
    return kw


def _position(entry, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """One position's ``{token_id: Logprob}``: the chosen token's log-probability and
    the ``n`` best (by vLLM's rank)."""
    ranked = sorted(((lp.rank or 0, tid, lp.logprob) for tid, lp in entry.items()
                     if lp.rank is not None and lp.rank <= n))
    return entry[token].logprob, [(tid, lp) for _, tid, lp in ranked[:n]]


def token_logprobs(entries, tokens, n: int) -> TokenLogprobs | None:
    """vLLM's per-position logprob dicts for ``tokens`` as TokenLogprobs (positions
    vLLM leaves empty, the first prompt token's, are skipped by the caller)."""
    if entries is None:
        return None
    out = TokenLogprobs()
    for entry, tok in zip(entries, tokens, strict=True):
        lp, top = _position(entry, tok, n)
        out.logprobs.append(lp)
        out.top.append(top)
    return out


def _logprobs_of(out, comp, tokens: tuple[int, ...], n_sampled: int, n_prompt: int
                 ) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if comp is not None and comp.logprobs is not None:
        found["logprobs"] = token_logprobs(list(comp.logprobs), tokens, n_sampled)
    prompt_lps = getattr(out, "prompt_logprobs", None)
    if prompt_lps is not None:
        ids = list(out.prompt_token_ids or ())[1:]
        found["prompt_logprobs"] = token_logprobs(list(prompt_lps)[1:], ids, n_prompt)
    return found


def to_delta(out, top_n: int = 0, prompt_top_n: int = 0) -> TokenDelta:
    """One vLLM ``RequestOutput`` (DELTA kind) as a TokenDelta; ``top_n`` and
    ``prompt_top_n``: the alternatives the request asked for per position."""
    comp = out.outputs[0] if out.outputs else None
    tokens = tuple(comp.token_ids) if comp is not None else ()
    reason = None
    if out.finished:
        raw = comp.finish_reason if comp is not None else "abort"
        reason = _FINISH.get(raw or "stop", FinishReason.EOS)
    return TokenDelta(
        token_ids=tokens, finished=bool(out.finished), finish_reason=reason,
        prompt_tokens=len(out.prompt_token_ids or ()),
        cached_tokens=int(getattr(out, "num_cached_tokens", 0) or 0),
        **_logprobs_of(out, comp, tokens, top_n, prompt_top_n))
