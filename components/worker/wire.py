"""The wire <-> engine mapping every worker shell uses: one place for each fact.

- ``params_from_wire``: a wire ``WorkerRequest`` as the engine interface's
  ``GenerateParams`` (unset wire fields take the engines' neutral values);
- ``priority_of``: the request's priority level (``contracts/priority.py``): the one
  the router put on it, or its class name ranked by the built-in table;
- ``delta_chunk``: one engine delta as one wire output chunk (engines and the wire share
  one finish vocabulary, ``contracts.wire.FinishReason``: nothing is translated);
- ``check_adapter``: a request for a LoRA adapter (``extra_args.splitserve.lora``, which
  ``params_from_wire`` maps to ``GenerateParams.lora``) refused by name on an engine
  that serves none.

Called by the aggregated shell, the decode coordinator and the engine adapters' tests;
nothing here imports an engine library.
"""

from __future__ import annotations

import json

from splitserve.contracts.engine import EngineInfo, GenerateParams, TokenDelta
from splitserve.contracts.priority import DEFAULT_TABLE
from splitserve.contracts.wire import FinishReason, RequestMeta, WorkerRequest, output_chunk


def priority_of(meta: RequestMeta) -> int:
    """The level the engine schedules a request at: the router's (its QoS table's), or,
    for a request no router ranked, its class name's in the built-in table (a name that
    table lacks is the default class: ``contracts/priority.py``'s rule)."""
    if meta.priority_level is not None:
        return meta.priority_level
    return DEFAULT_TABLE.level_of(meta.priority)


def params_from_wire(wreq: WorkerRequest) -> GenerateParams:
    """The engine's view of a wire request; called once per request by every shell (the
    aggregated one and the decode one alike).  Raises ValueError for a request no engine
    can serve: no prompt, or no ``max_tokens`` >= 1 (the frontend always sets one; a
    worker does not guess a length for other callers)."""
    s, sc, o = wreq.sampling_options, wreq.stop_conditions, wreq.output_options
    if not wreq.token_ids or not sc.max_tokens or sc.max_tokens < 1:
        raise ValueError("token_ids and max_tokens >= 1 are required")
    meta = wreq.meta()

    def given(v, neutral):
        return neutral if v is None else v

    return GenerateParams(
        token_ids=tuple(wreq.token_ids), max_tokens=sc.max_tokens,
        temperature=given(s.temperature, 1.0), top_p=given(s.top_p, 1.0), seed=s.seed,
        stop_token_ids=tuple(wreq.eos_token_ids) + tuple(sc.stop_token_ids_hidden or ()),
        ignore_eos=bool(sc.ignore_eos), min_tokens=sc.min_tokens or 0,
        priority=priority_of(meta),
        top_k=max(0, given(s.top_k, 0)), min_p=given(s.min_p, 0.0),
        presence_penalty=given(s.presence_penalty, 0.0),
        frequency_penalty=given(s.frequency_penalty, 0.0),
        repetition_penalty=given(s.repetition_penalty, 1.0),
        logit_bias=tuple(sorted((s.logit_bias or {}).items())),
        logprobs=o.logprobs, prompt_logprobs=o.prompt_logprobs,
        json_schema=_schema_text(s.guided_decoding), lora=meta.lora or None)


def check_adapter(params: GenerateParams, info: EngineInfo) -> None:
    """Refuse (ValueError naming the adapter and the engine) a request for a LoRA adapter
    on an engine that serves none; called by every shell before ``engine.validate``, which
    refuses an adapter a LoRA engine has not loaded."""
    if params.lora is not None and not info.capabilities.serves_lora:
        raise ValueError(f"the LoRA adapter '{params.lora}' cannot be served: the "
                         f"{info.name} engine serves no LoRA adapters")


def _schema_text(guided) -> str | None:
    if guided is None or guided.json_schema is None:
        return None
    return json.dumps(guided.json_schema, sort_keys=True)


def delta_chunk(d: TokenDelta, produced: int) -> dict:
    """One wire chunk for engine delta ``d``; ``produced`` counts this request's tokens
    so far, ``d``'s included (the final chunk carries the usage)."""
    if not d.finished:
        return output_chunk(list(d.token_ids), logprobs=d.logprobs,
                            prompt_logprobs=d.prompt_logprobs)
    return output_chunk(list(d.token_ids), d.finish_reason or FinishReason.EOS,
                        prompt_tokens=d.prompt_tokens, cached_tokens=d.cached_tokens,
                        completion_tokens=produced, logprobs=d.logprobs,
                        prompt_logprobs=d.prompt_logprobs)
