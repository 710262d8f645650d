"""`Frontend.routing: in_process` in a graph config: what is accepted and what is refused,
with errors naming the file and the field."""

from __future__ import annotations

import pytest

from splitserve.contracts.config import ConfigError, read_yaml
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan

pytestmark = pytest.mark.unit

CONFIG = "configs/mocker_agg_inproc.yaml"


def plan(graph: str, *overrides: str, source: str = CONFIG):
    return build_plan(load_graph(graph), graph, read_yaml(source), source, list(overrides))


def test_the_shipped_config_routes_in_process_without_a_router():
    p = plan("graphs.agg:Frontend")
    assert [c.name for c in p.components] == ["Worker", "Frontend"]
    fe = p.component("Frontend").config
    assert fe.routing == "in_process" and fe.router_settings().policy == "kv_aware"


def test_the_disaggregated_config_routes_to_decode_workers_in_process():
    p = plan("graphs.disagg_inproc:Frontend", source="configs/mocker_disagg_inproc.yaml")
    assert [c.name for c in p.components] == ["PrefillWorker", "DecodeWorker", "Frontend"]
    assert p.component("Frontend").links == ["DecodeWorker"]
    with pytest.raises(ConfigError) as err:
        plan("graphs.disagg_inproc:Frontend", "--Frontend.router.block_size=8",
             source="configs/mocker_disagg_inproc.yaml")
    assert any(e.startswith("Frontend.router.block_size: 8 differs from DecodeWorker.")
               for e in err.value.errors), err.value.errors


def test_several_frontend_replicas_are_allowed():
    assert plan("graphs.agg:Frontend", "--Frontend.replicas=2").component(
        "Frontend").config.replicas == 2


def test_routing_defaults_to_the_router_and_in_process_to_router_defaults():
    p = plan("graphs.agg:Frontend", source="configs/agg.yaml")
    fe = p.component("Frontend").config
    assert fe.routing == "router" and fe.router is None
    p = plan("graphs.agg:Frontend", "--Frontend.routing=in_process", source="configs/agg.yaml")
    assert p.component("Frontend").config.router_settings().block_size == 16


@pytest.mark.parametrize("graph, overrides, error", [
    ("graphs.agg_router:Frontend", (), "Frontend.routing: in_process routes inside"),
    ("graphs.agg:Frontend", ("--Frontend.routing=router",),
     "Frontend.router: only read with routing: in_process"),
    ("graphs.agg:Frontend", ("--Frontend.router.metrics_port=9100",),
     "Frontend.router.metrics_port: not used in process"),
    ("graphs.agg:Frontend", ("--Frontend.router.policy=no_such_policy.yaml",),
     "Frontend.router.policy: 'no_such_policy.yaml' is not a built-in policy"),
    ("graphs.agg:Frontend", ("--Frontend.router.block_size=32",),
     "Frontend.router.block_size: 32 differs from Worker.engine_args.block_size 16"),
    ("graphs.agg:Frontend", ("--Frontend.router.worker_component=DecodeWorker",),
     "Frontend.router.worker_component: 'DecodeWorker' is not a component of this graph"),
    ("graphs.agg:Frontend", ("--Frontend.routing=sideways",),
     "Frontend.routing: Input should be 'router' or 'in_process'"),
])
def test_what_cannot_work_is_a_config_error_naming_file_and_field(graph, overrides, error):
    with pytest.raises(ConfigError) as err:
        plan(graph, *overrides)
    assert err.value.source == CONFIG
    assert any(e.startswith(error) for e in err.value.errors), err.value.errors
