"""Config sections with ``engine: trtllm``: Worker, DecodeWorker and PrefillWorker."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from splitserve.contracts.sections import (
    EngineDecodeSection,
    EnginePrefillSection,
)
from splitserve.contracts.sections import WorkerCommon, router_block_size

from .config import TrtllmEngineArgs


def _router_block_size(engine_args: TrtllmEngineArgs, sections: dict[str, Any]) -> list[str]:
    """The router indexes TensorRT-LLM's KV events block by block: equal sizes."""
    return router_block_size(sections, "tokens_per_block", engine_args.tokens_per_block,
                             "TensorRT-LLM")


class _TrtllmGpu:
    """What the plan's placement checks ask of every section with a TensorRT-LLM engine."""

    needs_gpu: ClassVar[bool] = True

    def gpus_needed_per_replica(self) -> int:
        """GPUs one replica's engine uses (its tensor parallelism); the plan's placement
        check compares it with gpus_per_replica."""
        return self.engine_args.tensor_parallel_size


class TrtllmWorkerSection(_TrtllmGpu, WorkerCommon):
    """A Worker section with ``engine: trtllm`` (one aggregated TensorRT-LLM engine)."""

    engine: Literal["trtllm"] = "trtllm"
    engine_args: TrtllmEngineArgs = Field(default_factory=TrtllmEngineArgs)

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph."""
        return _router_block_size(self.engine_args, sections)


class TrtllmDecodeWorkerConfig(_TrtllmGpu, EngineDecodeSection):
    """A decode worker fronting a decode TensorRT-LLM engine: ``generation_only`` for
    remote prefills, ``context_and_generation`` for local ones (same engine)."""

    engine: Literal["trtllm"] = "trtllm"
    engine_args: TrtllmEngineArgs = Field(default_factory=TrtllmEngineArgs)

    def graph_checks(self, sections: dict[str, Any]) -> list[str]:
        """Called by the plan builder with every validated section of the graph."""
        return _router_block_size(self.engine_args, sections)


class TrtllmPrefillWorkerConfig(_TrtllmGpu, EnginePrefillSection):
    """A prefill worker fronting a TensorRT-LLM engine running ``context_only``."""

    engine: Literal["trtllm"] = "trtllm"
    engine_args: TrtllmEngineArgs = Field(default_factory=TrtllmEngineArgs)


SECTIONS = {"agg": TrtllmWorkerSection, "decode": TrtllmDecodeWorkerConfig,
            "prefill": TrtllmPrefillWorkerConfig}
"""The section model of each role, read by the engine registry."""
