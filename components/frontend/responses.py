"""OpenAI response shapes: choices, stream chunks, usage and log-probabilities.

Pure functions of what the workers returned; ``app.py`` calls them once per chunk (stream)
or once per request (non-stream).  Log-probabilities follow OpenAI's two shapes: chat
``choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs}`` and completions
``choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from splitserve.contracts.wire import NO_LOGPROB, FinishReason, TokenLogprobs

from .textcodec import TextCodec

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
        text = self.text(tok)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode())}

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


def object_name(kind: str, stream: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def stream_choice(kind: str, index: int, text: str | None, finish: str | None, first: bool,
                  logprobs: Any = None, fields: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """One choice of a stream chunk; ``logprobs`` already in the endpoint's shape; chat's
    ``fields`` (content, reasoning_content, tool_calls) stand for ``text`` when given."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if fields is not None:
            delta.update(fields)
        elif text:
            delta["content"] = text
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
    return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}


def final_choice(kind: str, index: int, text: str, finish: str | None,
                 logprobs: Any = None, message: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """One choice of a non-streamed answer; ``logprobs`` already in the endpoint's shape;
    chat's ``message`` (with reasoning or tool calls) stands for ``text`` when given."""
    if kind == "chat":
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
        return {"index": index, "message": message or {"role": "assistant", "content": text},
                "finish_reason": finish, "logprobs": lp}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def envelope(request_id: str, kind: str, stream: bool, created: int, model: str,
             choices: list[dict[str, Any]], usage_obj: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": object_name(kind, stream),
                            "created": created, "model": model, "choices": choices}
    if usage_obj is not None:
        body["usage"] = usage_obj
    return body
