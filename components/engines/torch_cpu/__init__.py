"""CPU reference engine: SmolLM2-135M-Instruct with a paged, prefix-cached KV pool.

A compact Llama forward pass (ours; transformers only reads the checkpoint),
continuous batching with chunked prefill and preemption, KV events for the
router, and hooks for disaggregated prefill/decode.
"""

from .config import EngineConfig, ModelConfig
from .engine import EngineCore
from .kv_cache import KVCacheManager
from splitserve.components.engines.block_events import BlockRemoved, BlockStored, KvEvent, hash_block
from .loader import (
    CHATML_TEMPLATE,
    LoadedModel,
    chat_prompt_ids,
    configure_threads,
    default_num_threads,
    load_smollm2,
)
from .request import EngineStats, FinishReason, RemoteKvAllocation, Request, RequestOutput

__all__ = [
    "CHATML_TEMPLATE",
    "BlockRemoved",
    "BlockStored",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "FinishReason",
    "KVCacheManager",
    "KvEvent",
    "LoadedModel",
    "ModelConfig",
    "RemoteKvAllocation",
    "Request",
    "RequestOutput",
    "chat_prompt_ids",
    "configure_threads",
    "default_num_threads",
    "hash_block",
    "load_smollm2",
]
