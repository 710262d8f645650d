"""Mapping between the engine interface and vLLM's request and output objects."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from splitserve.contracts.engine import (
    EngineHandoff,
    GenerateParams,
    OpaqueHandoff,
    SglangBootstrapHandoff,
    TorchBlocksHandoff,
    VllmHandoff,
)
from splitserve.components.engines.vllm.config import VllmKvTransfer
from splitserve.components.engines.vllm.requests import (
    NIXL_PREFILL_PARAMS,
    prompt,
    sampling_params,
    to_delta,
)
from splitserve.components.worker.wire import params_from_wire as generate_params
from splitserve.contracts.wire import FinishReason, WorkerRequest, worker_request

pytestmark = pytest.mark.unit

PARAMS = GenerateParams(token_ids=(1, 2, 3), max_tokens=7, temperature=0.5, top_p=0.9,
                        seed=3, stop_token_ids=(2, 99))


def test_sampling_params_carry_every_field_and_stream_deltas():
    from vllm.sampling_params import RequestOutputKind

    sp = sampling_params(PARAMS)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed) == (7, 0.5, 0.9, 3)
    assert set(sp.stop_token_ids) == {2, 99} and not sp.ignore_eos
    assert sp.output_kind == RequestOutputKind.DELTA and not sp.detokenize
    assert not (sp.extra_args or {}).get("kv_transfer_params")
    assert prompt(PARAMS) == {"prompt_token_ids": [1, 2, 3]}


def test_prefill_asks_for_one_token_and_a_remote_decode():
    sp = sampling_params(PARAMS, max_tokens=1, kv_transfer_params=NIXL_PREFILL_PARAMS)
    assert sp.max_tokens == 1
    assert sp.extra_args["kv_transfer_params"]["do_remote_decode"] is True


def test_greedy_request_from_the_wire():
    wire = worker_request(model="m", token_ids=[5, 6], max_tokens=4, temperature=0.0,
                          top_p=None, seed=None, eos_token_ids=[2], request_id="r",
                          priority="high")
    p = generate_params(WorkerRequest.model_validate(wire))
    assert p == GenerateParams(token_ids=(5, 6), max_tokens=4, temperature=0.0, top_p=1.0,
                               seed=None, stop_token_ids=(2,), priority=0)
    assert sampling_params(p).temperature == 0.0


def _output(tokens, finished, reason=None, cached=0):
    from vllm.outputs import CompletionOutput, RequestOutput

    comp = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None,
                            logprobs=None, finish_reason=reason)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3],
                         prompt_logprobs=None, outputs=[comp], finished=finished,
                         num_cached_tokens=cached)


@pytest.mark.parametrize("reason, expected", [
    ("stop", FinishReason.EOS), ("length", FinishReason.LENGTH),
    ("abort", FinishReason.CANCELLED), ("error", FinishReason.ERROR),
    ("repetition", FinishReason.EOS)])
def test_outputs_become_deltas(reason, expected):
    d = to_delta(_output([7, 8], False))
    assert d.token_ids == (7, 8) and not d.finished and d.finish_reason is None
    d = to_delta(_output([9], True, reason, cached=128))
    assert d.finished and d.finish_reason is expected
    assert (d.prompt_tokens, d.cached_tokens) == (3, 128)


def test_every_finish_reason_vllm_names_is_mapped():
    from vllm.v1.engine import FINISH_REASON_STRINGS

    from splitserve.components.engines.vllm.requests import _FINISH

    assert set(FINISH_REASON_STRINGS) == set(_FINISH)


def test_handoffs_round_trip_by_kind():
    adapter = TypeAdapter(EngineHandoff)
    for h in (TorchBlocksHandoff(nixl_agent="a", block_ids=[1, 2], block_size=16),
              VllmHandoff(kv_transfer_params={"remote_engine_id": "e",
                                              "remote_block_ids": [3]}),
              SglangBootstrapHandoff(bootstrap_host="127.0.0.1", bootstrap_port=8998,
                                     bootstrap_room=42),
              OpaqueHandoff(disaggregated_params={"opaque": "x"})):
        back = adapter.validate_json(adapter.dump_json(h))
        assert type(back) is type(h) and back == h
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "vllm", "kv_transfer_params": {}, "extra": 1})
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "nope"})


def test_vllm_engine_implements_the_interface():
    from splitserve.contracts.engine import Engine
    from splitserve.components.engines.vllm.config import VllmEngineArgs
    from splitserve.components.engines.vllm.engine import VllmEngine

    e = VllmEngine(VllmEngineArgs(kv_events=False), "m")
    assert isinstance(e, Engine)
    assert e.info.kv_block_size == 128 and e.info.capabilities.local_prefill
    assert e.kv_endpoint is None and e.inflight() == 0


def test_decode_refuses_another_engines_handoff():
    from splitserve.components.engines.vllm.config import VllmEngineArgs
    from splitserve.components.engines.vllm.engine import VllmEngine

    e = VllmEngine(VllmEngineArgs(kv_events=False), "m", "decode",
                   kv_transfer=VllmKvTransfer())
    with pytest.raises(TypeError, match="torch-blocks"):
        e.decode("r", PARAMS, TorchBlocksHandoff(nixl_agent="a", block_ids=[1],
                                                 block_size=16), first_token=5)


def test_roles_and_transfer_config():
    from splitserve.components.engines.vllm.config import VllmEngineArgs, engine_env
    from splitserve.components.engines.vllm.engine import VllmEngine

    args = VllmEngineArgs(kv_events=False, cpu_cores="1")
    with pytest.raises(ValueError, match="needs a kv_transfer"):
        VllmEngine(args, "m", "prefill")
    with pytest.raises(ValueError, match="needs no kv_transfer"):
        VllmEngine(args, "m", "agg", kv_transfer=VllmKvTransfer())
    agg = VllmEngine(args, "m")
    with pytest.raises(RuntimeError, match="decode vLLM engine"):
        agg.decode("r", PARAMS, VllmHandoff(kv_transfer_params={}))
    t = VllmKvTransfer()
    assert t.connector_config("prefill", "p-1") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
        "engine_id": "p-1",
        "kv_connector_extra_config": {"splitserve_progress_thread": False,
                                      "splitserve_keep_model_cores": True,
                                      "splitserve_repick_side_channel_port": True},
        "kv_connector_module_path": "splitserve.components.engines.vllm.nixl_connector"}
    # on CPU the project's connector keeps the model thread on its cores, progress
    # thread or not; a configured side-channel port is kept (or the start fails)
    assert VllmKvTransfer(progress_thread=True, side_channel_port=5611).connector_config(
        "prefill", "p-1")["kv_connector_extra_config"] == {
            "splitserve_keep_model_cores": True}
    gpu = VllmKvTransfer(buffer_device="cuda", progress_thread=True, side_channel_port=5611)
    assert gpu.connector_config("decode", "d-1") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer",
        "kv_buffer_device": "cuda", "engine_id": "d-1", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {},
        "kv_connector_module_path": "splitserve.components.engines.vllm.nixl_connector"}
    # NIXL's dedicated transfer workers: vLLM's default unless set; 0 on CPU hosts
    assert "num_threads" not in t.connector_config("prefill", "p-1")[
        "kv_connector_extra_config"]
    assert VllmKvTransfer(transfer_threads=0, progress_thread=True,
                          side_channel_port=5611).connector_config(
        "prefill", "p-1")["kv_connector_extra_config"] == {
            "num_threads": 0, "splitserve_keep_model_cores": True}
    with pytest.raises(ValidationError):
        VllmKvTransfer(transfer_threads=-1)
    strict = VllmKvTransfer(on_load_failure="fail")
    assert strict.connector_config("decode", "d-2")["kv_load_failure_policy"] == "fail"
    with pytest.raises(ValidationError):
        VllmKvTransfer(on_load_failure="retry")
    env = engine_env(args, t, 5611)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5611"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in engine_env(args)
    with pytest.raises(ValidationError):
        VllmEngineArgs(cpu_cores="all")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_transfer_config_is_accepted_by_vllm(role):
    """Every field this project sets exists in vLLM's own KVTransferConfig, with a value
    it accepts (a renamed field in a vLLM upgrade fails here, not at engine start)."""
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    cfg = kv_transfer.KVTransferConfig(
        **VllmKvTransfer(transfer_threads=0).connector_config(role, "e-1"))
    assert cfg.get_from_extra_config("num_threads", 4) == 0  # the key vLLM's NIXL worker reads
    assert cfg.kv_role == ("kv_producer" if role == "prefill" else "kv_consumer")
    if role == "decode":
        assert cfg.kv_load_failure_policy == "recompute"


def test_vllms_engine_core_is_spawned_never_forked():
    """vLLM forks its engine core by default on CUDA (round 2, finding 7); the worker
    starting it holds Dynamo's runtime threads and its NATS and etcd sockets, so every
    engine sets spawn, as Dynamo's vLLM worker does; vLLM reads the variable itself."""
    from splitserve.components.engines.vllm.config import VllmEngineArgs, engine_env
    from tests.unit.engines.upstream import dynamo_source

    dynamo_source("vllm/main.py").require('os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"')
    import vllm.envs as envs

    assert "VLLM_WORKER_MULTIPROC_METHOD" in envs.environment_variables
    assert engine_env(VllmEngineArgs())["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
