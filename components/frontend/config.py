"""Config of the Frontend component (the `Frontend:` section of a graph config)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from splitserve.components.router.service_config import RouterComponentConfig
from splitserve.contracts.config import ComponentConfig

from .formats import check_reasoning_parser, check_tool_parser

# Sections a router (in process or not) can send requests to.
ROUTABLE = ("Worker", "DecodeWorker")
# RouterComponentConfig fields that describe a process of its own: in process, the
# frontend's own `replicas`, `env` and `metrics_port` apply instead.
PROCESS_FIELDS = ("replicas", "env", "metrics_port")


class FrontendConfig(ComponentConfig):
    """OpenAI-compatible HTTP server settings."""

    host: str | None = Field(None, description="Address the HTTP API binds; unset: "
                             "Common.bind_host (127.0.0.1 unless set, a pod's IP in a "
                             "rendered manifest), so one setting moves every listener.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = a free port).")
    model_dir: str | None = Field(None, description="HF-style directory with the tokenizer "
                                  "and config.json; default: the bundled SmolLM2 export.")
    tokenizer: Literal["auto", "fastokens", "huggingface"] = Field(
        "auto", description="Prompt encoder: `fastokens` (a BPE encoder whose crate Dynamo's "
        "runtime also links, far faster on long prompts), `huggingface` (the `tokenizers` library), or "
        "`auto`: fastokens when it encodes a set of probes exactly as tokenizers does, else "
        "tokenizers. Naming fastokens makes a model it cannot read fail the start.")
    max_inflight: int = Field(4096, ge=1, description="Concurrent requests before new ones "
                              "are rejected at once with 503 and Retry-After: a memory "
                              "backstop, set above what the fleet can hold (requests that "
                              "would miss their SLO are admission's to refuse).")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request "
                                    "gives none (capped by the context window).")
    first_token_timeout_s: float = Field(120.0, gt=0, description="A request whose first "
                                         "token has not arrived by then fails with 504.")
    inter_token_timeout_s: float = Field(30.0, gt=0, description="A stream silent for this "
                                         "long fails (a worker died or stalled).")
    route_timeout_s: float = Field(5.0, gt=0, description="Deadline of the router call "
                                   "(with routing in process: of the placement, admission "
                                   "queue wait included).")
    progress_interval_ms: float = Field(
        25.0, ge=0, le=1000, description="With a Router process (`routing: router`): "
        "how often the frontend sends the router replicas that placed its requests their "
        "first tokens and decode progress (every 16 output tokens), batched, one RPC per "
        "replica and interval.  Admission there then sees a prompt leave the work ahead "
        "when its first token comes back and learns TTFT and TPOT while the answers "
        "stream, as routing in process does; without them it learns both at each "
        "release.  0: off.  Not read with `routing: in_process` (reported directly).")
    stall_migration_s: float = Field(
        10.0, ge=0, description="A stream that has begun and then stays silent this long "
        "is taken as its worker lost (a host cut off from the network sends no reset) "
        "and moves to another worker, resuming after the tokens already streamed, within "
        "migration_limit; 0: off (the inter-token timeout then fails the request). Must "
        "be shorter than inter_token_timeout_s (left unset under a shorter one: half "
        "of it).")
    migration_limit: int = Field(1, ge=0, le=8, description="How many times a request whose "
                                 "worker failed moves to another worker (0: never); one that "
                                 "already streamed tokens resumes after them.")
    priority_header: str = Field("x-priority", min_length=1,
                                 description="Request header naming the priority class.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body "
                                "accepted; a larger one is refused with 413 before it is "
                                "read (Content-Length) or as soon as it passes the limit.")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="Largest request line plus "
                                  "headers; larger ones get 431.")
    header_timeout_s: float = Field(10.0, gt=0, description="Time a client has to send a "
                                    "request's headers, from connecting or, on a kept-alive "
                                    "connection, from the first byte of its next request; "
                                    "then 408 (or a close when nothing came).")
    body_timeout_s: float = Field(30.0, gt=0, description="Time a client has to send a "
                                  "request body once its headers arrived; then 408.")
    keep_alive_timeout_s: float = Field(30.0, gt=0, description="An idle keep-alive "
                                        "connection is closed after this long: longer than "
                                        "clients' own idle limit (httpx 5 s, aiohttp 15 s), "
                                        "so that the client ends it and never reuses a "
                                        "connection the server is closing.")
    max_connections: int = Field(1024, ge=1, description="Open HTTP connections; one more "
                                 "is answered 503 and closed.")
    tokenizer_threads: int = Field(2, ge=1, description="Threads that parse and tokenise "
                                   "requests (never the event loop).")
    max_pending_tokenizations: int = Field(1024, ge=1, description="Requests waiting for or "
                                           "in tokenisation; more are refused with 503 (a "
                                           "memory backstop; the wait below binds first).")
    max_tokenization_wait_s: float = Field(
        2.0, gt=0, description="A request is refused with 503 when what already waits for "
        "the tokenizer threads would take longer than this (from their measured bytes per "
        "second): a count alone would refuse a burst of short prompts as readily as a pile "
        "of 100k-token ones.")
    max_loop_lag_ms: float = Field(
        0.0, ge=0, description="New requests are refused with 503 while the event loop "
        "runs this far behind (a burst faster than the frontend's CPU: every admitted "
        "stream would be late by as much); 0 (the default) never refuses for it.  Off by "
        "default: with preload_parsers off, the first request with tools imports vLLM's "
        "parsers (seconds holding the interpreter), during which every new request would "
        "be refused.")
    tool_call_parser: str | None = Field(
        None, description="How tool calls are read from the answer when tool_choice is "
        "auto: one of vLLM's tool-call parser names (`hermes`, `llama3_json`, `mistral`, "
        "`qwen3_coder`, `deepseek_v3`, `kimi_k2`, `glm45`, `openai` for gpt-oss, ...; "
        "vLLM's parsers do the reading).  Unset: chosen from the model's chat template "
        "(docs/api.md, 'Tool-call and reasoning formats'); a template that renders no "
        "tools gets `hermes`, the format the frontend then describes the tools in.")
    reasoning_parser: str | None = Field(
        None, description="Splits a reasoning model's thinking into reasoning_content: one "
        "of vLLM's reasoning parser names (`deepseek_r1`, `qwen3`, `glm45`, `kimi_k2`, "
        "`mistral`, `openai_gptoss`, ...).  Unset: chosen from the model's chat template "
        "(none when it does not think).")
    preload_parsers: bool = Field(
        True, description="Import vLLM's tool-call parsers before the frontend reports "
        "ready, when a served model has a tool-call format (named or chosen from its chat "
        "template): the first request with tools then does not wait seconds for the "
        "import, nor does every other request's stream while the import holds the "
        "interpreter.  It lengthens the frontend's start by the import (about 5 s on 2 "
        "cores) and adds about 0.5 GB to its memory from the start; false: both on the "
        "first request with tools instead.")
    runtime_threads: int | None = Field(
        1, ge=1, le=256, description="Worker threads of Dynamo's runtime in the frontend "
        "process (`DYN_RUNTIME_NUM_WORKER_THREADS`, which wins when the environment or "
        "this section's `env` sets it).  Every streamed chunk is handed from one of these "
        "threads to the event loop; with one, the hand-offs stop waking a second thread "
        "(docs/results/frontend_cost.md: about a quarter less CPU per request on "
        "128-token answers).  null: Dynamo's default, one per core.")
    lora_load_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="How long `POST /v1/load_lora_adapter` (and "
        "`dynamo lora load`) waits for a worker to report the adapter loaded before it "
        "answers 504 (the adapter stays recorded and workers go on loading it).")
    routing: Literal["router", "in_process"] = Field(
        "router", description="Where routing decisions are made when the graph routes: "
        "`router` asks the graph's Router process (one RPC per request, one release "
        "after it; the Router section configures it); `in_process` runs the same "
        "routing service inside this frontend (no RPC, no Router process: serve a graph "
        "without one, e.g. graphs.agg or graphs.disagg_inproc; `router` below configures "
        "it).  With several frontend replicas in process, each places its own requests "
        "and follows the others' placements (router.share).")
    router: RouterComponentConfig | None = Field(
        None, description="Routing settings with `routing: in_process` (the fields of a "
        "Router section: policy, block_size, use_kv_events, qos, ...); default: the "
        "Router section's defaults.  Not read with `routing: router`.")

    def http_listener(self, common) -> tuple[str, int]:
        """The API's address: every replica of this frontend accepts on one socket the
        supervisor binds there, so ``replicas`` above 1 serve one port."""
        return (self.host or common.bind_host, self.port)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, v: str | None) -> str | None:
        return check_tool_parser(v)

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, v: str | None) -> str | None:
        return check_reasoning_parser(v)

    @model_validator(mode="after")
    def _stall_before_timeout(self) -> FrontendConfig:
        if self.stall_migration_s and self.stall_migration_s >= self.inter_token_timeout_s:
            if "stall_migration_s" in self.model_fields_set:
                raise ValueError(
                    f"stall_migration_s ({self.stall_migration_s:g}) must be shorter than "
                    f"inter_token_timeout_s ({self.inter_token_timeout_s:g}), or 0 (off): "
                    "the request would fail before it could move")
            # the default under a shorter inter-token timeout: half of it
            self.__dict__["stall_migration_s"] = self.inter_token_timeout_s / 2
        return self

    def router_settings(self) -> RouterComponentConfig:
        """The settings of in-process routing: ``router`` as given, else the defaults."""
        return self.router if self.router is not None else RouterComponentConfig()

    def preflight(self) -> list[str]:
        """Settings that would be silently ignored, and the in-process routing policy
        (built once, so a missing policy file fails validation, not the frontend)."""
        if self.routing == "router":
            if self.router is not None:
                return [("router: only read with routing: in_process (routing is 'router': "
                         "the graph's Router section configures routing)")]
            return []
        cfg = self.router_settings()
        errors = [f"router.{f}: not used in process (the frontend's own {f} applies)"
                  for f in PROCESS_FIELDS if f in cfg.model_fields_set]
        return errors + [f"router.{p}" for p in cfg.preflight()]

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every section of the graph: in-process routing
        needs a worker section to route to, no Router process beside it, and the
        workers' KV block size (a mismatch would make every prefix lookup miss)."""
        if self.routing != "in_process":
            return []
        if "Router" in sections:
            return [("routing: in_process routes inside the frontend, but this graph also "
                     "starts a Router process that no request would reach and whose "
                     "section would be ignored; serve a graph without a Router (e.g. "
                     "graphs.agg, graphs.disagg_inproc) or set routing: router")]
        cfg = self.router_settings()
        if cfg.worker_component is not None:
            if cfg.worker_component not in sections:
                return [(f"router.worker_component: {cfg.worker_component!r} is not a "
                         f"component of this graph ({', '.join(sorted(sections))})")]
            target = cfg.worker_component
        else:
            target = next((n for n in ROUTABLE if n in sections), None)
            if target is None:
                return [("routing: in_process needs a Worker or DecodeWorker in the graph "
                         "to route to")]
        size = getattr(getattr(sections[target], "engine_args", None), "block_size", None)
        if size is not None and size != cfg.block_size:
            return [(f"router.block_size: {cfg.block_size} differs from {target}."
                     f"engine_args.block_size {size}; routing must use the workers' block "
                     "size")]
        return []
