"""Mapping between this project's engine types and vLLM's request and output objects."""

from __future__ import annotations

from typing import Any

from splitserve.components.engines.interface import GenerateParams, TokenDelta

# vLLM finish reasons -> the interface's
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}

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
        output_kind=RequestOutputKind.DELTA, extra_args=extra)


def prompt(p: GenerateParams) -> dict[str, Any]:
    """vLLM's tokens prompt (the frontend already tokenised and templated it)."""
    return {"prompt_token_ids": list(p.token_ids)}


def to_delta(out) -> TokenDelta:
    """One vLLM ``RequestOutput`` (DELTA kind) as a TokenDelta."""
    comp = out.outputs[0] if out.outputs else None
    tokens = tuple(comp.token_ids) if comp is not None else ()
    reason = None
    if out.finished:
        raw = comp.finish_reason if comp is not None else "abort"
        reason = _FINISH.get(raw or "stop", "stop")
    return TokenDelta(
        token_ids=tokens, finished=bool(out.finished), finish_reason=reason,
        prompt_tokens=len(out.prompt_token_ids or ()),
        cached_tokens=int(getattr(out, "num_cached_tokens", 0) or 0))
