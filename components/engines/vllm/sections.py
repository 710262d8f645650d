"""Config sections with ``engine: vllm``: Worker (defined in ``config.py``), DecodeWorker
and PrefillWorker.

The decode engine pulls each prompt's KV from the prefill engine with vLLM's
NixlConnector (pull mode): the handoff is the ``kv_transfer_params`` the prefill engine
returns.  A decode engine is a ``kv_consumer`` that still prefills locally whatever the
offload policy keeps here, so a decode worker serves alone when no prefill worker is up.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from splitserve.contracts.sections import (
    EngineDecodeSection,
    EnginePrefillSection,
    router_block_size,
)

from .config import VllmEngineArgs, VllmKvTransfer, VllmWorkerSection


class VllmDecodeWorkerConfig(EngineDecodeSection):
    """A decode worker fronting a vLLM ``kv_consumer`` engine (local prefill included)."""

    engine: Literal["vllm"] = "vllm"
    engine_args: VllmEngineArgs = Field(default_factory=VllmEngineArgs)
    kv_transfer: VllmKvTransfer = Field(default_factory=VllmKvTransfer)

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph; the
        prefill engines must cut the prompt into the same blocks as this one."""
        problems = router_block_size(sections, "block_size", self.engine_args.block_size,
                                     "vLLM")
        prefill = sections.get("PrefillWorker")
        if getattr(prefill, "engine", None) == "vllm" and (
                prefill.engine_args.block_size != self.engine_args.block_size):
            problems.append(f"engine_args.block_size: {self.engine_args.block_size} differs "
                            f"from PrefillWorker.engine_args.block_size "
                            f"{prefill.engine_args.block_size}; NIXL moves whole blocks")
        if prefill is not None and getattr(prefill, "engine", None) != "vllm":
            problems.append(f"engine: vllm needs PrefillWorker.engine: vllm, got "
                            f"{getattr(prefill, 'engine', None)!r}; the handoff is vLLM's")
        return problems


class VllmPrefillWorkerConfig(EnginePrefillSection):
    """A prefill worker fronting a vLLM ``kv_producer`` engine: it computes the prompt's
    KV and the first token, and keeps the KV until the decode engine has read it."""

    engine: Literal["vllm"] = "vllm"
    engine_args: VllmEngineArgs = Field(default_factory=VllmEngineArgs)
    kv_transfer: VllmKvTransfer = Field(default_factory=VllmKvTransfer)


SECTIONS = {"agg": VllmWorkerSection, "decode": VllmDecodeWorkerConfig,
            "prefill": VllmPrefillWorkerConfig}
"""The section model of each role, read by the engine registry."""
