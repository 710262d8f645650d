"""TensorRT-LLM shapes checked against Dynamo 1.6.1's installed TensorRT-LLM worker.

TensorRT-LLM itself cannot be installed here; Dynamo's worker is the reference for how
its LLM API is called.  These tests read that code (and run its params codec) and
assert this adapter produces the same shapes.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import dataclasses

import pytest

from splitserve.contracts.engine import GenerateParams, OpaqueHandoff
from splitserve.components.engines.trtllm.config import TrtllmEngineArgs, llm_kwargs
from splitserve.components.engines.trtllm.engine import TrtllmEngine
from splitserve.components.engines.trtllm.events import convert_event, load_from_stats
from splitserve.components.engines.trtllm.requests import handoff_from_params, params_fields
from tests.fixtures.engine_doubles import DisaggregatedParamsDouble, LlmApiDouble
from tests.unit.engines.upstream import dynamo_source

pytestmark = pytest.mark.unit


def dynamo_codec():
    """Dynamo's DisaggregatedParamsCodec, executed from its installed source."""
    src = dynamo_source("trtllm/utils/disagg_utils.py")
    cls = src.node(ast.ClassDef, "DisaggregatedParamsCodec", top_level=True)
    ns = {"base64": base64, "dataclasses": dataclasses, "Logprob": None,
          "DisaggregatedParams": DisaggregatedParamsDouble}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), "disagg_utils.py", "exec"), ns)  # noqa: S102
    return ns["DisaggregatedParamsCodec"]


def test_opaque_state_round_trip_matches_dynamos_codec():
    codec = dynamo_codec()
    ctx = DisaggregatedParamsDouble(request_type="context_only", first_gen_tokens=[9],
                                    ctx_request_id=4, opaque_state=b"\x00\xffstate")
    ours = handoff_from_params(ctx)
    assert ours.disaggregated_params == dataclasses.asdict(codec.encode(ctx))
    wire = OpaqueHandoff.model_validate_json(ours.model_dump_json())
    back = DisaggregatedParamsDouble(**params_fields(wire, "generation_only"))
    theirs = codec.decode(DisaggregatedParamsDouble(**codec.encode(ctx).__dict__))
    theirs.request_type = "generation_only"  # what Dynamo's decode handler sets next
    assert back == theirs


def test_generate_async_keywords_are_dynamos():
    src = dynamo_source("trtllm/request_handlers/handler_base.py")
    keys: set[str] = set()
    for node in ast.walk(src.tree()):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "generate_kwargs"
                                                 for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    assert {"inputs", "sampling_params", "disaggregated_params", "streaming"} <= keys, (
        f"{src.label}: its generate_kwargs literal lost a key or is gone ({sorted(keys)})")

    seen: list[set[str]] = []

    class Recorder(LlmApiDouble):
        def make_llm(self, **kw):
            llm = super().make_llm(**kw)
            real = llm.generate_async

            def generate_async(**call):
                seen.append(set(call))
                return real(**call)

            llm.generate_async = generate_async
            return llm

    async def run():
        eng = TrtllmEngine(TrtllmEngineArgs(), "m", "decode",
                           api_factory=lambda: Recorder("decode", {}))
        await eng.start()
        async for d in eng.generate("r", GenerateParams(token_ids=(1, 2), max_tokens=2)):
            if d.finished:
                break
        await eng.shutdown()

    asyncio.run(run())
    assert seen and all(s <= keys for s in seen), (seen, keys)


def test_request_types_are_dynamos():
    dynamo_source("trtllm/request_handlers/handler_base.py").require(*(
        f'"{kind}"' for kind in ("context_only", "generation_only", "context_and_generation")))


def test_kv_event_and_stats_keys_are_the_ones_dynamo_reads():
    dynamo_source("trtllm/publisher.py").require(
        'data["type"] == "stored"', 'data["parent_hash"]', 'data["blocks"]',
        'block["tokens"]', 't["token_id"]', 'block["block_hash"]',
        'data["type"] == "removed"', 'data["block_hashes"]',
        'stat["kvCacheStats"]["usedNumBlocks"]', 'stat["kvCacheStats"]["maxNumBlocks"]',
        "get_kv_cache_events_async(", "get_stats_async(")
    dynamo_source("trtllm/main.py").require('"numActiveRequests"', '"numQueuedRequests"')
    bs = 4
    stored = {"event_id": 1, "data": {"type": "stored", "parent_hash": 2**64 - 1, "blocks": [
        {"block_hash": 1, "tokens": [{"token_id": t} for t in range(bs)]},
        {"block_hash": 2, "tokens": [{"token_id": 9}]}]}}  # partial: not announced
    (ev,) = convert_event(stored, bs)
    assert ev.block_hashes == (1,) and ev.parent_hash == -1 and ev.token_ids == (0, 1, 2, 3)
    assert convert_event({"data": {"type": "removed", "block_hashes": [5]}}, bs)[0].block_hashes == (5,)
    assert convert_event({"data": {"type": "created", "num_blocks_per_cache_level": [1]}}, bs) == []
    ld = load_from_stats({"numActiveRequests": 2, "numQueuedRequests": 0,
                          "kvCacheStats": {"usedNumBlocks": 7, "maxNumBlocks": 70}})
    assert (ld.active, ld.kv_used_blocks, ld.kv_total_blocks) == (2, 7, 70)


def test_llm_arguments_follow_dynamos_worker():
    dynamo_source("trtllm/workers/llm_worker.py").require(
        '"model"', '"tensor_parallel_size"', '"kv_cache_config"', '"max_num_tokens"',
        '"max_seq_len"', '"max_batch_size"', "event_buffer_max_size")
    agg = llm_kwargs(TrtllmEngineArgs(), "agg")
    assert agg["kv_cache_config"]["event_buffer_max_size"] > 0  # KV events need a buffer
    assert "cache_transceiver_config" not in agg
    for role in ("prefill", "decode"):
        assert llm_kwargs(TrtllmEngineArgs(transfer_backend="UCX"), role)[
            "cache_transceiver_config"] == {"backend": "UCX", "kv_transfer_timeout_ms": 60_000}
    off = llm_kwargs(TrtllmEngineArgs(kv_events=False), "agg")
    assert off["kv_cache_config"]["event_buffer_max_size"] == 0
