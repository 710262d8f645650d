"""The GPU configs and the GPU smoke test's overrides make valid plans: prefill and
decode engines on distinct GPUs (or sharing the only one when told so), and no fixed
NIXL side-channel port taken by two vLLM engines on one host."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

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


def test_vllm_gpu_config_gives_each_engine_its_gpu_and_side_channel_port():
    pytest.importorskip("vllm")
    p = plan("graphs.disagg:Frontend", "configs/vllm_disagg_gpu.yaml", [])
    dec, pre = p.component("DecodeWorker"), p.component("PrefillWorker")
    assert p.replica_env(dec, 0) != p.replica_env(pre, 0)
    for c in (dec, pre):
        assert c.config.kv_transfer.buffer_device == "cuda"
        # engines on one host: each must listen on its own handshake port
        assert c.config.kv_transfer.side_channel_port is None


@pytest.mark.parametrize("engine", ["sglang", "trtllm", "vllm"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_smoke_overrides_make_valid_plans(engine, gpus):
    pytest.importorskip({"sglang": "sglang.srt.server_args", "trtllm": "yaml",
                         "vllm": "vllm"}[engine])
    s = smoke()
    eng = s.ENGINES[engine]
    graph, config, extra = eng.agg
    plan(graph, config, [*s.overrides(eng, eng.agg_sections, "/m", gpus,
                                      graph.endswith("disagg:Frontend")), *extra])
    graph, config = eng.disagg
    p = plan(graph, config, [*s.overrides(eng, ("DecodeWorker", "PrefillWorker"), "/m", gpus,
                                          True),
                             f"--DecodeWorker.disaggregated_router={s.FORCED_REMOTE}"])
    envs = {c: p.replica_env(p.component(c), 0)["CUDA_VISIBLE_DEVICES"]
            for c in ("DecodeWorker", "PrefillWorker")}
    assert (envs["DecodeWorker"] == envs["PrefillWorker"]) == (gpus == 1)
