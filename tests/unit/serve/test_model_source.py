"""Common.model serves the user's model: a local directory or a hub id found in the local
Hugging Face cache, refused by name when it is neither; the name clients send, the
context window, the end-of-sequence ids and the dtype come from the model's own files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from splitserve.contracts import model_files
from splitserve.contracts.config import CommonConfig, ConfigError
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan

pytestmark = pytest.mark.unit

GRAPH = "splitserve.graphs.agg_router:Frontend"


def plan(common: dict, worker: dict | None = None):
    g = load_graph(GRAPH)
    return build_plan(g, GRAPH, {"Common": common, "Worker": worker or {"engine": "torch"}},
                      "cfg.yaml", known_sections=g.defined)


def copy_with(src: Path, dst: Path, **config) -> Path:
    """A copy of model ``src`` whose config.json has ``config`` merged in."""
    shutil.copytree(src, dst)
    path = dst / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


def fake_hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """A Hugging Face cache holding one snapshot of ``repo_id`` (the layout
    huggingface_hub writes: refs/main names the commit, snapshots/<commit>/ the files)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_the_packaged_default_needs_no_files_named():
    common = CommonConfig()
    assert common.model == common.served_model_name == model_files.PACKAGED_MODEL
    assert plan({}).common.model == model_files.PACKAGED_MODEL


def test_a_directory_is_served_under_its_own_name(tiny_models, tmp_path, monkeypatch):
    model = tiny_models["qwen3"]
    common = plan({"model": str(model)}).common
    assert (common.model, common.served_model_name) == (str(model), "tiny-qwen3")
    named = CommonConfig(model=str(model), served_model_name="acme/chat")
    assert named.served_model_name == "acme/chat"
    monkeypatch.chdir(model.parent)  # a relative path is kept absolute for every process
    assert CommonConfig(model="./tiny-qwen3").model == str(model)
    # what every process receives round-trips unchanged
    assert CommonConfig.model_validate(named.model_dump(mode="json")) == named


@pytest.mark.parametrize("value", ["/no/such/model", "./missing-model", "~/missing-model"])
def test_a_missing_directory_is_refused_naming_the_field_and_value(value):
    with pytest.raises(ConfigError) as exc:
        plan({"model": value})
    (line,) = [e for e in exc.value.errors if e.startswith("Common.model")]
    assert repr(model_files.normalised(value)) in line and "does not exist" in line


def test_a_process_without_the_models_files_still_reads_its_config():
    """Only the plan checks the files: a router or planner on a host (a pod) without the
    model's volume validates the same Common section."""
    common = CommonConfig.model_validate({"model": "/models/not-on-this-host",
                                          "served_model_name": "acme/chat"})
    assert (common.model, common.served_model_name) == ("/models/not-on-this-host",
                                                        "acme/chat")


def test_a_file_or_a_directory_without_config_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        plan({"model": str(tmp_path / "weights.bin")})
    with pytest.raises(ConfigError, match="has no config.json"):
        plan({"model": str(tmp_path)})


def test_a_hub_id_is_found_in_the_local_cache_only(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = fake_hub_cache(tmp_path / "hub", "acme/tiny-chat", tiny_models["llama"])
    common = plan({"model": "acme/tiny-chat"}).common
    assert (common.model, common.served_model_name) == ("acme/tiny-chat", "acme/tiny-chat")
    assert model_files.locate("acme/tiny-chat") == snapshot
    assert common.effective_context_length() == 512
    with pytest.raises(ConfigError) as exc:
        plan({"model": "acme/not-fetched"})
    msg = str(exc.value)
    assert "Common.model: 'acme/not-fetched'" in msg and "nothing is downloaded" in msg


def test_hf_home_is_where_hub_ids_are_looked_up_and_a_miss_names_it(
        tiny_models, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = fake_hub_cache(tmp_path / "hf" / "hub", "acme/tiny-chat", tiny_models["llama"])
    assert model_files.locate("acme/tiny-chat") == snapshot
    with pytest.raises(ConfigError) as exc:
        plan({"model": "acme/not-fetched"})
    assert f"the Hugging Face cache ({tmp_path / 'hf' / 'hub'}) holds no snapshot" in str(
        exc.value)
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_files.hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")


def test_the_context_window_comes_from_config_json(tiny_models, tmp_path):
    base = tiny_models["llama"]
    assert CommonConfig(model=str(base)).effective_context_length() == 512
    longer = copy_with(base, tmp_path / "long", max_position_embeddings=1000)
    assert CommonConfig(model=str(longer)).effective_context_length() == 1000
    linear = copy_with(base, tmp_path / "linear", max_position_embeddings=1000,
                       rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert CommonConfig(model=str(linear)).effective_context_length() == 4000
    # yarn scales the original window: 256 x 2
    assert CommonConfig(model=str(tiny_models["qwen3"])).effective_context_length() == 512
    with pytest.raises(ConfigError) as exc:
        plan({"model": str(longer), "context_length": 1001})
    assert "exceeds long's own context window of 1000 tokens" in str(exc.value)
    assert plan({"model": str(longer), "context_length": 1000}).common.context_length == 1000


def test_eos_ids_dtype_and_window_come_from_the_files(tiny_models):
    qwen3 = model_files.read_model_info(tiny_models["qwen3"])
    assert qwen3.eos_token_ids == (2, 7)  # generation_config.json's beside config.json's
    assert qwen3.architectures == ("Qwen3ForCausalLM",)
    assert model_files.read_model_info(tiny_models["smollm"]).dtype == "bfloat16"
    assert model_files.read_model_info(tiny_models["mistral"]).sliding_window == 256
    assert model_files.read_model_info(tiny_models["qwen2"]).sliding_window is None
    packaged = model_files.model_info(model_files.PACKAGED_MODEL)
    assert (packaged.context_length, packaged.eos_token_ids) == (8192, (2,))


def test_a_pools_own_model_is_checked_where_it_is_declared(tiny_models):
    from splitserve.components.engines.trtllm.config import TrtllmEngineArgs

    assert TrtllmEngineArgs().model is None  # the pool serves Common.model
    assert TrtllmEngineArgs(model=str(tiny_models["qwen2"])).model == str(tiny_models["qwen2"])
    with pytest.raises(ValidationError, match="model\n.*'/no/such/model' does not exist"):
        TrtllmEngineArgs(model="/no/such/model")
