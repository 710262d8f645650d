"""Every engine serves Common.model under Common.served_model_name: vLLM, SGLang and
TensorRT-LLM get the model's directory (a pool's own model when its section names one)
and the served name through their own argument building, and the mocker reads the
model's geometry from its config.json."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from splitserve.contracts.config import CommonConfig
from splitserve.contracts.kit.model_dir import weights_dir
from splitserve.contracts.model_files import PACKAGED_MODEL, model_dir
from tests.unit.engines.upstream import sglang_module

pytestmark = pytest.mark.unit

SERVED = "acme/tiny-chat"


def context(model) -> SimpleNamespace:
    common = CommonConfig(model=str(model), served_model_name=SERVED)
    return SimpleNamespace(run=SimpleNamespace(common=common, replica=0))


def test_vllm_gets_the_directory_and_the_served_name(tiny_models):
    pytest.importorskip("vllm")
    from splitserve.components.engines.vllm.config import VllmEngineArgs, to_engine_args
    from splitserve.components.engines.vllm.engine import make_engine
    from splitserve.components.engines.vllm.sections import VllmWorkerSection

    eng = make_engine(context(tiny_models["qwen3"]), VllmWorkerSection(), "agg")
    assert (eng.model, eng.served_name) == (str(tiny_models["qwen3"]), SERVED)
    ea = to_engine_args(eng.args, str(weights_dir(eng.model)), eng.served_name)
    assert (ea.model, ea.served_model_name, ea.dtype) == (str(tiny_models["qwen3"]), SERVED,
                                                          "auto")
    own = VllmWorkerSection(engine_args=VllmEngineArgs(model=str(tiny_models["llama"])))
    assert make_engine(context(tiny_models["qwen3"]), own, "agg").model == \
        str(tiny_models["llama"])


def test_the_packaged_default_loads_as_float32_weights(smollm2_dir):
    """vLLM's dtype `auto` reads the weights' dtype: the de-quantised weights are float32
    (the export's config keeps the bfloat16 deployments serve, for the mocker)."""
    loadable = weights_dir(PACKAGED_MODEL)
    config = json.loads((loadable / "config.json").read_text())
    exported = json.loads((model_dir(PACKAGED_MODEL) / "config.json").read_text())
    assert (config["torch_dtype"], exported["torch_dtype"]) == ("float32", "bfloat16")
    assert {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")} == \
        {k: v for k, v in exported.items() if k not in ("torch_dtype", "dtype")}
    assert (loadable / "model.safetensors").resolve().is_file()
    assert (loadable / "tokenizer.json").resolve() == (smollm2_dir / "tokenizer.json")


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
def test_sglang_gets_the_directory_and_the_served_name_through_its_parser(tiny_models, role):
    sglang_module("sglang.srt.server_args")
    from splitserve.components.engines.sglang.config import check_server_args
    from splitserve.components.engines.sglang.engine import make_engine
    from splitserve.components.engines.sglang.sections import SECTIONS

    section = SECTIONS[role].model_validate({"engine": "sglang"})
    eng = make_engine(context(tiny_models["mistral"]), section, role)
    built = check_server_args(eng.server_kwargs())  # SGLang's own flags and ServerArgs
    assert (built.model_path, built.served_model_name) == (str(tiny_models["mistral"]),
                                                           SERVED)


def test_trtllm_gets_the_directory(tiny_models):
    from splitserve.components.engines.trtllm.config import TrtllmEngineArgs, llm_kwargs
    from splitserve.components.engines.trtllm.engine import make_engine
    from splitserve.components.engines.trtllm.sections import SECTIONS

    eng = make_engine(context(tiny_models["qwen2"]), SECTIONS["agg"](), "agg")
    assert llm_kwargs(eng.args, "agg")["model"] == str(tiny_models["qwen2"])
    assert eng.served_name == SERVED
    own = SECTIONS["decode"](engine_args=TrtllmEngineArgs(model=str(tiny_models["llama"])))
    eng = make_engine(context(tiny_models["qwen2"]), own, "decode")
    assert llm_kwargs(eng.args, "decode")["model"] == str(tiny_models["llama"])


def test_the_mocker_reads_the_models_geometry(tiny_models):
    from dynamo.mocker.utils.kv_cache import compute_kv_bytes_per_token

    from splitserve.components.engines.mocker.config import MockerEngineArgs
    from splitserve.components.engines.mocker.process import (
        kv_geometry,
        mocker_argv,
        model_dir_for,
    )

    args = MockerEngineArgs()
    path = model_dir_for(args, str(tiny_models["qwen3"]))
    argv = mocker_argv(args, namespace="ns", component="worker", model_dir=path,
                       model_name=SERVED, request_plane="tcp",
                       kv_bytes_per_token=kv_geometry(path))
    assert argv[argv.index("--model-path") + 1] == str(tiny_models["qwen3"])
    assert argv[argv.index("--model-name") + 1] == SERVED
    # layers x (K, V) x KV heads x head dim (config.json's own 32) x float32's 4 bytes;
    # Dynamo's mocker would take hidden / heads = 16 as the head dimension
    assert argv[argv.index("--kv-bytes-per-token") + 1] == str(2 * 2 * 2 * 32 * 4)
    assert compute_kv_bytes_per_token(str(path)) == 2 * 2 * 2 * 16 * 4
    given = args.model_copy(update={"extra_args": ["--kv-bytes-per-token", "7"]})
    argv = mocker_argv(given, namespace="ns", component="worker", model_dir=path,
                       model_name=SERVED, request_plane="tcp", kv_bytes_per_token=1024)
    assert argv.count("--kv-bytes-per-token") == 1 and argv[-1] == "7"
    # the packaged default: its weight-less export, whose geometry is what Dynamo reads
    packaged = model_dir_for(args, PACKAGED_MODEL)
    assert packaged == model_dir(PACKAGED_MODEL)
    assert kv_geometry(packaged) == compute_kv_bytes_per_token(str(packaged)) == 23040


def test_each_model_pool_of_a_vllm_graph_starts_vllm_on_its_own_model(tiny_models, tmp_path):
    """Two models side by side on vLLM: a pool's replicas get the pool's model and served
    name in their run config, and vLLM's engine is built on that directory."""
    pytest.importorskip("vllm")
    from splitserve.components.engines.vllm.engine import make_engine
    from splitserve.components.engines.vllm.sections import VllmWorkerSection
    from splitserve.serve.graph import load_graph
    from splitserve.serve.plan import build_plan

    ref = "splitserve.graphs.agg_router:Frontend"
    g = load_graph(ref)
    raw = {"Common": {"model": str(tiny_models["qwen3"])},
           "Router": {"block_size": 128},
           "Worker": {"engine": "vllm", "engine_args": {"block_size": 128}},
           "Models": {"llama": {"model": str(tiny_models["llama"]),
                                "served_model_name": "tiny-llama-chat"}}}
    plan = build_plan(g, ref, raw, "cfg.yaml", known_sections=g.defined)
    built = {}
    for name in ("Worker", "Worker@llama"):
        comp = plan.component(name)
        run = plan.run_config(comp, 0, tmp_path / f"{name}.json")
        eng = make_engine(SimpleNamespace(run=run), VllmWorkerSection.model_validate(
            run.config), "agg")
        built[name] = (eng.model, eng.served_name)
    assert built == {"Worker": (str(tiny_models["qwen3"]), "tiny-qwen3"),
                     "Worker@llama": (str(tiny_models["llama"]), "tiny-llama-chat")}
