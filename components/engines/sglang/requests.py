"""Mapping between this project's engine types and SGLang's request and output dicts.

``sglang.Engine.async_generate`` takes token ids and a sampling-params dict and, with
``stream=True`` and ``incremental_streaming_output``, yields one dict per step whose
``output_ids`` are only the new tokens and whose ``meta_info`` carries the finish reason
and the prompt / cached token counts.  Log-probabilities are the exception: SGLang's
``meta_info`` lists them for the whole request so far (``output_token_logprobs`` as
``(logprob, token_id, text)``, ``output_top_logprobs`` as a list of those per position),
so ``LogprobReader`` keeps a cursor.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.contracts.engine import (
    GenerateParams,
    SglangBootstrapHandoff,
    TokenDelta,
)
from splitserve.contracts.wire import FinishReason, TokenLogprobs

# SGLang's finish types in the contracts' vocabulary (its ``stop`` is a stop token here:
# the adapter sends no stop strings); any other type is an error, as is an ``abort``
# with a server-side status (``to_delta``).
_FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.EOS, "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED}


@dataclass(frozen=True)
class SglangPriority:
    """How an SGLang server takes a request's ``priority`` (its ServerArgs).

    Only a server started with ``enable_priority_scheduling`` is sent one: SGLang
    schedules by it only then, and one started with ``abort_on_priority_when_disabled``
    aborts requests that carry one otherwise.  SGLang serves higher values first unless
    ``schedule_low_priority_values_first``; a request's level counts the other way (0 =
    the most important class), so it goes in negated, or as is for a low-first server.
    """

    enabled: bool = False
    low_values_first: bool = False

    @classmethod
    def of(cls, server_args: Mapping[str, Any]) -> SglangPriority:
        """The convention of a server given ``server_args`` (``extra_server_args``)."""
        return cls(enabled=bool(server_args.get("enable_priority_scheduling")),
                   low_values_first=bool(server_args.get("schedule_low_priority_values_first")))

    def value(self, level: int) -> int | None:
        """SGLang's ``priority`` for a request at ``level``; None: send none."""
        if not self.enabled:
            return None
        return level if self.low_values_first else -level


NO_PRIORITY = SglangPriority()


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
    if p.json_schema is not None:
        # SGLang's own field: the schema as JSON text, compiled by its grammar backend
        # (xgrammar unless the engine was started with another).
        sp["json_schema"] = p.json_schema
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


FAKE_BOOTSTRAP_HOST = "2.2.2.2"
"""SGLang's ``disaggregation.utils.FAKE_BOOTSTRAP_HOST``: a prefill request naming it
runs without a decode peer (its KV is dropped), which is how a prefill engine is warmed
up before it serves."""


def warmup_kwargs(dp_rank: int, bootstrap_port: int) -> dict[str, Any]:
    """One warm-up request for data-parallel rank ``dp_rank`` of a prefill engine: a short
    prompt through the disaggregated path, with no decode peer (as Dynamo's worker warms
    every prefill rank)."""
    return {"input_ids": [10, 11, 12, 13], "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": bootstrap_port,
            "bootstrap_room": dp_rank, "routed_dp_rank": dp_rank,
            "rid": sglang_rid(f"warmup-{dp_rank}")}


def sglang_rid(request_id: str) -> str:
    """The id SGLang knows a request by.  SGLang's scheduler aborts every request whose
    id *starts with* the aborted one (``scheduler.py``: ``req.rid.startswith(...)``), so
    aborting ``job@1`` would also end ``job@10``; the ids given to it are made
    prefix-free: the id with ``%`` and ``$`` escaped, then one ``$``, which no other
    given id can continue."""
    return request_id.replace("%", "%25").replace("$", "%24") + "$"


def generate_kwargs(request_id: str, p: GenerateParams, *, max_new_tokens: int | None = None,
                    handoff: SglangBootstrapHandoff | None = None,
                    priority: SglangPriority = NO_PRIORITY) -> dict[str, Any]:
    """Keyword arguments of one ``Engine.async_generate`` call.

    ``handoff`` makes it a disaggregated request: a prefill engine (with
    ``max_new_tokens=1``) and the decode engine get the same bootstrap triple; SGLang
    pairs them by room and moves the KV itself.  ``priority``: the server's convention
    for the request's level (none is sent unless it schedules by priority).
    """
    kw: dict[str, Any] = {
        "input_ids": list(p.token_ids),
        "sampling_params": sampling_params(p, max_new_tokens=max_new_tokens),
        "stream": True, "rid": sglang_rid(request_id),
    }
    kw.update(logprob_kwargs(p))
    rank = priority.value(p.priority)
    if rank is not None:
        kw["priority"] = rank
    if p.lora is not None:
        kw["lora_path"] = p.lora  # SGLang looks adapters up by name in lora_path
    if handoff is not None:
        kw.update(bootstrap_host=handoff.bootstrap_host,
                  bootstrap_port=handoff.bootstrap_port,
                  bootstrap_room=handoff.bootstrap_room)
    return kw


