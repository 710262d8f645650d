"""Config sections with ``engine: sglang``: Worker, DecodeWorker and PrefillWorker."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from splitserve.contracts.sections import (
    EngineDecodeSection,
    EnginePrefillSection,
)
from splitserve.contracts.sections import WorkerCommon, router_block_size

from .config import SglangEngineArgs, decode_radix_cache

# Router policies that score workers by their KV events (everything but these).
NO_KV_POLICIES = frozenset({"round_robin"})


def _router_block_size(engine_args: SglangEngineArgs, sections: dict[str, Any]) -> list[str]:
    """The router indexes SGLang's KV events page by page: its block size is the page
    size."""
    return router_block_size(sections, "page_size", engine_args.page_size, "SGLang")


class _SglangGpu:
    """What the plan's placement checks ask of every section with an SGLang engine."""

    needs_gpu: ClassVar[bool] = True

    def gpus_needed_per_replica(self) -> int:
        """GPUs one replica's engine uses (its tensor parallelism); the plan's placement
        check compares it with gpus_per_replica."""
        return self.engine_args.tp_size

    def gpu_memory_share(self) -> float | None:
        """Fraction of each GPU's memory the engine claims (mem_fraction_static), for
        the plan's check of engines sharing a device; None: SGLang's own estimate."""
        return self.engine_args.mem_fraction_static


class SglangWorkerSection(_SglangGpu, WorkerCommon):
    """A Worker section with ``engine: sglang`` (one aggregated SGLang engine)."""

    engine: Literal["sglang"] = "sglang"
    engine_args: SglangEngineArgs = Field(default_factory=SglangEngineArgs)

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph."""
        return _router_block_size(self.engine_args, sections)


class SglangDecodeWorkerConfig(_SglangGpu, EngineDecodeSection):
    """A decode worker fronting a decode-mode SGLang engine.

    A decode-mode engine cannot prefill: the decider's "local" verdicts become remote
    (reason ``engine-no-local-prefill``).  A second, aggregated engine in the same
    process for local prefills is refused: SGLang keeps one live config per process and
    its shutdown kills the process's whole child tree.
    """

    engine: Literal["sglang"] = "sglang"
    engine_args: SglangEngineArgs = Field(default_factory=SglangEngineArgs)
    local_prefill_engine: bool = Field(
        False, description="Refused when true: a second SGLang engine cannot share the "
        "decode worker's process.  Run aggregated Workers for local serving instead.")

    @model_validator(mode="after")
    def _one_engine_per_process(self) -> SglangDecodeWorkerConfig:
        if self.local_prefill_engine:
            raise ValueError("local_prefill_engine: true is not supported: SGLang runs one "
                             "engine per process (one live config per process, and "
                             "Engine.shutdown kills every child of the process); decode "
                             "workers prefill remotely")
        return self

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph."""
        errors = _router_block_size(self.engine_args, sections)
        policy = getattr(sections.get("Router"), "policy", None)
        if (policy is not None and policy not in NO_KV_POLICIES
                and not (self.engine_args.kv_events_enabled()
                         and decode_radix_cache(self.engine_args))):
            errors.append(
                f"engine_args.decode_radix_cache: Router.policy {policy!r} routes by KV "
                "events, but SGLang runs decode engines without a radix cache (so without "
                "KV events) unless engine_args.decode_radix_cache is true (experimental in "
                "SGLang) and kv_events and enable_prefix_caching are on; set it, or use "
                "Router.policy: round_robin")
        return errors


class SglangPrefillWorkerConfig(_SglangGpu, EnginePrefillSection):
    """A prefill worker fronting a prefill-mode SGLang engine (bootstrap server on
    ``engine_args.bootstrap_port`` plus the replica index)."""

    engine: Literal["sglang"] = "sglang"
    engine_args: SglangEngineArgs = Field(default_factory=SglangEngineArgs)
    prefill_timeout_s: float = Field(
        630.0, gt=0, description="How long the prefill loop waits for a begun prefill to "
        "finish before aborting it; must exceed SGLang's own bootstrap and waiting "
        "timeouts (engine_args.bootstrap_timeout_s + waiting_timeout_s), or the loop "
        "gives up on requests SGLang would still complete.")

    @model_validator(mode="after")
    def _outlasts_sglang(self) -> SglangPrefillWorkerConfig:
        a = self.engine_args
        if self.prefill_timeout_s <= a.bootstrap_timeout_s + a.waiting_timeout_s:
            raise ValueError(
                f"prefill_timeout_s: {self.prefill_timeout_s} must exceed "
                f"engine_args.bootstrap_timeout_s + waiting_timeout_s "
                f"({a.bootstrap_timeout_s} + {a.waiting_timeout_s})")
        return self

    def replica_ports(self, replica: int) -> dict[str, int]:
        """Ports one replica opens beside its metrics (shown by --dry-run)."""
        return {"bootstrap_port": self.engine_args.bootstrap_port + replica}


SECTIONS = {"agg": SglangWorkerSection, "decode": SglangDecodeWorkerConfig,
            "prefill": SglangPrefillWorkerConfig}
"""The section model of each role, read by the engine registry."""
