"""Connection-level limits against a real uvicorn server with raw sockets on loopback."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest

from splitserve.components.frontend.app import FrontendState
from splitserve.components.frontend.http_server import HttpLimits
from splitserve.components.frontend.textcodec import TextCodec

from .live_server import connect, parse, read_response, running, serve
from .test_frontend_app import MODEL, ScriptedBackend

pytestmark = pytest.mark.unit

LIMITS = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_timeout_s=30,
                    max_connections=4, max_header_bytes=16 * 1024)


@pytest.fixture
def server(codec):
    state = FrontendState(model_name=MODEL, codec=codec, backend=ScriptedBackend(codec),
                          body_timeout_s=LIMITS.body_timeout_s, max_body_bytes=64 * 1024)
    with serve(state, LIMITS) as addr:
        yield addr, state


def assert_json_error(raw: bytes, status: int, code: str | None = None) -> dict:
    got, headers, body = parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    return err


def timed(s: socket.socket) -> tuple[bytes, float]:
    t0 = time.monotonic()
    return read_response(s), time.monotonic() - t0


def still_serving(addr) -> None:
    s = connect(addr)
    s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert parse(read_response(s))[0] == 200


def test_idle_connection_is_closed_after_the_header_timeout(server):
    addr, _ = server
    raw, took = timed(connect(addr))
    assert raw == b"" and took < 3


def one_response(s: socket.socket) -> tuple[int, bytes]:
    """Read one response with a Content-Length body from a kept-alive connection."""
    raw = bytearray()
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(65536)
        assert chunk, bytes(raw)
        raw += chunk
    status, headers, body = parse(bytes(raw))
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    return status, body


LIVE = b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_kept_alive_connection_outlives_the_header_timeout_while_idle(server):
    # The client, not the server, ends an idle connection (keep-alive timeout above
    # clients' idle limits): a server that closed it just as the client sent its next
    # request would lose that request.
    addr, _ = server
    with connect(addr) as s:
        s.sendall(LIVE)
        assert one_response(s)[0] == 200
        time.sleep(LIMITS.header_timeout_s * 1.5)
        s.sendall(LIVE)
        assert one_response(s)[0] == 200


def test_headers_trickled_on_a_kept_alive_connection_get_408_from_their_first_byte(server):
    addr, _ = server
    s = connect(addr)
    s.sendall(LIVE)
    assert one_response(s)[0] == 200
    time.sleep(LIMITS.header_timeout_s * 1.5)  # idle: no deadline yet
    s.sendall(b"GET /live HTTP/1.1\r\n")
    raw, took = timed(s)
    assert_json_error(raw, 408, "request_timeout")
    assert took < 3


def test_an_idle_kept_alive_connection_closes_after_the_keep_alive_timeout(codec):
    limits = HttpLimits(header_timeout_s=5.0, body_timeout_s=1.0, keep_alive_timeout_s=0.5)
    state = FrontendState(model_name=MODEL, codec=codec, backend=ScriptedBackend(codec))
    with serve(state, limits) as addr:
        s = connect(addr)
        s.sendall(LIVE)
        assert one_response(s)[0] == 200
        raw, took = timed(s)
        assert raw == b"" and took < 3


def test_partial_headers_get_408(server):
    addr, _ = server
    s = connect(addr)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    raw, took = timed(s)
    assert_json_error(raw, 408, "request_timeout")
    assert took < 3
    still_serving(addr)


def test_trickled_headers_do_not_extend_the_deadline(server):
    addr, _ = server
    s = connect(addr)
    t0 = time.monotonic()
    s.sendall(b"GET /live HTTP/1.1\r\n")
    with s:
        while not select.select([s], [], [], 0.1)[0]:  # one header line every 0.1 s
            assert time.monotonic() - t0 < 5, "no answer while headers trickle in"
            s.sendall(b"X-A: b\r\n")
        took = time.monotonic() - t0
        raw = s.recv(65536)
    assert_json_error(raw, 408, "request_timeout")
    assert took < 2


def test_partial_body_gets_408(server):
    addr, _ = server
    s = connect(addr)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\"")
    raw, took = timed(s)
    assert_json_error(raw, 408, "request_timeout")
    assert took < 3


def test_unread_body_of_a_get_cannot_hold_the_connection(server):
    addr, _ = server
    s = connect(addr)
    s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    raw, took = timed(s)
    assert parse(raw)[0] == 200 and took < 4


@pytest.mark.parametrize("size", [40_000, 1 << 20])
def test_huge_header_gets_431_json_not_a_reset(server, size):
    addr, _ = server
    s = connect(addr)
    s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
    assert_json_error(read_response(s), 431, "request_header_fields_too_large")
    still_serving(addr)


def test_headers_within_the_limit_are_served(server):
    addr, _ = server
    s = connect(addr)
    s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
              + b"a" * 15_000 + b"\r\n\r\n")
    assert parse(read_response(s))[0] == 200


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n", b"GET /live HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n",
])
def test_malformed_http_gets_400_json(server, request_bytes):
    addr, _ = server
    s = connect(addr)
    s.sendall(request_bytes)
    assert_json_error(read_response(s), 400, "invalid_http_request")


def test_connections_over_the_limit_get_503(server):
    addr, _ = server
    held = [connect(addr) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    extra = connect(addr)
    err = assert_json_error(read_response(extra), 503, "too_many_connections")
    assert err["type"] == "server_overloaded"
    for s in held:
        s.close()
    time.sleep(0.2)
    still_serving(addr)


def test_chunked_oversized_body_is_refused_while_still_arriving(server):
    addr, state = server
    s = connect(addr)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 8192
    for _ in range(state.max_body_bytes // len(chunk) + 2):
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    # the body is not finished (no last chunk): the answer comes anyway
    assert_json_error(read_response(s), 413, "request_too_large")


def test_oversized_body_sent_whole_still_reads_the_413(server):
    addr, _ = server
    body = b"{" + b" " * (16 << 20) + b"}"
    s = connect(addr)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert_json_error(read_response(s), 413, "request_too_large")


def test_live_answers_while_a_large_prompt_is_tokenised(codec):
    # A context window big enough that the prompt really is tokenised, by the slower
    # encoder (seconds; fastokens would finish before /live is asked).
    big = TextCodec(codec.tok, context_length=10**7, encoder="huggingface")
    state = FrontendState(model_name=MODEL, codec=big, backend=ScriptedBackend(codec),
                          max_body_bytes=8 * 1024 * 1024)
    body = json.dumps({"model": MODEL, "prompt": "word " * 600_000, "max_tokens": 1}).encode()
    with serve(state, HttpLimits()) as addr:
        done = threading.Event()

        def send():
            s = connect(addr, timeout_s=60)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
            read_response(s)
            done.set()

        worker = threading.Thread(target=send, daemon=True)
        worker.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        still_serving(addr)
        took = time.monotonic() - t0
        assert not done.is_set(), "the prompt was tokenised too fast to prove anything"
        assert took < 0.5, f"/live took {took:.2f}s while a prompt was tokenised"
        worker.join(60)


def _chat(max_tokens: int = 3) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(server):
    addr, _ = server
    s = connect(addr)
    body = _chat()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: " + str(len(body)).encode()
              + b"\r\n\r\n" + body)
    s.shutdown(socket.SHUT_WR)
    got, _, answer = parse(read_response(s))
    assert got == 200 and json.loads(answer)["choices"]
    still_serving(addr)


def test_http10_post_without_a_length_is_answered_411_not_dropped(server):
    addr, _ = server
    s = connect(addr)
    s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json"
              b"\r\n\r\n" + _chat())
    s.shutdown(socket.SHUT_WR)
    assert_json_error(read_response(s), 411, "length_required")
    still_serving(addr)


def _answer_or_reset(s: socket.socket) -> bytes:
    """Everything the server sends until it closes; ``b"RESET"`` if it resets instead."""
    out = bytearray()
    with s:
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            return b"RESET"
    return bytes(out)


def test_a_stopping_server_answers_every_connection_it_accepted(codec):
    """Requests that reach the server just as it stops get an answer, never a reset: one
    on a connection the server holds idle, its request not read yet, and others on
    connections still in the listener's accept queue.  Each gets 503 with Retry-After
    (or is served); then the port refuses connections."""
    state = FrontendState(model_name=MODEL, codec=codec, backend=ScriptedBackend(codec),
                          body_timeout_s=LIMITS.body_timeout_s, max_body_bytes=64 * 1024)
    body = _chat()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
               b"application/json\r\nContent-Length: " + str(len(body)).encode()
               + b"\r\n\r\n" + body)
    with running(state, LIMITS) as run:
        idle = connect(run.addr)
        deadline = time.monotonic() + 5
        while not run.server.server_state.connections:
            assert time.monotonic() < deadline, "the server did not take the connection"
            time.sleep(0.01)
        clients: list[socket.socket] = []
        sent = threading.Event()
        stop = run.server.shutdown

        async def shutdown_as_requests_arrive(sockets=None):
            # On the server's loop, so none of this is accepted or read before it stops.
            idle.sendall(request)
            clients.extend(connect(run.addr) for _ in range(3))
            for s in clients:
                s.sendall(request)
            sent.set()
            await stop(sockets)

        run.server.shutdown = shutdown_as_requests_arrive
        run.server.should_exit = True
        assert sent.wait(10)
        answers = [_answer_or_reset(s) for s in [idle, *clients]]
        run.stop()
        with pytest.raises(ConnectionRefusedError):
            connect(run.addr, timeout_s=2)
    for raw in answers:
        assert raw != b"RESET" and raw, raw
        status, headers, answer = parse(raw)
        if status == 503:
            err = assert_json_error(raw, 503, "shutting_down")
            assert err["type"] == "service_unavailable" and headers["retry-after"] == "1"
        else:
            assert status == 200 and json.loads(answer)["choices"], raw[:300]


@pytest.mark.parametrize("body", [
    b"zz\r\nhello\r\n0\r\n\r\n",            # a chunk size that is not hex
    b"5\r\nhello world\r\n0\r\n\r\n",       # a chunk longer than its size
    b"5\r\nhello",                          # the connection ends mid-chunk
])
def test_a_malformed_chunked_body_gets_400_and_logs_no_traceback(server, body, caplog):
    addr, _ = server
    s = connect(addr)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    if body.endswith(b"hello"):
        s.shutdown(socket.SHUT_WR)
    raw = read_response(s)
    if raw:  # a body cut by the client's close may get no answer at all
        assert parse(raw)[0] == (408 if body.endswith(b"hello") else 400), raw[:300]
    time.sleep(0.3)  # let the server finish with the connection
    still_serving(addr)
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


def test_a_bad_chunk_while_the_body_is_read_gets_400_and_logs_no_traceback(server, caplog):
    """The handler is already reading the body when a malformed chunk arrives: the
    protocol answers 400 and the handler, whose answer can no longer be written, stops
    without an error (it used to log a traceback: write() after write_eof())."""
    addr, _ = server
    s = connect(addr)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"5\r\n{\"a\":\r\n")
    time.sleep(0.3)  # the handler is waiting for the rest of the body
    s.sendall(b"not-hex\r\nxx\r\n0\r\n\r\n")
    assert parse(read_response(s))[0] == 400
    time.sleep(LIMITS.body_timeout_s + 2.5)  # past the body deadline and the linger
    still_serving(addr)
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
