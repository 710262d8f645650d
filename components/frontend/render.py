"""Stage 5: one request's events rendered as its endpoint answers: a body, or a stream.

A ``Renderer`` per endpoint (``renderer_for``): chat completions, completions and the
Responses API differ only here.  Each holds one ``Choice`` per choice of the request
(its text so far, its first chunk, its log-probabilities in the endpoint's shape) and
turns events into a non-streamed body (``collect`` then ``body``) or SSE bytes
(``stream``, ``error``, ``trailer``).  The accounting (in-flight counts, metrics) stays
in ``app.py``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .backend import StreamMeta
from .chat_output import ChoiceOutput, Delta, finish_reason, fold, message
from .errors import APIError
from .request import Endpoint, Prepared
from .responses import (
    Event,
    LogprobShaper,
    chat_final_choice,
    chat_stream_choice,
    completion_final_choice,
    completion_stream_choice,
    envelope,
    merge_completion,
    usage,
)
from .responses_api import new_id, response_object, response_usage, status_of
from .responses_stream import ResponseEvents, output_items
from .state import FrontendState


_JSON = msgspec.json.Encoder()
"""Encodes every streamed chunk: compact UTF-8 JSON, about a tenth of ``json.dumps``'s
time on a chat chunk (3 µs a chunk, paid for every token streamed).  A float that JSON
cannot hold (NaN, infinities) becomes null rather than the invalid ``NaN``."""


def sse_data(body: dict[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(body) + b"\n\n"


def event_data(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _JSON.encode(event) + b"\n\n"


@dataclass
class Choice:
    """One choice's answer so far."""

    shaper: LogprobShaper
    first: bool = True
    parts: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish: str | None = None

    def text_of(self, ev: Event) -> str:
        return ev.text

    def logprobs_of(self, ev: Event) -> Any:
        """This event's log-probabilities in the endpoint's shape (None: none asked)."""
        raise NotImplementedError

    def joined(self) -> Any:
        """The log-probabilities over all events (None when none were asked)."""
        raise NotImplementedError

    def collect(self, ev: Event) -> None:
        """Add ``ev`` to a non-streamed answer."""
        self.parts.append(self.text_of(ev))
        self.first = False
        lp = self.logprobs_of(ev)
        if lp is not None:
            self.logprobs.append(lp)
        self.finish = ev.finish or self.finish


@dataclass
class CompletionChoice(Choice):
    echo: str = ""
    """The prompt, echoed before the first event's text (``echo: true``)."""
    prompt_ids: list[int] = field(default_factory=list)

    def text_of(self, ev: Event) -> str:
        return self.echo + ev.text if self.first and self.echo else ev.text

    def logprobs_of(self, ev: Event) -> Any:
        parts = []
        if self.echo and ev.prompt_logprobs is not None:
            parts.append(self.shaper.completion(self.prompt_ids, ev.prompt_logprobs, True))
        if ev.logprobs is not None:
            parts.append(self.shaper.completion(ev.token_ids, ev.logprobs))
        return merge_completion(parts)

    def joined(self) -> Any:
        return merge_completion(self.logprobs)


@dataclass
class ChatChoice(Choice):
    output: ChoiceOutput | None = None
    """Splits the text into reasoning, content and tool calls."""
    ids: list[int] | None = field(default_factory=list)
    """Not streamed: the token ids the collected text was decoded from (None: unknown)."""

    def collect(self, ev: Event) -> None:
        super().collect(ev)
        if ev.text_ids is None:
            self.ids = None
        elif self.ids is not None:
            self.ids += ev.text_ids

    def delta(self, text: str, finish: str | None, ids: list[int] | None = None) -> Delta:
        """What ``text`` (decoded from ``ids``, when known) and the end, when ``finish``,
        add to this choice."""
        assert self.output is not None
        d = self.output.push(text, ids)
        return d.add(self.output.finish()) if finish else d

    def whole(self) -> tuple[Delta, str | None]:
        """Not streamed: the whole answer and its finish reason."""
        assert self.output is not None
        whole = fold([self.delta("".join(self.parts), self.finish or "stop", self.ids)])
        return whole, finish_reason(self.finish, self.output)

    def logprobs_of(self, ev: Event) -> Any:
        return self.shaper.chat(ev.token_ids, ev.logprobs) if ev.logprobs else None

    def joined(self) -> Any:
        if not self.logprobs:
            return None
        return [entry for part in self.logprobs for entry in part]


