"""OpenAI-style error bodies and the exception that carries one to the HTTP layer."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status.

    Raised anywhere in request handling; the app turns it into a JSONResponse (or an
    SSE error event once a stream has started).  ``retry_after_s`` adds a Retry-After
    header (early rejection under overload).
    """

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        # Close the connection after answering: the request body was not read to its end.
        self.close = close

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {"Connection": "close"} if self.close else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, int(round(self.retry_after_s))))
        return headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after_s: float, code: str = "overloaded") -> APIError:
    return APIError(503, message, type_="server_overloaded", code=code,
                    retry_after_s=retry_after_s)


def service_unavailable(message: str, retry_after_s: float = 2,
                        code: str = "dependency_unavailable") -> APIError:
    """503 while a dependency of the graph (etcd, NATS) is down: not an overload."""
    return APIError(503, message, type_="service_unavailable", code=code,
                    retry_after_s=retry_after_s)


def upstream_error(message: str, status: int = 502, code: str = "worker_error") -> APIError:
    return APIError(status, message, type_="server_error", code=code)


def too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {limit_bytes} "
                    "bytes", code="request_too_large", close=True)


def read_timeout(timeout_s: float) -> APIError:
    return APIError(408, f"request body did not arrive within {timeout_s:g}s",
                    code="request_timeout", close=True)


def unsupported_media_type(content_type: str | None) -> APIError:
    return APIError(415, f"content type {content_type or '(none)'!r} is not supported; send "
                    "application/json", code="unsupported_media_type", close=True)
