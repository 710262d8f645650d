"""Config of the SGLang engine and its mapping onto SGLang's ``ServerArgs``.

The fields below are the ones this project sets on purpose; anything else SGLang accepts
goes under ``extra_server_args``.  Where sglang is importable the whole mapping is
checked by SGLang itself (its argparse flags parse the values, then ``ServerArgs`` is
built from them), so a misspelt name or a value outside SGLang's choices fails at config
validation, naming the field.  Without sglang only this model's own checks run, and
``extra_server_args`` cannot be checked at all: it is refused, by name.
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from splitserve.contracts.model_files import checked_model
from splitserve.contracts.models import StrictModel
from splitserve.contracts.sections import refuse_torch_tier_fields

Role = Literal["agg", "prefill", "decode"]
ROLE_MODE = {"agg": "null", "prefill": "prefill", "decode": "decode"}

# ServerArgs fields this project sets itself (per role, replica or port); setting them
# through extra_server_args would make two sources of truth.
MAPPED = frozenset({
    "model_path", "tokenizer_path", "served_model_name", "tp_size", "dtype",
    "mem_fraction_static", "page_size", "context_length", "max_running_requests",
    "chunked_prefill_size", "disable_radix_cache", "random_seed", "skip_tokenizer_init",
    "host", "port", "kv_events_config", "enable_metrics", "disaggregation_mode",
    "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
    "disaggregation_ib_device", "log_level", "incremental_streaming_output",
    "enable_deterministic_inference", "disaggregation_decode_enable_radix_cache",
    "enable_lora", "max_loras_per_batch", "max_lora_rank", "lora_target_modules", "lora_paths",
    "enable_hierarchical_cache", "hicache_ratio", "hicache_size", "hicache_write_policy",
    "hicache_storage_backend", "hicache_storage_backend_extra_config"})

# The LoRA fields besides the switch, under SGLang's names.
LORA_FIELDS = ("max_loras_per_batch", "max_lora_rank", "lora_target_modules", "lora_paths")

# The HiCache fields besides the switch (this project's names).
HICACHE_FIELDS = ("hicache_ratio", "hicache_size_gb", "hicache_write_policy",
                  "hicache_storage_backend", "hicache_storage_backend_extra_config")

# The torch engine's KV tier fields, refused here by name with what SGLang offers instead
# (a plain "extra inputs" error would not say where SGLang's tiers are).
TORCH_TIER_FIELDS = {
    "host_kv_cache_gib": "SGLang's host-memory KV tier is enable_hierarchical_cache with "
                         "hicache_size_gb or hicache_ratio",
    "disk_kv_cache_gib": "SGLang's storage tier is hicache_storage_backend ('file' for a "
                         "directory, which SGLang does not bound)",
    "disk_kv_cache_dir": "SGLang's 'file' storage tier takes its directory as "
                         "hicache_storage_backend_extra_config.file_storage_path",
}

SGLANG_TIMEOUT_S = 300
"""SGLang's default bootstrap and waiting timeouts (SGLANG_DISAGGREGATION_*_TIMEOUT)."""


def sglang_available() -> bool:
    """Whether ``sglang.srt.server_args`` imports here (CPU is enough for that)."""
    try:
        import sglang.srt.server_args  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "cannot check"
        return False
    return True


