"""The shipped SGLang and TensorRT-LLM configs print a correct plan with --dry-run, and
mismatched block sizes are refused before anything starts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from splitserve.cli.main import app
from tests.unit.engines.upstream import sglang_module

pytestmark = pytest.mark.unit


def dry_run(graph: str, config: str, *extra: str):
    return CliRunner().invoke(app, ["serve", graph, "-f", config, "--dry-run", "--json", *extra])


def _plan(res) -> dict:
    assert res.exit_code == 0, res.output
    return json.loads(res.output[res.output.index("{"):])


@pytest.mark.parametrize(("engine", "graph", "config"), [
    ("sglang", "graphs.disagg:Frontend", "configs/sglang_disagg.yaml"),
    ("trtllm", "graphs.disagg:Frontend", "configs/trtllm_disagg.yaml"),
    ("sglang", "graphs.agg_router:Frontend", "configs/sglang_agg.yaml"),
    ("trtllm", "graphs.agg_router:Frontend", "configs/trtllm_agg.yaml"),
])
def test_dry_run_prints_the_engine_plan(engine, graph, config, tiny_models):
    if engine == "sglang":
        sglang_module("sglang.srt.server_args")  # validation runs SGLang's parser
    missing = dry_run(graph, config)  # the configs' /models/... is not on this machine
    assert missing.exit_code == 2 and "Common.model: '/models/Llama-3.1-8B-Instruct' " \
        "does not exist" in missing.output, missing.output
    res = dry_run(graph, config, f"--Common.model={tiny_models['llama']}")
    plan = _plan(res)
    assert f'"engine": "{engine}"' in res.output
    assert plan["common"]["served_model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert plan["common"]["model"] == str(tiny_models["llama"])


def test_router_block_size_must_match_the_engine():
    res = CliRunner().invoke(app, ["serve", "graphs.disagg:Frontend", "-f",
                                   "configs/trtllm_disagg.yaml", "--dry-run",
                                   "--Router.block_size=16"])
    assert res.exit_code != 0 and "tokens_per_block" in res.output, res.output
