"""DecodeWorker / PrefillWorker sections: engine selection and the shipped configs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.serve.catalog import DecodeWorker, PrefillWorker
from splitserve.components.engines.torch_cpu.sections import (
    TorchDecodeWorkerConfig,
    TorchPrefillWorkerConfig,
)
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import load_plan

DecodeWorkerConfig, PrefillWorkerConfig = DecodeWorker.config_model, PrefillWorker.config_model

pytestmark = pytest.mark.unit

GRAPH = "graphs.disagg:Frontend"


@pytest.mark.parametrize(("selector", "section", "expected"), [
    (DecodeWorkerConfig, {}, "TorchDecodeWorkerConfig"),
    (DecodeWorkerConfig, {"engine": "mocker"}, "MockerDecodeWorkerConfig"),
    (PrefillWorkerConfig, {}, "TorchPrefillWorkerConfig"),
    (PrefillWorkerConfig, {"engine": "mocker"}, "MockerPrefillWorkerConfig"),
])
def test_engine_key_selects_the_model(selector, section, expected):
    assert type(selector.model_validate(section)).__name__ == expected


def test_torch_sections_keep_their_fields():
    assert set(TorchDecodeWorkerConfig.model_fields) >= {
        "engine", "engine_args", "disaggregated_router", "remote_prefill_timeout_s",
        "prefill_queue", "kv_transfer"}
    assert set(TorchPrefillWorkerConfig.model_fields) >= {
        "engine", "engine_args", "max_concurrent_jobs", "prefill_queue", "kv_transfer"}


@pytest.mark.parametrize(("selector", "section", "message"), [
    (DecodeWorkerConfig, {"engine": "nope"}, "engine"),
    (DecodeWorkerConfig, {"engine": "mocker", "kv_transfer": {}}, "kv_transfer"),
    (PrefillWorkerConfig, {"engine": "mocker",
                           "engine_args": {"disaggregation_mode": "prefill"}},
     "chooses each engine's mode"),
    (DecodeWorkerConfig, {"engine": "mocker", "engine_args": {"workers_per_process": 2}},
     "workers_per_process must be 1"),
    (DecodeWorkerConfig, {"engine": "mocker", "disaggregated_router": {"bogus": 1}},
     "disaggregated_router"),
])
def test_bad_sections_are_refused_naming_the_field(selector, section, message):
    with pytest.raises(ValidationError, match=message):
        selector.model_validate(section)


@pytest.mark.parametrize(("path", "engine_type"), [
    ("configs/mocker_disagg.yaml", "sglang"), ("configs/mocker_disagg_trtllm.yaml", "trtllm")])
def test_shipped_mocker_disagg_configs_load(repo_root, path, engine_type):
    g = load_graph(GRAPH)
    plan = load_plan(g, GRAPH, repo_root / path, ["--DecodeWorker.engine_args.speedup_ratio=5"],
                     g.defined)
    decode, prefill = plan.component("DecodeWorker"), plan.component("PrefillWorker")
    assert (decode.config.engine, prefill.config.engine) == ("mocker", "mocker")
    assert (decode.replicas, prefill.replicas) == (2, 2)
    assert decode.config.engine_args.engine_type == engine_type
    assert decode.config.engine_args.speedup_ratio == 5
    assert decode.config.disaggregated_router["remote_prefill_min_score"] == 0.5


def test_a_mocker_worker_refuses_a_load_report_interval_it_would_not_use():
    from splitserve.serve.catalog import Worker

    assert Worker.config_model.model_validate({"engine": "mocker"}).engine == "mocker"
    with pytest.raises(ValidationError, match="load_report_interval_s is not used"):
        Worker.config_model.model_validate({"engine": "mocker", "load_report_interval_s": 1})
