"""vLLM engine config: strict fields, pass-through checked against vLLM's real
AsyncEngineArgs, loopback-only KV events, and the Worker section selecting it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from splitserve.components.engines.vllm.config import (
    MAPPED,
    VllmEngineArgs,
    engine_env,
    to_engine_args,
)

pytestmark = pytest.mark.unit


def test_unknown_pass_through_argument_is_refused_by_name():
    with pytest.raises(ValidationError) as exc:
        VllmEngineArgs(extra_engine_args={"max_num_seqz": 4})
    assert "max_num_seqz" in str(exc.value) and "AsyncEngineArgs" in str(exc.value)


def test_mapped_argument_through_pass_through_is_refused():
    with pytest.raises(ValidationError) as exc:
        VllmEngineArgs(extra_engine_args={"block_size": 16})
    assert "block_size" in str(exc.value) and "own field" in str(exc.value)


def test_unknown_field_is_refused():
    with pytest.raises(ValidationError, match="blok_size"):
        VllmEngineArgs.model_validate({"blok_size": 16})


def test_every_mapped_name_is_a_real_engine_argument():
    from vllm.engine.arg_utils import AsyncEngineArgs

    names = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert MAPPED <= names, MAPPED - names


def test_engine_args_carry_the_configured_values():
    args = VllmEngineArgs(max_model_len=2048, max_num_seqs=8, block_size=128,
                          extra_engine_args={"max_logprobs": 3})
    ea = to_engine_args(args, "/m", "served", "tcp://127.0.0.1:5999",
                        {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                         "kv_buffer_device": "cpu"})
    assert (ea.model, ea.served_model_name, ea.dtype) == ("/m", "served", "auto")
    assert (ea.max_model_len, ea.max_num_seqs, ea.block_size) == (2048, 8, 128)
    assert ea.enable_prefix_caching and ea.enforce_eager and not ea.disable_log_stats
    assert ea.max_logprobs == 3
    assert ea.kv_events_config.endpoint == "tcp://127.0.0.1:5999"
    assert ea.kv_events_config.publisher == "zmq"
    assert ea.kv_events_config.enable_kv_cache_events
    assert ea.kv_transfer_config.kv_connector == "NixlConnector"
    assert ea.kv_transfer_config.kv_role == "kv_producer"


def test_kv_events_off_leaves_no_publisher():
    ea = to_engine_args(VllmEngineArgs(kv_events=False), "/m", "served", None)
    assert ea.kv_events_config is None and ea.kv_transfer_config is None
    assert not VllmEngineArgs(enable_prefix_caching=False).kv_events_enabled()


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557",
                                      "tcp://10.0.0.1:5557"])
def test_kv_events_endpoint_must_be_loopback(endpoint):
    with pytest.raises(ValueError, match="loopback"):
        to_engine_args(VllmEngineArgs(), "/m", "served", endpoint)


def test_kv_cache_space_goes_to_the_cpu_backend_environment():
    assert engine_env(VllmEngineArgs(kv_cache_space_gib=2)) == {
        "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    with pytest.raises(ValidationError):  # vLLM reads it as an integer
        VllmEngineArgs(kv_cache_space_gib=0.5)


def test_worker_section_selects_vllm():
    from splitserve.serve.catalog import Worker
    from splitserve.components.engines.vllm.config import VllmWorkerSection

    model = Worker.config_model
    cfg = model.model_validate({"engine": "vllm", "engine_args": {"max_num_seqs": 4}})
    assert isinstance(cfg, VllmWorkerSection) and cfg.engine_args.max_num_seqs == 4
    with pytest.raises(ValidationError, match="num_blocks"):
        model.model_validate({"engine": "vllm", "engine_args": {"num_blocks": 4}})


def test_router_block_size_must_equal_vllms(tmp_path):
    from splitserve.contracts.config import ConfigError
    from splitserve.serve.graph import load_graph
    from splitserve.serve.plan import load_plan

    ref = "graphs.agg_router:Frontend"
    plan = load_plan(load_graph(ref), ref, Path("configs/vllm_agg_router.yaml"))
    assert {c.name for c in plan.components} >= {"Router", "Worker"}
    with pytest.raises(ConfigError) as exc:
        load_plan(load_graph(ref), ref, Path("configs/vllm_agg_router.yaml"),
                  ["--Router.block_size=16"])
    msg = str(exc.value)
    assert "Worker.engine_args.block_size" in msg and "Router.block_size 16" in msg


def test_vllm_stop_leaves_the_replica_time_to_exit_inside_the_graph_deadline():
    """vLLM's engine stop is cut by vLLM itself before the supervisor's deadline, so a
    slow stop on busy cores is not an unclean exit; the packaged vLLM configs give it
    its full budget."""
    from splitserve.components.engines.vllm.engine import (
        EXIT_MARGIN_S,
        STOP_TIMEOUT_S,
        stop_budget_s,
    )
    from splitserve.contracts.config import CommonConfig

    default = CommonConfig.model_fields["shutdown_timeout_s"].default
    assert stop_budget_s(default) <= default - EXIT_MARGIN_S
    assert stop_budget_s(300) == STOP_TIMEOUT_S and stop_budget_s(5) == 1.0
    root = Path(__file__).resolve().parents[3] / "configs"
    import yaml
    for name in ("vllm_agg.yaml", "vllm_agg_router.yaml", "vllm_disagg.yaml",
                 "vllm_disagg_gpu.yaml"):
        deadline = yaml.safe_load((root / name).read_text())["Common"]["shutdown_timeout_s"]
        assert stop_budget_s(deadline) == STOP_TIMEOUT_S, name
