"""DecodeWorker / PrefillWorker sections with engine: vllm (no vLLM import needed)."""

from __future__ import annotations

import types

import pytest
from pydantic import ValidationError

from splitserve.components.engines.vllm.sections import (
    VllmDecodeWorkerConfig,
    VllmPrefillWorkerConfig,
)
from splitserve.serve.catalog import DecodeWorker, PrefillWorker
from splitserve.components.worker.registry import section

DecodeWorkerConfig, PrefillWorkerConfig = DecodeWorker.config_model, PrefillWorker.config_model


def test_selectors_and_mains_pick_the_vllm_sections():
    assert section("vllm", "decode") is VllmDecodeWorkerConfig
    assert section("vllm", "prefill") is VllmPrefillWorkerConfig
    dec = DecodeWorkerConfig.model_validate({"engine": "vllm"})
    pre = PrefillWorkerConfig.model_validate({"engine": "vllm", "kv_transfer": {
        "progress_thread": True}})
    assert type(dec) is VllmDecodeWorkerConfig and type(pre) is VllmPrefillWorkerConfig
    assert dec.kv_transfer.side_channel_host == "127.0.0.1"
    assert pre.kv_transfer.progress_thread is True


@pytest.mark.parametrize("bad", [
    {"kv_transfer": {"buffer_device": "tpu"}},
    {"kv_transfer": {"side_channel_port": 80}},
    {"kv_transfer": {"bogus": 1}},
    {"disaggregated_router": {"enable": True, "bogus": 1}},
])
def test_bad_fields_are_refused(bad):
    # As a graph's config is loaded: the engine's section, then what the decider
    # plugins check (the offload policy).
    from splitserve.serve.catalog import DecodeWorker

    with pytest.raises(ValidationError):
        DecodeWorker.config_model.model_validate({"engine": "vllm", **bad})


def test_graph_checks_name_block_size_and_engine_mismatches():
    dec = VllmDecodeWorkerConfig()
    router = types.SimpleNamespace(block_size=16)
    assert "Router.block_size 16" in dec.graph_checks({"Router": router})[0]
    other = VllmPrefillWorkerConfig.model_validate({"engine_args": {"block_size": 64}})
    assert "PrefillWorker.engine_args.block_size 64" in dec.graph_checks(
        {"PrefillWorker": other})[0]
    torch = types.SimpleNamespace(engine="torch")
    assert "needs PrefillWorker.engine: vllm" in dec.graph_checks({"PrefillWorker": torch})[0]
    assert dec.graph_checks({"Router": types.SimpleNamespace(block_size=128),
                             "PrefillWorker": VllmPrefillWorkerConfig()}) == []
