"""Answer bodies: a non-streamed answer, chat / completion stream chunks and the Responses
API event stream, built from the choices' shapes as their events arrive.

Called by ``app.py`` once a request has been admitted and its events are flowing; the
accounting (in-flight counts, metrics) stays there.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .backend import StreamMeta
from .chat_output import finish_reason, message
from .choices import ChoiceShape, joined, usage_of
from .responses import envelope, final_choice, stream_choice
from .responses_api import new_id, response_object, response_usage, status_of
from .responses_stream import ResponseEvents, output_items

if TYPE_CHECKING:
    from .state import FrontendState, Prepared


def answer_body(state: FrontendState, p: Prepared, shapes: list[ChoiceShape],
            metas: list[StreamMeta]) -> dict[str, Any]:
    """The body of a non-streamed answer, once every choice has ended."""
    created = int(time.time())
    if p.kind == "completion":
        choices = [final_choice(p.kind, i, "".join(sh.parts), sh.finish, joined(sh))
                   for i, sh in enumerate(shapes)]
        return envelope(p.request_id, p.kind, False, created, state.model_name, choices,
                        usage_of(p, metas))
    wholes = [sh.chat_whole() for sh in shapes]
    if p.kind == "responses":
        whole, finish = wholes[0]
        return response_object(p.responses, new_id("resp"), created, output_items(whole),
                               status_of(finish), responses_usage_of(p, metas))
    choices = [final_choice("chat", i, whole.content, finish, joined(sh), message(whole))
               for i, (sh, (whole, finish)) in enumerate(zip(shapes, wholes, strict=True))]
    return envelope(p.request_id, p.kind, False, created, state.model_name, choices,
                    usage_of(p, metas))


def responses_usage_of(p: Prepared, metas: list[StreamMeta]) -> dict[str, Any]:
    u = usage_of(p, metas)
    return response_usage(u["prompt_tokens"], u["completion_tokens"],
                          u["prompt_tokens_details"]["cached_tokens"])


def sse_data(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


async def chat_chunks(state: FrontendState, p: Prepared, metas: list[StreamMeta],
                  shapes: list[ChoiceShape], created: int, events) -> AsyncIterator[bytes]:
    """Chat and completion stream chunks, one per event that adds something."""
    for_chat = p.kind != "completion"
    async for ev in events:
        shape = shapes[ev.index]
        lp = shape.logprobs_of(ev)
        text = shape.text_of(ev)
        fields, finish = None, ev.finish
        if for_chat:
            fields = shape.chat_delta(text, ev.finish).fields()
            finish = finish_reason(ev.finish, shape.output)
        if (fields if for_chat else text) or ev.finish or shape.first or lp is not None:
            choice = stream_choice("chat" if for_chat else p.kind, ev.index, text, finish,
                                   shape.first, lp, fields)
            shape.first = False
            yield sse_data(envelope(p.request_id, p.kind, True, created,
                                     state.model_name, [choice]))
    if p.req.include_usage_in_stream():
        yield sse_data(envelope(p.request_id, p.kind, True, created, state.model_name,
                                 [], usage_of(p, metas)))


async def response_events(p: Prepared, metas: list[StreamMeta], shapes: list[ChoiceShape],
                           revents: ResponseEvents, events) -> AsyncIterator[bytes]:
    """The Responses API event stream of the request's one choice."""
    for e in revents.start():
        yield event_data(e)
    finish = None
    async for ev in events:
        finish = ev.finish or finish
        for e in revents.push(shapes[0].chat_delta(shapes[0].text_of(ev), ev.finish)):
            yield event_data(e)
    for e in revents.end(finish, responses_usage_of(p, metas)):
        yield event_data(e)


def event_data(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
