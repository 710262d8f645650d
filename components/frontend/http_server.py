"""The frontend's HTTP/1.1 server: uvicorn's h11 protocol with limits against slow and
hostile clients.

uvicorn bounds neither the time a client may take to send its headers nor how many
connections it holds, and answers malformed requests with plain text (or a reset when
the client is still sending a huge header).  ``GuardedH11Protocol`` adds:

- a header deadline, from the connection's start (or, on a kept-alive connection, from
  the first byte of its next request) until a request's headers are complete: 408 when
  something partial arrived, a silent close for a new connection that sent nothing.  A
  kept-alive connection with nothing to send is closed after the keep-alive timeout
  (uvicorn's), longer than common clients' own idle limit (httpx 5 s, aiohttp 15 s), so
  that the client, not the server, ends an idle connection: a server closing it just as
  the client reuses it for a request loses that request ("Server disconnected");
- a body deadline backstop: a connection still sending a request body that long after
  its headers is closed (the POST handlers answer 408 themselves slightly earlier);
- a connection limit: the connection over the limit gets 503 and is closed;
- OpenAI-style JSON for every error the protocol answers itself (431 for headers larger
  than the limit, 400 for malformed HTTP), sent with a lingering close so the client
  reads the answer instead of a reset.

``FrontendServer`` stops without resetting a connection the kernel accepted.  Closing a
listening socket resets every connection still in its accept queue, and uvicorn closes an
idle connection at once, the request its client already sent unread (a reset too): a
client that connected just before the frontend stopped got ECONNRESET, not an answer.
On stop the listener first drops new connection attempts (the client's kernel sends its
SYN again a second later, to a closed port or to the frontend started after this one),
the connections already queued are accepted, and only then is it closed; every idle
connection the server holds gets ``DRAIN_S`` to send a request, which is answered 503
with Retry-After.  Requests in progress finish as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitserve.contracts.kit.shared_listener import stop_accepting_new

from .errors import APIError

log = logging.getLogger(__name__)

# After an error answer, keep reading (and dropping) what the client still sends for at
# most this long / this many bytes, so its kernel does not turn our close into a reset.
LINGER_S = 2.0
LINGER_MAX_BYTES = 64 * 1024 * 1024
# Once the server stops: how long an idle connection it accepted may still send a request
# (answered 503), and how long the accept queue may take to empty.
DRAIN_S = 1.0


@dataclass(frozen=True)
class HttpLimits:
    """Connection-level limits (from FrontendConfig)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 30.0
    max_connections: int = 1024
    max_header_bytes: int = 16 * 1024


def error_bytes(err: APIError) -> bytes:
    """A complete HTTP/1.1 response for ``err`` that closes the connection."""
    body = json.dumps(err.body()).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in err.headers().items()
                    if k.lower() != "connection")
    return (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}"
            "connection: close\r\n\r\n").encode() + body