def logprob_kwargs(p: GenerateParams) -> dict[str, Any]:
    """``async_generate``'s log-probability arguments for ``p`` (none when it asks for
    none).  SGLang has one ``top_logprobs_num`` for prompt and output: the larger of the
    two counts is asked for and ``LogprobReader`` cuts each side to its own.  Prompt
    log-probabilities start at position 0 (``logprob_start_len``); otherwise SGLang's
    default (-1) skips the prompt."""
    if p.logprobs is None and p.prompt_logprobs is None:
        return {}
    kw: dict[str, Any] = {"return_logprob": True,
                          "top_logprobs_num": max(p.logprobs or 0, p.prompt_logprobs or 0)}
    if p.prompt_logprobs is not None:
        kw["logprob_start_len"] = 0
    return kw


def _top(entry, n: int) -> list[tuple[int, float]]:
    """One position of SGLang's top-logprobs list (None where it computed none)."""
    return [(int(tid), float(lp)) for lp, tid, *_ in (entry or ())[:n]]


def _run(values, tops, n: int) -> TokenLogprobs:
    return TokenLogprobs(logprobs=[float(v[0]) for v in values],
                         top=[_top(tops[i] if i < len(tops) else None, n)
                              for i in range(len(values))])


class LogprobReader:
    """Turns SGLang's streamed logprob lists into per-delta runs, for a request that
    asked for ``top_n`` alternatives per output token (None: no output logprobs) and
    ``prompt_top_n`` per prompt token (None: no prompt logprobs).

    With incremental streaming (which the adapter turns on) SGLang sends the output
    logprobs of each chunk's own tokens only (``tokenizer_manager.py``,
    ``_INCREMENTAL_STREAMING_META_INFO_KEYS``), while the prompt's come whole in every
    chunk: the first are read per chunk, the second once."""

    def __init__(self, top_n: int | None, prompt_top_n: int | None) -> None:
        self.top_n, self.prompt_top_n = top_n, prompt_top_n
        self.prompt_sent = False

    @classmethod
    def for_params(cls, p: GenerateParams) -> LogprobReader | None:
        """A reader for ``p``, or None when it asks for no log-probabilities."""
        if p.logprobs is None and p.prompt_logprobs is None:
            return None
        return cls(p.logprobs, p.prompt_logprobs)

    def read(self, meta: dict[str, Any], n_new: int) -> dict[str, Any]:
        """The TokenDelta fields for the ``n_new`` tokens of one output: their
        log-probabilities and, once, the prompt's (the first prompt token has none, as
        in vLLM's and OpenAI's shape)."""
        found: dict[str, Any] = {}
        if self.top_n is not None:
            values = list(meta.get("output_token_logprobs") or ())
            tops = list(meta.get("output_top_logprobs") or ())
            if len(values) != n_new:
                raise RuntimeError(f"SGLang sent {len(values)} output logprobs for a chunk "
                                   f"of {n_new} tokens")
            found["logprobs"] = _run(values, tops[:n_new], self.top_n)
        if self.prompt_top_n is not None and not self.prompt_sent:
            values = list(meta.get("input_token_logprobs") or ())
            if values:
                tops = list(meta.get("input_top_logprobs") or ())
                found["prompt_logprobs"] = _run(values[1:], tops[1:], self.prompt_top_n)
                self.prompt_sent = True
        return found


def to_delta(out: dict[str, Any], logprobs: LogprobReader | None = None) -> TokenDelta:
    """One streamed SGLang output dict as a TokenDelta; ``logprobs``: the request's
    reader when it asked for log-probabilities.

    An ``abort`` finish whose message names an error (SGLang reports engine-side
    failures as aborts with a status code) becomes ``error``.
    """
    meta = out.get("meta_info") or {}
    fin = meta.get("finish_reason")
    reason = None
    if fin:
        kind = fin.get("type", "stop") if isinstance(fin, dict) else str(fin)
        reason = _FINISH.get(kind, FinishReason.ERROR)
        if (reason == FinishReason.CANCELLED and isinstance(fin, dict)
                and int(fin.get("status_code") or 0) >= 500):
            reason = FinishReason.ERROR
    tokens = tuple(int(t) for t in out.get("output_ids") or ())
    return TokenDelta(
        token_ids=tokens, finished=fin is not None and fin != {}, finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        **(logprobs.read(meta, len(tokens)) if logprobs is not None else {}))


def finish_message(out: dict[str, Any]) -> str:
    """SGLang's own words for why a request ended (empty when it did not say)."""
    fin = (out.get("meta_info") or {}).get("finish_reason")
    return str(fin.get("message") or "") if isinstance(fin, dict) else ""
