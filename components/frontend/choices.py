"""The choices of one answer: fan-out of ``n`` worker requests and per-choice shaping.

``merged`` interleaves the choices' event streams as they come; a ``ChoiceShape`` keeps
one choice's state (echoed prompt, first chunk, log-probabilities) while the app turns
events into stream chunks or one body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.contracts.wire import worker_request

from .backend import StreamMeta
from .chat_output import ChoiceOutput, Delta, finish_reason, fold
from .responses import Event, LogprobShaper, merge_completion, usage

if TYPE_CHECKING:
    from .state import FrontendState, Prepared


def choice_request(state: FrontendState, p: Prepared, index: int, request_id: str
                   ) -> dict[str, Any]:
    """The worker request of choice ``index``: the request's sampling, and with a seed,
    seed + index (choices of one seeded request differ, and repeat across requests)."""
    s = p.req
    seed = s.seed
    if seed is not None and index:
        seed = (seed + index + 2**63) % 2**64 - 2**63  # stay a signed 64-bit integer
    output: dict[str, Any] = {}
    if s.top_logprobs_asked() is not None:
        output["logprobs"] = s.top_logprobs_asked()
    if s.prompt_logprobs_asked() is not None:
        output["prompt_logprobs"] = s.prompt_logprobs_asked()
    return worker_request(model=state.model_name, token_ids=p.token_ids,
                          max_tokens=p.max_tokens,
                          temperature=s.temperature if s.temperature is not None else 1.0,
                          top_p=s.top_p, seed=seed, eos_token_ids=state.codec.eos_token_ids,
                          request_id=request_id, priority=p.priority,
                          sampling=s.sampling_fields(), min_tokens=s.min_tokens,
                          output=output)


async def merged(streams: list[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """The events of every choice as they come (``n`` > 1 fans out); the first error of
    any choice ends them all.

    The other choices start once the first has produced its first event: its prompt is
    then in the worker's prefix cache (and known to KV-aware routers), so they reuse it
    instead of all computing it at once."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for ev in only:
                yield ev
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Event]) -> None:
        try:
            async for ev in stream:
                await queue.put(ev)
            await queue.put(done)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(streams[0]))]
    left = len(streams)
    try:
        while left:
            item = await queue.get()
            if len(tasks) == 1:
                tasks += [asyncio.create_task(pump(st)) for st in streams[1:]]
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def choice_metas(p: Prepared, priority: str | None) -> list[StreamMeta]:
    """One StreamMeta per choice; choice i > 0 of a fan-out is request ``id-i``."""
    return [StreamMeta(request_id=p.request_id if i == 0 else f"{p.request_id}-{i}",
                       priority=priority, prompt_tokens=len(p.token_ids), user=p.req.user,
                       metadata=p.req.metadata) for i in range(p.req.n)]


def usage_of(p: Prepared, metas: list[StreamMeta]) -> dict[str, Any]:
    return usage(len(p.token_ids), sum(m.output_tokens for m in metas),
                 metas[0].cached_tokens)


@dataclass
class ChoiceShape:
    """Per-choice response state: echo, first chunk, log-probability shaping."""

    kind: str
    shaper: LogprobShaper
    echo: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    first: bool = True
    parts: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish: str | None = None
    output: ChoiceOutput | None = None
    """Chat: splits the text into reasoning, content and tool calls."""

    def chat_delta(self, text: str, finish: str | None) -> Delta:
        """Chat: what ``text`` (and the end, when ``finish``) adds to this choice."""
        assert self.output is not None
        d = self.output.push(text)
        return d.add(self.output.finish()) if finish else d

    def chat_whole(self) -> tuple[Delta, str | None]:
        """Chat, not streamed: the whole answer and its finish reason."""
        assert self.output is not None
        whole = fold([self.chat_delta("".join(self.parts), self.finish or "stop")])
        return whole, finish_reason(self.finish, self.output)

    def logprobs_of(self, ev: Event) -> Any:
        """This event's log-probabilities in the endpoint's shape (None: none asked)."""
        if self.kind == "chat":
            return self.shaper.chat(ev.token_ids, ev.logprobs) if ev.logprobs else None
        parts = []
        if self.echo and ev.prompt_logprobs is not None:
            parts.append(self.shaper.completion(self.prompt_ids, ev.prompt_logprobs, True))
        if ev.logprobs is not None:
            parts.append(self.shaper.completion(ev.token_ids, ev.logprobs))
        return merge_completion(parts)

    def text_of(self, ev: Event) -> str:
        """This event's text, the echoed prompt first on a completion's first event."""
        if self.first and self.echo:
            return self.echo + ev.text
        return ev.text


def choice_shapes(state: FrontendState, p: Prepared) -> list[ChoiceShape]:
    echo = ""
    if p.kind == "completion" and p.req.echo:
        echo = (p.req.prompt if isinstance(p.req.prompt, str) else
                p.req.prompt[0] if isinstance(p.req.prompt[0], str) else
                state.codec.decode(p.token_ids))
    skip = frozenset(state.codec.eos_token_ids)
    with_lp = p.req.top_logprobs_asked() is not None
    kind = "completion" if p.kind == "completion" else "chat"
    return [ChoiceShape(kind, LogprobShaper(state.codec, skip,
                                            0 if with_lp and echo and
                                            p.req.prompt_logprobs_asked() is not None
                                            else len(echo)),
                        echo, p.token_ids,
                        output=ChoiceOutput(p.plan) if kind == "chat" else None)
            for _ in range(p.req.n)]


def joined(shape: ChoiceShape) -> Any:
    """A choice's log-probabilities over all its events (None when none were asked)."""
    if shape.kind == "chat":
        if not shape.logprobs:
            return None
        return [entry for part in shape.logprobs for entry in part]
    return merge_completion(shape.logprobs)
