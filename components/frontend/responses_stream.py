"""Output items of a Response and its event stream, from one chat choice's deltas.

``output_items`` gives a finished answer's items (reasoning, message, function calls);
``ResponseEvents`` turns the deltas of a streamed one into the official event sequence:
``response.created``, ``response.in_progress``, then per item ``output_item.added``,
``content_part.added``, text / reasoning / arguments deltas and their ``done`` events,
``output_item.done``, and finally ``response.completed`` (or ``response.incomplete``)
carrying the whole Response.  Every event has a ``sequence_number``.
"""

from __future__ import annotations

from typing import Any

from .chat_output import Delta
from .responses_api import ResponsesRequest, new_id, response_object, status_of


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


def call_item(item_id: str, call: dict[str, Any], arguments: str, status: str
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


def output_items(whole: Delta) -> list[dict[str, Any]]:
    """The output of a finished answer (``whole``: its folded deltas)."""
    items = []
    if whole.reasoning:
        items.append(reasoning_item(new_id("rs"), whole.reasoning, "completed"))
    if whole.content or not whole.tool_calls:
        items.append(message_item(new_id("msg"), whole.content, "completed"))
    items += [call_item(new_id("fc"), c, c["function"]["arguments"], "completed")
              for c in whole.tool_calls]
    return items


class ResponseEvents:
    """The event sequence of one streamed Response; one item is open at a time."""

    def __init__(self, r: ResponsesRequest, response_id: str, created: int) -> None:
        self.r, self.id, self.created = r, response_id, created
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # kind, id, text, call, index

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def error(self, code: str | None, message: str, param: str | None) -> dict[str, Any]:
        """The event of a failure after the stream began (the stream ends after it)."""
        return self._event("error", code=code, message=message, param=param)

    def start(self) -> list[dict[str, Any]]:
        resp = response_object(self.r, self.id, self.created, [], "in_progress")
        return [self._event("response.created", response=resp),
                self._event("response.in_progress", response=resp)]

    def push(self, d: Delta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if d.reasoning:
            out += self._text("reasoning", d.reasoning)
        if d.content:
            out += self._text("message", d.content)
        for tc in d.tool_calls:
            if "id" in tc:  # a new call
                out += self._close()
                self.open = {"kind": "call", "id": new_id("fc"), "text": "", "call": tc,
                             "index": len(self.items)}
                out.append(self._event("response.output_item.added",
                                       output_index=self.open["index"],
                                       item=call_item(self.open["id"], tc, "", "in_progress")))
            args = tc["function"].get("arguments", "")
            if args and self.open is not None:
                self.open["text"] += args
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self.open["id"],
                                       output_index=self.open["index"], delta=args))
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["kind"] != kind:
            out += self._close()
            prefix = "rs" if kind == "reasoning" else "msg"
            self.open = {"kind": kind, "id": new_id(prefix), "text": "",
                         "index": len(self.items)}
            new = (reasoning_item if kind == "reasoning" else message_item)(
                self.open["id"], "", "in_progress")
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                    else _text_part(""))
            out += [self._event("response.output_item.added",
                                output_index=self.open["index"], item=new),
                    self._event("response.content_part.added", item_id=self.open["id"],
                                output_index=self.open["index"], content_index=0,
                                part=part)]
        self.open["text"] += text
        where = {"item_id": self.open["id"], "output_index": self.open["index"],
                 "content_index": 0}
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", delta=text, **where))
        else:
            out.append(self._event("response.output_text.delta", delta=text, logprobs=[],
                                   **where))
        return out

    def _close(self) -> list[dict[str, Any]]:
        o, self.open = self.open, None
        if o is None:
            return []
        where = {"item_id": o["id"], "output_index": o["index"]}
        if o["kind"] == "call":
            item = call_item(o["id"], o["call"], o["text"], "completed")
            out = [self._event("response.function_call_arguments.done",
                               arguments=o["text"], name=item["name"], **where)]
        elif o["kind"] == "reasoning":
            item = reasoning_item(o["id"], o["text"], "completed")
            out = [self._event("response.reasoning_text.done", content_index=0,
                               text=o["text"], **where),
                   self._event("response.content_part.done", content_index=0,
                               part=item["content"][0], **where)]
        else:
            item = message_item(o["id"], o["text"], "completed")
            out = [self._event("response.output_text.done", content_index=0, text=o["text"],
                               logprobs=[], **where),
                   self._event("response.content_part.done", content_index=0,
                               part=item["content"][0], **where)]
        self.items.append(item)
        out.append(self._event("response.output_item.done", output_index=o["index"],
                               item=item))
        return out

    def end(self, finish: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The last events: open items closed, then the whole Response."""
        out = self._close()
        if not self.items:  # an empty answer is still one (empty) message
            out += self._text("message", "") + self._close()
        status = status_of(finish)
        resp = response_object(self.r, self.id, self.created, self.items, status, usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=resp)]
