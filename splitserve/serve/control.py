"""A small HTTP control endpoint on the supervisor (127.0.0.1 only).

The planner's local connector and `dynamo status` use it:

- ``GET  /v1/status``                          → plan and replica table
- ``POST /v1/components/{name}/replicas``      → body ``{"replicas": N}``; scales

Every request must carry ``Authorization: Bearer <token>``, the per-run token the
supervisor wrote (0600) into its run directory.  Loopback alone is no protection: a web
page open in a browser on this machine can send a "simple" cross-origin POST (text/plain,
no preflight) to 127.0.0.1.  So, before anything else, a request with an ``Origin``
header (only browsers send one) gets 403, a body that is not ``application/json`` gets
415, and the token is compared in constant time.

Deliberately a minimal asyncio HTTP/1.1 server: it must not install signal handlers of
its own (the supervisor owns SIGINT/SIGTERM) and it serves a handful of calls a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from splitserve.contracts.kit.credentials import bearer_matches

Handler = Callable[[str, str, Any], Awaitable[tuple[int, Any]]]

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
            413: "Payload Too Large", 415: "Unsupported Media Type",
            500: "Internal Server Error"}
MAX_BODY = 64 * 1024
MAX_HEAD = 16 * 1024


def check_request(headers: dict[str, str], token: str) -> tuple[int, str] | None:
    """Why a request is refused (status, message), or None when it may proceed.

    ``headers`` have lower-case names.  Called before the body is read.
    """
    if "origin" in headers:
        return 403, "browser requests (with an Origin header) are refused"
    if not bearer_matches(headers.get("authorization", ""), token):
        return 401, "missing or wrong bearer token (see control.token in the run directory)"
    length = int(headers.get("content-length", "0") or 0)
    if length:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return 415, "the body must be application/json"
        if length > MAX_BODY:
            return 413, f"body larger than {MAX_BODY} bytes"
    return None


class ControlServer:
    """Serves ``handler(method, path, json_body) -> (status, json)`` on 127.0.0.1."""

    def __init__(self, handler: Handler, token: str, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        if len(token) < 16:
            raise ValueError("the control token must have at least 16 characters")
        self.handler = handler
        self.token = token
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  limit=MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        extra = {}
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (ln.partition(":") for ln in lines[1:] if ln)}
            refused = check_request(headers, self.token)
            if refused:
                status, payload = refused[0], {"error": refused[1]}
                if status == 401:
                    extra["WWW-Authenticate"] = "Bearer"
            else:
                length = int(headers.get("content-length", "0") or 0)
                raw = await asyncio.wait_for(reader.readexactly(length), 5) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                    status, payload = await self.handler(method, path, body)
                except json.JSONDecodeError:
                    status, payload = 400, {"error": "body is not valid JSON"}
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ValueError):
            status, payload = 400, {"error": "malformed request"}
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            status, payload = 500, {"error": str(exc)}
        data = json.dumps(payload).encode()
        more = "".join(f"{k}: {v}\r\n" for k, v in extra.items())
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"{more}Connection: close\r\n\r\n".encode() + data)
        with contextlib.suppress(Exception):
            await writer.drain()
            writer.close()


_SCALE = re.compile(r"^/v1/components/([A-Za-z0-9_-]+(?:@[a-z][a-z0-9_-]*)?)/replicas$")


def supervisor_handler(sup, plan_dict: dict) -> Handler:
    """Route control requests to a Supervisor."""

    async def handle(method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/v1/status":
            if method != "GET":
                return 405, {"error": "use GET"}
            return 200, {"plan": plan_dict, "replicas": sup.snapshot(),
                         "dependencies": sup.dependency_rows(),
                         "shutting_down": sup.shutting_down}
        m = _SCALE.match(path)
        if m:
            if method != "POST":
                return 405, {"error": "use POST"}
            n = body.get("replicas") if isinstance(body, dict) else None
            if not isinstance(n, int) or isinstance(n, bool) or n < 0 or n > 64:
                return 400, {"error": "body must be {\"replicas\": <integer 0..64>}"}
            try:
                return 200, await sup.scale(m.group(1), n)
            except KeyError:
                return 404, {"error": f"no component '{m.group(1)}' in this graph"}
            except RuntimeError as exc:
                return 409, {"error": str(exc)}
        return 404, {"error": f"no route {method} {path}"}

    return handle


def control_request(url: str, token: str, method: str = "GET", path: str = "/v1/status",
                    body: Any = None, timeout_s: float = 2.0) -> tuple[int, Any]:
    """Call a supervisor's control endpoint; returns (status, JSON reply).

    Used by the CLI with the token read from the run directory (``info["token_file"]``
    of the supervisor's registry entry).  Raises OSError when it cannot be reached.
    """
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def supervisor_status(info: dict, timeout_s: float = 2.0) -> dict | None:
    """``GET /v1/status`` of a local supervisor from its registry entry; None when it
    cannot be reached or its token cannot be read (another user's graph)."""
    from urllib.parse import urlsplit

    from splitserve.contracts.kit.credentials import read_secret

    try:
        if urlsplit(info["control"]).hostname not in ("127.0.0.1", "::1"):
            return None  # supervisors listen on loopback only: never send the token away
        token = read_secret(info["token_file"])
        code, reply = control_request(info["control"], token, timeout_s=timeout_s)
    except (KeyError, OSError, ValueError):
        return None
    return reply if code == 200 and isinstance(reply, dict) else None
