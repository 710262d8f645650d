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