@cache
def server_args_parser() -> argparse.ArgumentParser:
    """SGLang's own argparse parser (``ServerArgs.add_cli_args``), built once."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def server_arg_names() -> frozenset[str]:
    """Field names of the installed ``ServerArgs`` (a msgspec Struct)."""
    from sglang.srt.server_args import ServerArgs

    return frozenset(ServerArgs.__struct_fields__)


class SglangEngineArgs(StrictModel):
    """Arguments of one in-process SGLang engine (``sglang.Engine``)."""

    model_path: str | None = Field(None, min_length=1, description="This pool's model, "
                                   "when it is not Common.model: a local directory or a "
                                   "hub id in the local cache; null: Common.model.  SGLang "
                                   "gets the directory either way (nothing is downloaded).")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs per engine.")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        "auto", description="Weights and activations (SGLang's --dtype).")
    mem_fraction_static: float | None = Field(
        0.85, gt=0, lt=1, description="Fraction of GPU memory for weights and KV cache "
        "(None: SGLang's own estimate).")
    page_size: int = Field(16, ge=1, description="Tokens per KV page; SGLang's KV events "
                           "are per page, so the Router's block_size must be equal.")
    context_length: int | None = Field(None, ge=16, description="Longest prompt plus "
                                       "output (None: the model's).")
    max_running_requests: int | None = Field(None, ge=1, description="Requests decoded "
                                             "together (None: SGLang's default).")
    chunked_prefill_size: int | None = Field(None, ge=16, description="Prompt tokens per "
                                             "prefill chunk (None: SGLang's default).")
    enable_prefix_caching: bool = Field(True, description="SGLang's radix cache; also what "
                                        "produces the KV events the router indexes.")
    kv_events: bool = Field(True, description="Relay SGLang's KV events to the router "
                            "(needs enable_prefix_caching).")
    random_seed: int | None = Field(None, description="Engine seed (None: SGLang's).")
    transfer_backend: Literal["nixl", "mooncake"] = Field(
        "nixl", description="How SGLang moves KV from prefill to decode engines "
        "(--disaggregation-transfer-backend).")
    bootstrap_port: int = Field(8998, ge=1, le=65535, description="A prefill engine's "
                                "bootstrap server port; decode engines connect to it.")
    ib_device: str | None = Field(None, description="RDMA device(s) for the transfer "
                                  "backend (--disaggregation-ib-device); None: automatic.")
    structured_output: bool = Field(
        True, description="Enforce a request's JSON schema (response_format, forced tool "
        "calls) with SGLang's grammar backend.  That backend compiles schemas against the "
        "vocabulary, so SGLang loads its tokenizer (skip_tokenizer_init off) and also "
        "detokenises what it streams; off, it runs on token ids alone and requests that "
        "carry a schema are refused.")
    deterministic_inference: bool = Field(
        False, description="SGLang's --enable-deterministic-inference: the only mode in "
        "which it honours a request's seed; without it requests with a seed are refused.")
    decode_radix_cache: bool = Field(
        False, description="Keep the radix cache on decode engines (SGLang's experimental "
        "--disaggregation-decode-enable-radix-cache).  SGLang turns it off in decode mode "
        "otherwise, and a decode engine then publishes no KV events.")
    bootstrap_timeout_s: int = Field(
        SGLANG_TIMEOUT_S, ge=10, description="How long a prefill engine waits for its "
        "decode engine to join the bootstrap room (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).")
    waiting_timeout_s: int = Field(
        SGLANG_TIMEOUT_S, ge=10, description="How long a decode engine waits for the KV "
        "of a joined room (SGLANG_DISAGGREGATION_WAITING_TIMEOUT); the decode worker "
        "gives up 30 s later if SGLang has not ended the request.")
    warmup_timeout_s: float = Field(
        1800.0, gt=0, description="A prefill engine runs one request through each "
        "data-parallel rank's disaggregated path before it serves (JIT and CUDA-graph "
        "capture); the start fails when that takes longer (Dynamo's bound).")
    enable_lora: bool = Field(
        False, description="Serve LoRA adapters (SGLang's --enable-lora): those of "
        "lora_paths from the start, others loaded at run time (load_lora), named per "
        "request.  SGLang sizes its adapter memory pool at start, so it needs lora_paths "
        "or both max_lora_rank and lora_target_modules.")
    max_loras_per_batch: int = Field(8, ge=1, description="With enable_lora: adapters one "
                                     "batch may mix, the base model counting as one "
                                     "(SGLang's default 8).")
    max_lora_rank: int | None = Field(None, ge=1, description="With enable_lora: the "
                                      "largest adapter rank the pool holds (None: the "
                                      "largest of lora_paths').")
    lora_target_modules: list[str] | None = Field(
        None, min_length=1, description="With enable_lora: the modules adapters may target "
        "(SGLang's names, e.g. q_proj, or 'all'; None: those of lora_paths' adapters).")
    lora_paths: dict[str, str] | None = Field(
        None, description="With enable_lora: adapters loaded at start, name -> local "
        "adapter directory (SGLang's --lora-paths NAME=PATH).")
    enable_hierarchical_cache: bool = Field(
        False, description="SGLang's HiCache: a host-memory KV tier below the GPU's radix "
        "cache (--enable-hierarchical-cache), and optionally a storage tier below it "
        "(hicache_storage_backend).  Needs enable_prefix_caching; on a decode engine also "
        "decode_radix_cache.")
    hicache_ratio: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="With HiCache: host tier size as a "
        "multiple of the GPU KV pool (--hicache-ratio; None: SGLang's default, 2 on "
        "aggregated and prefill engines).  Give this or hicache_size_gb, not both.")
    hicache_size_gb: int = Field(
        0, ge=0, description="With HiCache: host tier size per GPU in GB of 10^9 bytes, "
        "SGLang's unit (--hicache-size; 0: sized by hicache_ratio).  SGLang refuses at "
        "start a size beyond the host's free memory.")
    hicache_write_policy: Literal["write_back", "write_through",
                                  "write_through_selective"] = Field(
        "write_through", description="With HiCache: when the GPU's blocks are copied to "
        "the host tier (--hicache-write-policy): once they are cached (write_through), "
        "once they are used a second time (write_through_selective), or when the GPU "
        "evicts them (write_back).")
    hicache_storage_backend: str | None = Field(
        None, min_length=1, description="With HiCache: a storage tier below the host tier "
        "(--hicache-storage-backend, one of SGLang's names: 'file' writes a directory, "
        "others are services the deployment runs, e.g. 'mooncake', 'hf3fs', 'nixl').  "
        "SGLang checks the name where it is installed.")
    hicache_storage_backend_extra_config: dict[str, Any] | None = Field(
        None, description="With a storage backend: its settings, passed to SGLang as "
        "JSON (--hicache-storage-backend-extra-config), e.g. {'file_storage_path': DIR} "
        "for 'file' (default /tmp/hicache; SGLang's environment variable "
        "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR wins over it).")
    extra_server_args: dict[str, Any] = Field(
        default_factory=dict, description="Further ServerArgs fields, by name, passed "
        "through unchanged; unknown names are refused.")

    @model_validator(mode="before")
    @classmethod
    def _no_torch_tiers(cls, data: Any) -> Any:
        return refuse_torch_tier_fields(data, TORCH_TIER_FIELDS, "sglang")

    @field_validator("model_path")
    @classmethod
    def _model_found(cls, v: str | None) -> str | None:
        return checked_model(v)

    @field_validator("lora_paths")
    @classmethod
    def _adapter_names(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for name in v or {}:
            if not name or "=" in name:
                raise ValueError(f"adapter name {name!r}: SGLang reads NAME=PATH, so a "
                                 "name must be non-empty and without '='")
        return v

    @model_validator(mode="after")
    def _lora_fields_need_the_switch(self) -> SglangEngineArgs:
        unused = sorted(self.model_fields_set & set(LORA_FIELDS))
        if unused and not self.enable_lora:
            raise ValueError(f"{unused[0]}: set without enable_lora: true, so SGLang would "
                             "serve no adapter with it")
        return self

    @model_validator(mode="after")
    def _hicache_fields_need_the_switch(self) -> SglangEngineArgs:
        """HiCache fields other than their defaults need the switch (a resolved config
        handed to a replica names every field, so "set" means "not the default"), and
        SGLang's own rules that need no GPU: HiCache lives in the radix cache, and a size
        in GB overrides the ratio."""
        fields = type(self).model_fields
        changed = [f for f in HICACHE_FIELDS if getattr(self, f) != fields[f].default]
        if not self.enable_hierarchical_cache:
            if changed:
                raise ValueError(f"{changed[0]}: set without enable_hierarchical_cache: "
                                 "true, so SGLang would keep no KV tier with it")
            return self
        if not self.enable_prefix_caching:
            raise ValueError("enable_hierarchical_cache: needs enable_prefix_caching (SGLang "
                             "keeps its tiers under the radix cache and refuses HiCache "
                             "without it)")
        if self.hicache_ratio is not None and self.hicache_size_gb > 0:
            raise ValueError(f"hicache_ratio {self.hicache_ratio} and hicache_size_gb "
                             f"{self.hicache_size_gb}: give one; SGLang ignores the ratio "
                             "when a size is set")
        if (self.hicache_storage_backend_extra_config is not None
                and self.hicache_storage_backend is None):
            raise ValueError("hicache_storage_backend_extra_config: set without "
                             "hicache_storage_backend, so no storage tier reads it")
        return self

    @model_validator(mode="after")
    def _checked_by_sglang(self) -> SglangEngineArgs:
        for key in self.extra_server_args:
            if key in MAPPED:
                raise ValueError(f"extra_server_args.{key}: set by its own field here")
        if not sglang_available():
            if self.extra_server_args:
                key = next(iter(self.extra_server_args))
                raise ValueError(f"extra_server_args.{key}: cannot be checked without "
                                 "sglang installed (pip install '.[sglang]')")
            return self
        names = server_arg_names()
        for key in self.extra_server_args:
            if key not in names:
                raise ValueError(f"extra_server_args.{key}: not a field of SGLang's "
                                 "ServerArgs")
        # Common.model is known only to the plan: a placeholder path stands for it here.
        args = self if self.model_path else self.model_copy(update={"model_path": "model"})
        for role in ("prefill", "decode"):
            # Whether these args serve a decode engine is the section's to say
            # (decode_problems); until then a decode engine is checked without HiCache.
            checked = (args.model_copy(update={"enable_hierarchical_cache": False})
                       if role == "decode" and decode_problems(args) else args)
            built = check_server_args(server_args_kwargs(checked, role, "model",
                                                         "tcp://127.0.0.1:1"))
            check_lora(built)
            if role == "decode":
                resolved = resolved_radix_cache(built)
                if resolved is not None and resolved != decode_radix_cache(self):
                    raise ValueError(
                        f"decode_radix_cache: SGLang resolves the decode engine's radix "
                        f"cache to {'on' if resolved else 'off'}, this project expected "
                        f"{'on' if decode_radix_cache(self) else 'off'} (a changed SGLang?)")
        return self

    def kv_events_enabled(self) -> bool:
        """Whether this engine publishes KV events (both switches on)."""
        return self.kv_events and self.enable_prefix_caching

    def lower_tiers(self) -> dict[str, int | None]:
        """The tiers below the pool whose events reach the routers: HiCache's host tier
        when the engine publishes KV events (SGLang announces no storage-tier blocks;
        the host tier's size in blocks is SGLang's to tell)."""
        if self.enable_hierarchical_cache and self.kv_events_enabled():
            return {"host": None}
        return {}


def decode_problems(args: SglangEngineArgs) -> list[str]:
    """What a decode-mode SGLang engine with ``args`` cannot do, one message per field
    (empty: nothing); called when such an engine is configured or started.

    SGLang runs a decode engine without a radix cache unless the decode radix cache is
    asked for (``handle_pd_disaggregation``), and refuses HiCache without a radix cache
    (``handle_cache_compatibility``)."""
    if args.enable_hierarchical_cache and not decode_radix_cache(args):
        return ["enable_hierarchical_cache: a decode SGLang engine keeps a radix cache, "
                "which HiCache lives in, only with decode_radix_cache: true"]
    return []


def hicache_kwargs(args: SglangEngineArgs) -> dict[str, Any]:
    """The ServerArgs HiCache keywords of ``args`` (none without the switch: SGLang's
    defaults).  The storage backend's settings go as the JSON text SGLang's flag takes."""
    if not args.enable_hierarchical_cache:
        return {}
    kw: dict[str, Any] = {"enable_hierarchical_cache": True,
                          "hicache_write_policy": args.hicache_write_policy}
    if args.hicache_ratio is not None:
        kw["hicache_ratio"] = args.hicache_ratio
    if args.hicache_size_gb > 0:
        kw["hicache_size"] = args.hicache_size_gb
    if args.hicache_storage_backend is not None:
        kw["hicache_storage_backend"] = args.hicache_storage_backend
    if args.hicache_storage_backend_extra_config is not None:
        kw["hicache_storage_backend_extra_config"] = json.dumps(
            args.hicache_storage_backend_extra_config)
    return kw


def decode_radix_cache(args: SglangEngineArgs) -> bool:
    """Whether a decode-mode engine runs with its radix cache, as SGLang resolves it
    (``handle_pd_disaggregation``): only when the decode radix cache is asked for
    explicitly, whatever ``disable_radix_cache`` says.  Without it the engine indexes no
    prefixes and emits no KV events."""
    return args.enable_prefix_caching and args.decode_radix_cache


def resolved_radix_cache(built: Any) -> bool | None:
    """Whether SGLang itself resolves this (disaggregated) ``ServerArgs`` to run with a
    radix cache: its own ``handle_pd_disaggregation`` step of the launch-time resolution,
    which runs on CPU (the rest of the pipeline needs the CUDA packages).  Raises
    ValueError where SGLang refuses the combination; None where the step cannot run."""
    try:
        from sglang.srt.arg_groups import pd_disaggregation_hook as pd
    except Exception:  # noqa: BLE001 - another SGLang layout: nothing to resolve with
        return None
    try:
        pd.handle_pd_disaggregation(built)
        return not pd.resolved_view(built).disable_radix_cache
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - a step needing what this machine lacks
        return None


def check_lora(built: Any) -> None:
    """Run SGLang's own LoRA step of the launch-time resolution (``check_lora_server_args``,
    which runs on CPU) on a built ``ServerArgs``: it refuses, with an assertion, a LoRA
    engine whose adapter memory pool it could not size.  Raises ValueError naming what
    SGLang said; nothing where that step is not in this SGLang."""
    try:
        from sglang.srt.arg_groups.lora_hook import check_lora_server_args
    except Exception:  # noqa: BLE001 - another SGLang layout: nothing to check with
        return
    try:
        check_lora_server_args(built)
    except (AssertionError, ValueError) as exc:
        raise ValueError(f"enable_lora: SGLang refused the LoRA settings: {exc}") from None


def lora_kwargs(args: SglangEngineArgs) -> dict[str, Any]:
    """The ServerArgs LoRA keywords of ``args`` (none without ``enable_lora``: SGLang's
    defaults).  ``lora_paths`` go as SGLang's ``NAME=PATH`` strings, which its flag and
    ``ServerArgs`` both take."""
    if not args.enable_lora:
        return {}
    kw: dict[str, Any] = {"enable_lora": True,
                          "max_loras_per_batch": args.max_loras_per_batch}
    if args.max_lora_rank is not None:
        kw["max_lora_rank"] = args.max_lora_rank
    if args.lora_target_modules is not None:
        kw["lora_target_modules"] = list(args.lora_target_modules)
    if args.lora_paths:
        kw["lora_paths"] = [f"{name}={path}" for name, path in args.lora_paths.items()]
    return kw


def server_args_kwargs(args: SglangEngineArgs, role: Role, served_name: str,
                       kv_events_endpoint: str | None = None,
                       host: str = "127.0.0.1", *,
                       bootstrap_port: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` / ``ServerArgs`` for one engine.

    Called once per engine before it starts.  ``role`` picks the disaggregation mode;
    ``kv_events_endpoint`` (``tcp://127.0.0.1:PORT``, where this project's relay
    listens) turns SGLang's ZMQ KV-event publisher on; ``host`` is what SGLang's
    listeners bind (a prefill engine's bootstrap server among them): loopback unless the
    graph is opened for multi-node use; ``bootstrap_port`` is this replica's (the
    configured base port plus the replica index).  ``args.model_path`` is the model's
    directory (the registry's factory fills in Common.model's).  Token ids in, token
    ids out: the frontend owns the tokenizer.
    """
    kw: dict[str, Any] = {
        "model_path": args.model_path, "served_model_name": served_name,
        "tp_size": args.tp_size, "dtype": args.dtype, "page_size": args.page_size,
        "disable_radix_cache": not args.enable_prefix_caching,
        # SGLang builds no grammar backend without its tokenizer; otherwise token ids
        # in and out are all it needs.
        "skip_tokenizer_init": not args.structured_output, "host": host, "enable_metrics": True,
        "disaggregation_mode": ROLE_MODE[role], "log_level": "warning",
        # each streamed output carries only the new tokens (requests.to_delta relies on it)
        "incremental_streaming_output": True,
    }
    if args.deterministic_inference:
        kw["enable_deterministic_inference"] = True
    for name in ("mem_fraction_static", "context_length", "max_running_requests",
                 "chunked_prefill_size", "random_seed"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    if role != "agg":
        kw["disaggregation_transfer_backend"] = args.transfer_backend
        if args.ib_device is not None:
            kw["disaggregation_ib_device"] = args.ib_device
    if role == "decode" and args.decode_radix_cache:
        kw["disaggregation_decode_enable_radix_cache"] = True
    if role == "prefill":
        kw["disaggregation_bootstrap_port"] = (args.bootstrap_port if bootstrap_port is None
                                               else bootstrap_port)
    kw.update(lora_kwargs(args))
    if role == "decode" and decode_problems(args):
        raise ValueError(decode_problems(args)[0])
    kw.update(hicache_kwargs(args))
    if kv_events_endpoint is not None:
        if not kv_events_endpoint.startswith("tcp://127.0.0.1:"):
            raise ValueError(f"KV events must stay on loopback, got {kv_events_endpoint!r}")
        # A concrete host: SGLang's publisher connects to the relay listening there.
        kw["kv_events_config"] = json.dumps({"publisher": "zmq",
                                             "endpoint": kv_events_endpoint,
                                             "topic": "kv-events"})
    kw.update(args.extra_server_args)
    return kw


def to_cli_args(kwargs: dict[str, Any]) -> list[str]:
    """The same settings as SGLang command-line flags (what its parser checks)."""
    parser = server_args_parser()
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in kwargs.items():
        action = flags.get(key)
        if action is None:
            raise ValueError(f"{key}: SGLang has no command-line flag for this field")
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false
            if bool(value) != bool(action.default):
                argv.append(flag)
            continue
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, value if isinstance(value, str) else json.dumps(value)]
    return argv


def check_server_args(kwargs: dict[str, Any]):
    """Check ``kwargs`` with SGLang's own parser and build the real ``ServerArgs``.

    Raises ValueError naming the field SGLang refused; returns the ``ServerArgs``.
    """
    from sglang.srt.server_args import ServerArgs

    argv = to_cli_args(kwargs)
    try:
        ns = server_args_parser().parse_args(argv)
    except argparse.ArgumentError as exc:
        flags = {f: a.dest for a in server_args_parser()._actions
                 for f in a.option_strings}
        field = flags.get(exc.argument_name or "", exc.argument_name)
        raise ValueError(f"{field}: SGLang refused {kwargs.get(field)!r}: "
                         f"{exc.message}") from exc
    except SystemExit as exc:
        raise ValueError(f"SGLang refused the arguments {argv}") from exc
    built = ServerArgs.from_cli_args(ns)
    for key, value in kwargs.items():
        if getattr(built, key) != value and value is not None:
            raise ValueError(f"{key}: SGLang read {getattr(built, key)!r}, set {value!r}")
    return built
