"""Reading a request before it is parsed: content type, size limit, read deadline.

Both run on the event loop before any parsing, so a hostile body costs at most
``limit`` bytes of memory and ``timeout_s`` of a connection.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from .errors import APIError, read_timeout, too_large, unsupported_media_type


def check_content_type(value: str | None) -> None:
    """415 unless the body is declared as JSON (UTF-8, the only charset JSON allows)."""
    media, _, params = (value or "").partition(";")
    charset = "utf-8"
    for param in params.split(";"):
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset":
            charset = val.strip().strip('"').lower()
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise unsupported_media_type(value)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refused (413) as soon as it exceeds ``limit`` bytes.

    A declared Content-Length is checked before reading anything; a chunked body is
    counted as it arrives, so an oversized body is never buffered whole.  A body that
    has not arrived within ``timeout_s`` is answered with 408 (slow clients).
    """
    declared = request.headers.get("content-length")
    if declared is None and "transfer-encoding" not in request.headers:
        # Without either, HTTP says the body is empty (RFC 9112 6.3): what such a client
        # sends after its headers would be read as the next request.
        raise APIError(411, "the request has a body but neither Content-Length nor "
                       "Transfer-Encoding: chunked; send one of them", code="length_required",
                       close=True)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)

    async def collect() -> bytes:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise too_large(limit)
        return bytes(buf)

    try:
        return await asyncio.wait_for(collect(), timeout_s)
    except TimeoutError:
        raise read_timeout(timeout_s) from None
    except ClientDisconnect:
        raise APIError(400, "client disconnected while sending the body",
                       code="client_disconnected", close=True) from None
