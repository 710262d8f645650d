"""A small HTTP control endpoint on the supervisor (127.0.0.1 only).

The planner's local connector and `dynamo status` use it:

- ``GET  /v1/status``                          → plan and replica table
- ``POST /v1/components/{name}/replicas``      → body ``{"replicas": N}``; scales

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

Handler = Callable[[str, str, Any], Awaitable[tuple[int, Any]]]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 500: "Internal Server Error"}


class ControlServer:
    """Serves ``handler(method, path, json_body) -> (status, json)`` on 127.0.0.1."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (ln.partition(":") for ln in lines[1:] if ln)}
            length = int(headers.get("content-length", "0") or 0)
            raw = await asyncio.wait_for(reader.readexactly(length), 5) if length else b""
            try:
                body = json.loads(raw) if raw else None
                status, payload = await self.handler(method, path, body)
            except json.JSONDecodeError:
                status, payload = 400, {"error": "body is not valid JSON"}
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
            status, payload = 400, {"error": "malformed request"}
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            status, payload = 500, {"error": str(exc)}
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     "Connection: close\r\n\r\n".encode() + data)
        with contextlib.suppress(Exception):
            await writer.drain()
            writer.close()


_SCALE = re.compile(r"^/v1/components/([A-Za-z0-9_-]+)/replicas$")


def supervisor_handler(sup, plan_dict: dict) -> Handler:
    """Route control requests to a Supervisor."""

    async def handle(method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/v1/status":
            if method != "GET":
                return 405, {"error": "use GET"}
            return 200, {"plan": plan_dict, "replicas": sup.snapshot(),
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
