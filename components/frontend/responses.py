"""OpenAI response shapes: choices, stream chunks, usage and log-probabilities.

Pure functions of what the workers returned; the renderers (``render.py``) call them once
per chunk (stream) or once per request (non-stream).  Log-probabilities follow OpenAI's two shapes: chat
``choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs}`` and completions
``choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from splitserve.contracts.wire import NO_LOGPROB, FinishReason, TokenLogprobs

from .textcodec import TextCodec
from .token_bytes import token_bytes_of

OPENAI_FINISH: dict[FinishReason, str] = {
    FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
    # Never in a body: the frontend answers a cancelled or failed request with an HTTP
    # error before writing one (``app.next_chunk``); OpenAI would call it stop.
    FinishReason.CANCELLED: "stop", FinishReason.ERROR: "stop",
}


def openai_finish_reason(reason: FinishReason) -> str:
    """OpenAI's ``finish_reason`` for the project's: the one place the vocabulary is
    translated (``tool_calls`` then replaces ``stop`` for a chat choice that called a
    tool: ``chat_output.finish_reason``)."""
    return OPENAI_FINISH[reason]


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else NO_LOGPROB


@dataclass
class Event:
    """What one worker chunk of one choice adds to the answer."""

    index: int
    text: str
    finish: str | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    text_ids: list[int] | None = None
    """The token ids ``text`` was decoded from, when it is theirs alone
    (``Detokenizer.text_ids``); None: unknown, a parser re-encodes the text."""


@dataclass
class LogprobShaper:
    """Turns one choice's token log-probabilities into OpenAI's shapes.

    ``offset`` runs over the characters already returned (completions' text_offset)."""

    codec: TextCodec
    skip_ids: frozenset[int]
    offset: int = 0

    def text(self, token: int) -> str:
        return self.codec.decode([token])

    def chat(self, ids: list[int], lps: TokenLogprobs) -> list[dict[str, Any]]:
        """Chat ``logprobs.content`` entries for ``ids``."""
        out = []
        for tok, lp, top in zip(ids, lps.logprobs, _tops(lps, len(ids)), strict=True):
            if tok in self.skip_ids:
                continue
            out.append({**self._entry(tok, lp),
                        "top_logprobs": [self._entry(t, v) for t, v in top]})
        return out

    def _entry(self, tok: int, lp: float) -> dict[str, Any]:
        # The token's own bytes, not its decoded text's: a token holding part of a UTF-8
        # character decodes alone to U+FFFD.
        return {"token": self.text(tok), "logprob": _finite(lp),
                "bytes": list(token_bytes_of(self.codec)(tok))}

    def completion(self, ids: list[int], lps: TokenLogprobs | None,
                   first_is_unscored: bool = False) -> dict[str, Any]:
        """Completions ``logprobs`` for ``ids``; ``first_is_unscored``: ``ids`` start the
        prompt, whose first token has no log-probability (null, as OpenAI sends it)."""
        part: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        values = list(lps.logprobs) if lps else []
        tops = _tops(lps, len(values)) if lps else []
        if first_is_unscored:
            values, tops = [None, *values], [None, *tops]
        # Every token is listed, EOS too: harnesses such as lm-eval slice these lists by
        # token position (prompt length, and the last one as the generated token).
        for tok, lp, top in zip(ids, values, tops, strict=False):
            text = self.text(tok)
            part["tokens"].append(text)
            part["token_logprobs"].append(None if lp is None else _finite(lp))
            part["top_logprobs"].append(None if top is None else
                                        {self.text(t): _finite(v) for t, v in top})
            part["text_offset"].append(self.offset)
            self.offset += len(text)
        return part


def _tops(lps: TokenLogprobs, n: int) -> list[list[tuple[int, float]]]:
    tops = [list(t) for t in lps.top]
    return tops + [[] for _ in range(n - len(tops))]


def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One completions ``logprobs`` object from the parts of a choice, in order."""
    if not parts:
        return None
    out: dict[str, Any] = {k: [] for k in parts[0]}
    for part in parts:
        for k, v in part.items():
            out[k] += v
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object (the prompt counts once, whatever ``n``)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_stream_choice(index: int, finish: str | None, first: bool, logprobs: Any,
                       fields: dict[str, Any]) -> dict[str, Any]:
    """One choice of a chat stream chunk: the role on the first, then ``fields``
    (content, reasoning_content, tool_calls); ``logprobs`` already in chat's shape."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    delta.update(fields)
    lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}


def completion_stream_choice(index: int, text: str | None, finish: str | None,
                             logprobs: Any = None) -> dict[str, Any]:
    """One choice of a completions stream chunk."""
    return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}


def chat_final_choice(index: int, finish: str | None, logprobs: Any,
                      message: dict[str, Any]) -> dict[str, Any]:
    """One choice of a non-streamed chat answer; ``message`` holds the content,
    reasoning and tool calls."""
    lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}


def completion_final_choice(index: int, text: str, finish: str | None,
                            logprobs: Any = None) -> dict[str, Any]:
    """One choice of a non-streamed completions answer."""
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def envelope(request_id: str, object_name: str, created: int, model: str,
             choices: list[dict[str, Any]], usage_obj: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": object_name, "created": created,
                            "model": model, "choices": choices}
    if usage_obj is not None:
        body["usage"] = usage_obj
    return body
