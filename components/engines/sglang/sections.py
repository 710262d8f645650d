"""Config sections with ``engine: sglang``: Worker, DecodeWorker and PrefillWorker."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from splitserve.components.engines.disagg_sections import (
    EngineDecodeSection,
    EnginePrefillSection,
)
from splitserve.components.worker.config import WorkerCommon

from .config import SglangEngineArgs


def _router_block_size(engine_args: SglangEngineArgs, sections: dict[str, Any]) -> list[str]:
    """The router indexes SGLang's KV events page by page: its block size must be the
    page size, or every prefix lookup would miss, silently."""
    size = getattr(sections.get("Router"), "block_size", None)
    if size is not None and size != engine_args.page_size:
        return [(f"engine_args.page_size: {engine_args.page_size} differs from "
                f"Router.block_size {size}; the router must use SGLang's page size")]
    return []


class SglangWorkerSection(WorkerCommon):
    """A Worker section with ``engine: sglang`` (one aggregated SGLang engine)."""

    engine: Literal["sglang"] = "sglang"
    engine_args: SglangEngineArgs = Field(default_factory=SglangEngineArgs)

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph."""
        return _router_block_size(self.engine_args, sections)


class SglangDecodeWorkerConfig(EngineDecodeSection):
    """A decode worker fronting a decode-mode SGLang engine.

    A decode-mode engine cannot prefill: the decider's "local" verdicts become remote
    (reason ``engine-no-local-prefill``) unless ``local_prefill_engine`` starts an
    aggregated engine beside it (it shares the GPU: split ``mem_fraction_static``).
    """

    engine: Literal["sglang"] = "sglang"
    engine_args: SglangEngineArgs = Field(default_factory=SglangEngineArgs)
    local_prefill_engine: bool = Field(
        False, description="Start an aggregated SGLang engine beside the decode engine "
        "for local prefills (both engines then share the GPU).")

    @model_validator(mode="after")
    def _two_engines_fit(self) -> SglangDecodeWorkerConfig:
        frac = self.engine_args.mem_fraction_static
        if self.local_prefill_engine and (frac is None or 2 * frac > 0.95):
            raise ValueError(f"local_prefill_engine: true starts two engines on one GPU; "
                             f"engine_args.mem_fraction_static {frac} must be set and at "
                             f"most 0.475")
        return self

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph."""
        return _router_block_size(self.engine_args, sections)


class SglangPrefillWorkerConfig(EnginePrefillSection):
    """A prefill worker fronting a prefill-mode SGLang engine (bootstrap server on
    ``engine_args.bootstrap_port``)."""

    engine: Literal["sglang"] = "sglang"
    engine_args: SglangEngineArgs = Field(default_factory=SglangEngineArgs)
