"""Several models in one graph: the config's ``Models`` adds a pool per model, each a
copy of every component but the frontend, in its own Dynamo namespace, with its own
model, served name and sections; every mistake is refused naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.contracts.config import ConfigError
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan

pytestmark = pytest.mark.unit


def plan(models, graph: str = "splitserve.graphs.agg_router:Frontend", **sections):
    g = load_graph(graph)
    raw = {"Worker": {"engine": "torch"}, **sections, "Models": models}
    return build_plan(g, graph, raw, "cfg.yaml", known_sections=g.defined)


def refusal(models, **kw) -> str:
    with pytest.raises(ConfigError) as exc:
        plan(models, **kw)
    return str(exc.value)


def test_a_pool_copies_every_component_but_the_frontend(tiny_models, tmp_path):
    p = plan({"llama": {"model": str(tiny_models["llama"]), "served_model_name": "my-llama",
                        "Worker": {"replicas": 2}}},
             Worker={"engine": "torch", "drain_timeout_s": 7})
    names = [c.name for c in p.components]
    assert names == ["Worker", "Router", "Frontend", "Worker@llama", "Router@llama"]
    worker = p.component("Worker@llama")
    # the graph's section with the pool's laid over it
    assert (worker.replicas, worker.config.drain_timeout_s) == (2, 7)
    assert p.component("Worker").replicas == 1
    assert p.served_models() == {"SmolLM2-135M-Instruct": "", "my-llama": "llama"}
    # the pool's processes run the graph's component in the pool's namespace, its model
    run = p.run_config(worker, 0, tmp_path / "s.json")
    assert (run.component, run.pool) == ("Worker", "llama")
    assert run.common.namespace == "dynamo-llama"
    assert run.common.model == str(tiny_models["llama"])
    assert run.common.served_model_name == "my-llama"
    assert p.run_config(p.component("Router@llama"), 0, tmp_path / "r.json").links == [
        "Worker"]
    # the frontend knows every pool
    front = p.run_config(p.component("Frontend"), 0, tmp_path / "f.json")
    assert front.pool is None and front.common.namespace == "dynamo"
    assert front.pools["llama"].served_model_name == "my-llama"
    assert p.to_dict()["models"]["llama"]["namespace"] == "dynamo-llama"


def test_a_pool_gets_its_own_context_window_not_the_graphs(tiny_models):
    p = plan({"qwen": {"model": str(tiny_models["qwen3"])}},
             Common={"context_length": 1024})
    assert p.pools["qwen"].context_length is None
    assert p.pools["qwen"].effective_context_length() == 512  # the model's own
    assert p.pools["qwen"].served_model_name == "tiny-qwen3"


def test_a_pools_planner_scales_its_own_workers(tiny_models):
    from splitserve.contracts.config import read_yaml

    raw = read_yaml(Path(__file__).resolve().parents[3] / "configs" / "disagg_planner.yaml")
    raw["Models"] = {"q": {"model": str(tiny_models["qwen3"])}}
    graph = "splitserve.graphs.disagg_planner:Frontend"
    g = load_graph(graph)
    p = build_plan(g, graph, raw, "cfg.yaml", known_sections=g.defined)
    assert p.component("Planner@q").config.components == {
        "prefill": "PrefillWorker@q", "decode": "DecodeWorker@q"}
    assert p.component("Planner").config.components == {
        "prefill": "PrefillWorker", "decode": "DecodeWorker"}


@pytest.mark.parametrize(("models", "says"), [
    ({"Qwen": {"model": "x"}}, "Models.Qwen: a pool name is"),
    ({"q": {"served_model_name": "x"}}, "Models.q.model: required"),
    ({"q": {"model": "/nowhere/at-all"}}, "Models.q.model: '/nowhere/at-all' does not exist"),
    ({"q": {"model": "m", "Wroker": {}}}, "Models.q.Wroker: unknown field (a pool sets: "
                                         "model, served_model_name, context_length, Worker"),
    ({"q": ["model"]}, "Models.q: must be a mapping"),
    (["q"], "Models: must be a mapping"),
])
def test_mistakes_are_refused_by_field(models, says):
    assert says in refusal(models)


def test_a_served_name_is_served_once(tiny_models):
    says = refusal({"a": {"model": str(tiny_models["llama"]),
                          "served_model_name": "SmolLM2-135M-Instruct"}})
    assert "Models.a.served_model_name: 'SmolLM2-135M-Instruct' is already served by " \
           "Common.model" in says
    says = refusal({"a": {"model": str(tiny_models["llama"])},
                    "b": {"model": str(tiny_models["llama"])}})
    assert "Models.b.served_model_name: 'tiny-llama' is already served by Models.a" in says


def test_a_pools_sections_are_validated_as_the_graphs(tiny_models):
    says = refusal({"a": {"model": str(tiny_models["llama"]), "Worker": {"replicas": -1}}})
    assert "Models.a.Worker.replicas" in says
    says = refusal({"a": {"model": str(tiny_models["llama"]),
                          "Router": {"policy": "fastest"}}})
    assert "Models.a.Router.policy" in says


def test_routing_in_the_frontends_process_serves_one_model(tiny_models):
    says = refusal({"a": {"model": str(tiny_models["llama"])}},
                   Frontend={"routing": "in_process"})
    assert "Frontend.routing: in_process routes one model" in says
