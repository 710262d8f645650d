"""The GPU configs and the GPU smoke test's overrides make valid plans: prefill and
decode engines on distinct GPUs (or sharing the only one when told so), and no fixed
NIXL side-channel port taken by two vLLM engines on one host."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from splitserve.contracts.config import ConfigError
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts/gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_smoke", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def plan(graph: str, config: str, overrides: list[str]):
    g = load_graph(graph)
    return build_plan(g, graph, yaml.safe_load((ROOT / config).read_text()), config,
                      overrides, g.defined)


@pytest.fixture
def model(tiny_models) -> str:
    """A model directory standing in for the configs' Llama 3.1 8B (the plan checks the
    model is there)."""
    return str(tiny_models["llama"])


@pytest.mark.parametrize("config", ["sglang_agg", "sglang_disagg", "trtllm_agg",
                                    "trtllm_disagg", "vllm_disagg_gpu"])
def test_gpu_configs_serve_common_model_under_its_served_name(config, model):
    """Every engine of a GPU config loads Common.model (no section names its own) and
    registers the name clients send; a model that is not there is refused by name."""
    pytest.importorskip({"sglang": "sglang.srt.server_args", "trtllm": "yaml",
                         "vllm": "vllm"}[config.split("_")[0]])
    graph = "graphs.disagg:Frontend" if "disagg" in config else "graphs.agg_router:Frontend"
    path = f"configs/{config}.yaml"
    with pytest.raises(ConfigError, match="Common.model: '/models/Llama-3.1-8B-Instruct' "
                                          "does not exist"):
        plan(graph, path, [])
    p = plan(graph, path, [f"--Common.model={model}"])
    assert p.common.served_model_name == "meta-llama/Llama-3.1-8B-Instruct"
    for c in p.components:
        args = getattr(c.config, "engine_args", None)
        if args is not None:
            assert (getattr(args, "model", None) or getattr(args, "model_path", None)) is None


def test_vllm_gpu_config_gives_each_engine_its_gpu_and_side_channel_port(model):
    pytest.importorskip("vllm")
    p = plan("graphs.disagg:Frontend", "configs/vllm_disagg_gpu.yaml",
             [f"--Common.model={model}"])
    dec, pre = p.component("DecodeWorker"), p.component("PrefillWorker")
    assert p.replica_env(dec, 0) != p.replica_env(pre, 0)
    for c in (dec, pre):
        assert c.config.kv_transfer.buffer_device == "cuda"
        # engines on one host: each must listen on its own handshake port
        assert c.config.kv_transfer.side_channel_port is None


@pytest.mark.parametrize("engine", ["sglang", "trtllm", "vllm"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_smoke_overrides_make_valid_plans(engine, gpus, model):
    pytest.importorskip({"sglang": "sglang.srt.server_args", "trtllm": "yaml",
                         "vllm": "vllm"}[engine])
    s = smoke()
    eng = s.ENGINES[engine]
    graph, config, extra = eng.agg
    agg = plan(graph, config, [*s.overrides(eng, eng.agg_sections, model, gpus,
                                            graph.endswith("disagg:Frontend")), *extra])
    assert agg.common.model == model
    graph, config = eng.disagg
    p = plan(graph, config, [*s.overrides(eng, ("DecodeWorker", "PrefillWorker"), model, gpus,
                                          True),
                             f"--DecodeWorker.disaggregated_router={s.FORCED_REMOTE}"])
    envs = {c: p.replica_env(p.component(c), 0)["CUDA_VISIBLE_DEVICES"]
            for c in ("DecodeWorker", "PrefillWorker")}
    assert (envs["DecodeWorker"] == envs["PrefillWorker"]) == (gpus == 1)
