"""Common.context_length: validated, refused above the model's own unless every engine is
the mocker, and handed to the frontend's context check and the mocker's max model length."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
from pydantic import ValidationError

from splitserve.components.engines.mocker.config import MockerEngineArgs
from splitserve.components.engines.mocker.process import mocker_argv
from splitserve.components.frontend.textcodec import TextCodec
from splitserve.contracts.config import CommonConfig, ConfigError
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan

pytestmark = pytest.mark.unit

GRAPH = "splitserve.graphs.agg_router:Frontend"


def plan(common: dict, worker: dict):
    g = load_graph(GRAPH)
    return build_plan(g, GRAPH, {"Common": common, "Worker": worker}, "cfg.yaml",
                      known_sections=g.defined)


@pytest.mark.parametrize("value", [0, -5, 1.5, "long"])
def test_context_length_must_be_a_positive_int(value):
    with pytest.raises(ValidationError):
        CommonConfig(context_length=value)


def test_default_is_the_models_own_window():
    assert CommonConfig().effective_context_length() == 8192
    assert CommonConfig(context_length=4096).effective_context_length() == 4096


def test_mocker_fleet_may_exceed_the_models_window():
    p = plan({"context_length": 131072}, {"engine": "mocker"})
    assert p.common.effective_context_length() == 131072


def test_real_engine_refuses_a_window_beyond_the_models():
    with pytest.raises(ConfigError) as exc:
        plan({"context_length": 131072}, {"engine": "torch"})
    msg = str(exc.value)
    assert "Common.context_length" in msg and "8192" in msg and "Worker (torch)" in msg


def test_real_engine_accepts_a_shorter_window():
    assert plan({"context_length": 2048}, {"engine": "torch"}).common.context_length == 2048


def test_mocker_gets_max_model_len_only_when_configured():
    base = {"namespace": "ns", "component": "worker", "model_dir": Path("/m"),
            "model_name": "SmolLM2-135M-Instruct", "request_plane": "tcp"}
    argv = mocker_argv(MockerEngineArgs(), **base, max_model_len=100000)
    assert argv[argv.index("--max-model-len") + 1] == "100000"
    assert "--max-model-len" not in mocker_argv(MockerEngineArgs(), **base)
    with pytest.raises(ValidationError):
        MockerEngineArgs(extra_args=["--max-model-len", "5"])


def test_frontend_codec_uses_the_configured_window(smollm2_dir, tiny_models):
    from splitserve.components.frontend.main import _load_codec

    assert _load_codec(str(smollm2_dir), "unused", 100000).context_length == 100000
    # without Frontend.model_dir: Common.model's own files, its own window when unset
    qwen3 = tiny_models["qwen3"]
    own = json.loads((qwen3 / "config.json").read_text())["max_position_embeddings"]
    assert _load_codec(None, str(qwen3), 512).context_length == 512
    assert TextCodec.from_dir(qwen3).context_length == own