class _GentleClose:
    """The connection's transport as uvicorn's request cycles see it: ``close()`` while the
    client is still sending a body (a 413 or 408 was answered early) lingers instead, so
    the client gets to read that answer rather than a reset."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_gently()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body deadlines, a connection cap, JSON errors."""

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of a not yet complete request head arrived
        self._head = bytearray()  # its first bytes, to measure it (h11 may not)
        self._lingering = False
        self._lingered = 0
        self._client_done = False  # the client closed its sending half
        self._draining = False  # the server stopped: a new request gets 503
        self._kept_alive = False  # idle after a response: no header deadline until a byte

    # --- lifecycle -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self.transport = _GentleClose(transport, self)  # type: ignore[assignment]
        if len(self.connections) > self.limits.max_connections:
            self._answer_and_linger(APIError(
                503, f"server is at its limit of {self.limits.max_connections} connections",
                type_="server_overloaded", code="too_many_connections", retry_after_s=1))
            return
        if getattr(self.server_state, "draining", False):
            self._drain()  # accepted from the queue after the server stopped
            return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > LINGER_MAX_BYTES:
                self._raw.close()
            return
        if self._draining and self._waiting_for_headers():
            self._answer_and_linger(shutting_down())
            return
        if self._waiting_for_headers():
            if self._kept_alive:  # the next request on a kept-alive connection starts
                self._kept_alive = False
                self._await_headers()
            self._partial = True
            if self._head_too_large(data):
                self._answer_and_linger(self._headers_too_large())
                return
        super().data_received(data)

    def eof_received(self) -> bool:
        """The client closed its sending half.  One that does so right after its request
        (HTTP/1.0 scripts, ``curl --http1.0``, netcat) still reads the answer: while a
        request is being answered our half stays open, and the connection closes once the
        answer is sent; an idle connection closes at once."""
        self._client_done = True
        return self.cycle is not None and not self.cycle.response_complete

    def _head_too_large(self, data: bytes) -> bool:
        # h11 enforces its size limit only on a head that arrives in several reads.
        room = self.limits.max_header_bytes + 4 - len(self._head)
        self._head += data[:max(0, room)]
        return b"\r\n\r\n" not in self._head and len(self._head) > self.limits.max_header_bytes

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and not self._lingering:
            self._kept_alive = False
            self._head.clear()
            # A request's headers are complete: the body now has its own deadline.
            self._arm(self.limits.body_timeout_s + 1.0, self._body_deadline, self.cycle)

    def on_response_complete(self) -> None:
        # Idle now: the keep-alive timeout (armed by uvicorn below) bounds the wait for a
        # next request, and its first byte starts the header deadline (data_received).
        # Cleared first: uvicorn may start a pipelined request below, which arms again.
        if not self.transport.is_closing() and not self._lingering and not self._draining:
            if self.conn.their_state is h11.SEND_BODY:
                self._await_headers()  # a body left unread: the rest must come in time
            else:
                self._cancel_deadline()
                self._partial = False
                self._head.clear()
                self._kept_alive = True
        super().on_response_complete()
        if self._client_done and not self._raw.is_closing():
            self._raw.close()  # nothing more can come: close once the answer is flushed

    def shutdown(self) -> None:
        """Called by the server as it stops.  A request in progress is answered (then the
        connection closes); an idle connection gets ``DRAIN_S`` to send one, answered 503:
        closing it at once would reset a request already on its way."""
        if self._lingering:  # h11 never saw our error answer: just close
            self._raw.close()
            return
        if self.cycle is not None and not self.cycle.response_complete:
            super().shutdown()
        elif self._partial:  # part of a request head arrived: answer it now
            self._answer_and_linger(shutting_down())
        else:
            self._drain()

    def _drain(self) -> None:
        self._draining = True
        if self._raw.is_closing():
            return
        if self._client_done:
            self._raw.close()
            return
        self._arm(DRAIN_S, self._drain_deadline, None)

    def _drain_deadline(self, _: None) -> None:
        if not self._lingering and not self._raw.is_closing():
            self._raw.close()  # nothing came: nothing unread, a plain close

    # --- deadlines -------------------------------------------------------------------
    def _waiting_for_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _await_headers(self) -> None:
        self._partial = False
        self._head.clear()
        self._arm(self.limits.header_timeout_s, self._header_deadline, None)

    def _arm(self, delay_s: float, callback, arg) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(delay_s, callback, arg)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _header_deadline(self, _: None) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined request is still being answered
        if not self._waiting_for_headers():
            self._raw.close()  # the rest of an unread body never came
        elif self._partial:
            self._answer_and_linger(APIError(
                408, f"request headers did not arrive within {self.limits.header_timeout_s:g}s",
                code="request_timeout"))
        else:
            self._raw.close()  # idle: nothing to answer

    def _body_deadline(self, cycle) -> None:
        if self.cycle is cycle and self.conn.their_state is h11.SEND_BODY:
            if cycle.response_started:
                self._raw.close()
            else:  # the handler did not read the body (it would have answered 408)
                cycle.disconnected = True
                cycle.message_event.set()
                self._answer_and_linger(APIError(
                    408, f"request body did not arrive within "
                    f"{self.limits.body_timeout_s:g}s", code="request_timeout"))

    # --- errors the protocol answers itself ---------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn inside its ``except h11.RemoteProtocolError`` block."""
        exc = sys.exc_info()[1]
        status = getattr(exc, "error_status_hint", 400) if exc is not None else 400
        if status == 431:
            err = self._headers_too_large()
        else:
            detail = f": {exc}" if exc is not None and str(exc) else ""
            err = APIError(400, f"invalid HTTP request{detail}", code="invalid_http_request")
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A handler is running (it was reading the body when the bad bytes came): this
            # answer is the connection's last, so the handler sees the client gone and its
            # own answer, which could no longer be written, is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self._answer_and_linger(err)

    def _headers_too_large(self) -> APIError:
        return APIError(431, f"request headers are larger than this server's limit of "
                        f"{self.limits.max_header_bytes} bytes",
                        code="request_header_fields_too_large")

    def _answer_and_linger(self, err: APIError) -> None:
        """Write ``err``, half-close, and drop further input for a short while."""
        self._raw.write(error_bytes(err))
        self._linger()

    def close_gently(self) -> None:
        """Close now, or linger when the client is still sending a request body."""
        if self._lingering:
            return  # the linger timer closes
        if self.conn.their_state is h11.SEND_BODY and not self._raw.is_closing():
            self._linger()
        else:
            self._raw.close()

    def _linger(self) -> None:
        self._cancel_deadline()
        self._lingering = True
        if self._raw.can_write_eof():
            self._raw.write_eof()
        self.loop.call_later(LINGER_S, self._raw.close)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry the request",
                    type_="service_unavailable", code="shutting_down", retry_after_s=1)


class FrontendServer(uvicorn.Server):
    """uvicorn's server with a stop that answers every connection it accepted, and
    without its own signal handlers (the component runtime owns SIGTERM).

    ``shared``: it accepts from the socket every replica of the frontend shares
    (``contracts/kit/shared_listener.py``); its stop then only stops accepting, and what
    waits in the accept queue is left to the other replicas (or, when the whole graph
    stops, to the supervisor's drop filter)."""

    shared = False

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.server_state.draining = True  # type: ignore[attr-defined]
        if self.shared:
            await super().shutdown(sockets)
            return
        # The loop accepts what was queued before the filter.
        await stop_accepting_new([s.fileno() for server in self.servers
                                  for s in server.sockets], DRAIN_S)
        await asyncio.sleep(0)  # let the protocols of the last accepted ones start
        await super().shutdown(sockets)


def protocol_for(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """A protocol class bound to ``limits`` (uvicorn instantiates it per connection)."""
    return type("FrontendH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def server_config(app, host: str, port: int, limits: HttpLimits) -> uvicorn.Config:
    """uvicorn settings of the frontend: our protocol, keep-alive and header size limits."""
    return uvicorn.Config(app, host=host, port=port, http=protocol_for(limits),
                          timeout_keep_alive=limits.keep_alive_timeout_s,
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          log_level="warning", access_log=False, lifespan="off",
                          log_config=None)