class Renderer:
    """One request's answer in its endpoint's shape."""

    def __init__(self, state: FrontendState, p: Prepared, metas: list[StreamMeta]) -> None:
        self.state, self.p, self.metas = state, p, metas
        self.lane = state.lane(p.req.model)
        self.created = int(time.time())
        self.choices = [self.new_choice() for _ in range(p.n)]

    def new_choice(self) -> Choice:
        raise NotImplementedError

    def shaper(self, offset: int = 0) -> LogprobShaper:
        return LogprobShaper(self.lane.codec, frozenset(self.lane.codec.eos_token_ids),
                             offset)

    def usage(self) -> dict[str, Any]:
        return usage(len(self.p.token_ids), sum(m.output_tokens for m in self.metas),
                     self.metas[0].cached_tokens)

    def _envelope(self, stream: bool, choices: list[dict[str, Any]],
                  usage_obj: dict[str, Any] | None = None) -> dict[str, Any]:
        return envelope(self.p.request_id, self.object_name(stream), self.created,
                        self.lane.name, choices, usage_obj)

    def object_name(self, stream: bool) -> str:
        raise NotImplementedError

    def collect(self, ev: Event) -> None:
        """Non-streamed: add ``ev`` to its choice."""
        self.choices[ev.index].collect(ev)

    def body(self) -> dict[str, Any]:
        """Non-streamed: the body, once every choice has ended."""
        raise NotImplementedError

    def chunk(self, ev: Event) -> dict[str, Any] | None:
        """Streamed: the chunk ``ev`` adds (None when it adds nothing)."""
        raise NotImplementedError

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """Streamed: chunks as the events come, then the usage chunk if asked."""
        async for ev in events:
            chunk = self.chunk(ev)
            if chunk is not None:
                yield sse_data(chunk)
        if self.p.req.include_usage_in_stream():
            yield sse_data(self._envelope(True, [], self.usage()))

    def error(self, err: APIError) -> bytes:
        """Streamed: a failure after the stream began."""
        return sse_data(err.body())

    def trailer(self) -> bytes | None:
        """Streamed: what ends the stream."""
        return b"data: [DONE]\n\n"


class CompletionRenderer(Renderer):
    def new_choice(self) -> Choice:
        p = self.p
        echo = ""
        if p.req.echo:
            echo = (p.req.prompt if isinstance(p.req.prompt, str) else
                    p.req.prompt[0] if isinstance(p.req.prompt[0], str) else
                    self.lane.codec.decode(p.token_ids))
        # With prompt log-probabilities the echoed prompt's offsets come from its tokens.
        with_prompt_lp = (p.req.top_logprobs_asked() is not None and echo
                          and p.req.prompt_logprobs_asked() is not None)
        return CompletionChoice(self.shaper(0 if with_prompt_lp else len(echo)),
                                echo=echo, prompt_ids=p.token_ids)

    def object_name(self, stream: bool) -> str:
        return "text_completion"

    def body(self) -> dict[str, Any]:
        choices = [completion_final_choice(i, "".join(c.parts), c.finish, c.joined())
                   for i, c in enumerate(self.choices)]
        return self._envelope(False, choices, self.usage())

    def chunk(self, ev: Event) -> dict[str, Any] | None:
        c = self.choices[ev.index]
        lp = c.logprobs_of(ev)
        text = c.text_of(ev)
        if not (text or ev.finish or c.first or lp is not None):
            return None
        c.first = False
        return self._envelope(True, [completion_stream_choice(ev.index, text, ev.finish,
                                                              lp)])


class ChatRenderer(Renderer):
    choices: list[ChatChoice]

    def new_choice(self) -> ChatChoice:
        return ChatChoice(self.shaper(), output=ChoiceOutput(self.p.plan))

    def object_name(self, stream: bool) -> str:
        return "chat.completion.chunk" if stream else "chat.completion"

    def body(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            whole, finish = c.whole()
            choices.append(chat_final_choice(i, finish, c.joined(), message(whole)))
        return self._envelope(False, choices, self.usage())

    def chunk(self, ev: Event) -> dict[str, Any] | None:
        c = self.choices[ev.index]
        lp = c.logprobs_of(ev)
        fields = c.delta(c.text_of(ev), ev.finish, ev.text_ids).fields()
        finish = finish_reason(ev.finish, c.output)
        if not (fields or ev.finish or c.first or lp is not None):
            return None
        choice = chat_stream_choice(ev.index, finish, c.first, lp, fields)
        c.first = False
        return self._envelope(True, [choice])


class ResponsesRenderer(ChatRenderer):
    """The Responses API: the request's one choice as a Response object or its events."""

    def __init__(self, state: FrontendState, p: Prepared, metas: list[StreamMeta]) -> None:
        super().__init__(state, p, metas)
        self.events = ResponseEvents(p.responses, new_id("resp"), self.created)

    def response_usage(self) -> dict[str, Any]:
        u = self.usage()
        return response_usage(u["prompt_tokens"], u["completion_tokens"],
                              u["prompt_tokens_details"]["cached_tokens"])

    def body(self) -> dict[str, Any]:
        whole, finish = self.choices[0].whole()
        return response_object(self.p.responses, new_id("resp"), self.created,
                               output_items(whole), status_of(finish),
                               self.response_usage())

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        for e in self.events.start():
            yield event_data(e)
        finish = None
        only = self.choices[0]
        async for ev in events:
            finish = ev.finish or finish
            for e in self.events.push(only.delta(only.text_of(ev), ev.finish, ev.text_ids)):
                yield event_data(e)
        for e in self.events.end(finish, self.response_usage()):
            yield event_data(e)

    def error(self, err: APIError) -> bytes:
        return event_data(self.events.error(err.code, err.message, err.param))

    def trailer(self) -> bytes | None:
        return None


RENDERERS: dict[Endpoint, type[Renderer]] = {
    Endpoint.CHAT: ChatRenderer,
    Endpoint.COMPLETION: CompletionRenderer,
    Endpoint.RESPONSES: ResponsesRenderer,
}


def renderer_for(state: FrontendState, p: Prepared, metas: list[StreamMeta]) -> Renderer:
    return RENDERERS[p.endpoint](state, p, metas)
