"""The TensorRT-LLM config is strict and its sections select by ``engine: trtllm``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.components.engines.trtllm.config import TrtllmEngineArgs, llm_kwargs
from splitserve.serve.catalog import DecodeWorker, PrefillWorker

DecodeWorkerConfig, PrefillWorkerConfig = DecodeWorker.config_model, PrefillWorker.config_model

pytestmark = pytest.mark.unit


def test_strict_fields():
    with pytest.raises(ValidationError):
        TrtllmEngineArgs(transfer_backend="TCP")
    with pytest.raises(ValidationError):
        TrtllmEngineArgs(free_gpu_memory_fraction=1.5)
    with pytest.raises(ValidationError, match=r"extra_llm_args\.kv_cache_config"):
        TrtllmEngineArgs(extra_llm_args={"kv_cache_config": {}})
    assert llm_kwargs(TrtllmEngineArgs(extra_llm_args={"enable_chunked_prefill": True}),
                      "agg")["enable_chunked_prefill"] is True


def test_sections_are_selected_by_engine():
    dec = DecodeWorkerConfig.model_validate({"engine": "trtllm"})
    pre = PrefillWorkerConfig.model_validate({"engine": "trtllm",
                                              "engine_args": {"tokens_per_block": 64}})
    assert type(dec).__name__ == "TrtllmDecodeWorkerConfig"
    assert pre.engine_args.tokens_per_block == 64
    with pytest.raises(ValidationError):
        DecodeWorkerConfig.model_validate({"engine": "trtllm", "kv_transfer": {}})
