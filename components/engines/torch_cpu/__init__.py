"""CPU reference engine: Llama-family models (Llama, Mistral, Qwen2, Qwen3, SmolLM) from a
Hugging Face directory, with a paged, prefix-cached KV pool.

A compact Llama forward pass (ours; transformers only reads the checkpoint),
continuous batching with chunked prefill and preemption, KV events for the
router, and hooks for disaggregated prefill/decode.
"""

from splitserve.contracts.kit.lazy import lazy_exports

# Imported on first use: the engine registry reads ``sections`` from this package in
# every process that validates a config (the supervisor, the CLI), and the modules below
# import torch (about 1.4 CPU-seconds).
__getattr__ = lazy_exports(__name__, globals(), {
    ".config": ("EngineConfig", "ModelConfig"),
    ".engine": ("EngineCore",),
    ".kv_cache": ("KVCacheManager",),
    ".loader": ("LoadedModel", "UnsupportedModel", "chat_prompt_ids", "configure_threads",
                "default_num_threads", "load_model"),
    ".request": ("EngineStats", "FinishReason", "RemoteKvAllocation", "Request",
                 "RequestOutput"),
    "splitserve.contracts.block_events": ("BlockRemoved", "BlockStored", "KvEvent",
                                                    "hash_block"),
})

__all__ = [
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
    "UnsupportedModel",
    "chat_prompt_ids",
    "configure_threads",
    "default_num_threads",
    "hash_block",
    "load_model",
]
