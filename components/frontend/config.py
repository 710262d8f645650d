"""Config of the Frontend component (the `Frontend:` section of a graph config)."""

from __future__ import annotations

from pydantic import Field

from splitserve.serve.config import ComponentConfig


class FrontendConfig(ComponentConfig):
    """OpenAI-compatible HTTP server settings."""

    host: str = Field("127.0.0.1", description="Address to bind; loopback by default.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = a free port).")
    model_dir: str | None = Field(None, description="HF-style directory with the tokenizer "
                                  "and config.json; default: the bundled SmolLM2 export.")
    max_inflight: int = Field(256, ge=1, description="Concurrent requests before new ones "
                              "are rejected at once with 503 and Retry-After.")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request "
                                    "gives none (capped by the context window).")
    first_token_timeout_s: float = Field(120.0, gt=0, description="A request whose first "
                                         "token has not arrived by then fails with 504.")
    inter_token_timeout_s: float = Field(30.0, gt=0, description="A stream silent for this "
                                         "long fails (a worker died or stalled).")
    route_timeout_s: float = Field(5.0, gt=0, description="Deadline of the router call.")
    migration_limit: int = Field(1, ge=0, le=8, description="How many times a request whose "
                                 "worker failed before producing output is sent to another "
                                 "worker (0: never).")
    priority_header: str = Field("x-priority", min_length=1,
                                 description="Request header naming the priority class.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body "
                                "accepted; a larger one is refused with 413 before it is "
                                "read (Content-Length) or as soon as it passes the limit.")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="Largest request line plus "
                                  "headers; larger ones get 431.")
    header_timeout_s: float = Field(10.0, gt=0, description="Time a client has to send a "
                                    "request's headers, from connecting or from the end of "
                                    "the previous response; then 408 (or a close when idle).")
    body_timeout_s: float = Field(30.0, gt=0, description="Time a client has to send a "
                                  "request body once its headers arrived; then 408.")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="An idle keep-alive "
                                        "connection is closed after this long.")
    max_connections: int = Field(1024, ge=1, description="Open HTTP connections; one more "
                                 "is answered 503 and closed.")
    tokenizer_threads: int = Field(2, ge=1, description="Threads that parse and tokenise "
                                   "requests (never the event loop).")
    max_pending_tokenizations: int = Field(64, ge=1, description="Requests waiting for or "
                                           "in tokenisation; more are refused with 503.")
