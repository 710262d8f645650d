"""Graph linking, resolution and pruning."""

from __future__ import annotations

import pytest

from splitserve.serve.graph import ComponentSpec, GraphError, load_graph, merge_pipelines

pytestmark = pytest.mark.unit


def spec(name, *links, rank=50):
    return ComponentSpec(name, f"mod.{name.lower()}", may_link=links, shutdown_rank=rank)


F = spec("Frontend", "Router", "Worker", rank=0)
R = spec("Router", "Worker")
W = spec("Worker", "Prefill")
P = spec("Prefill")


def test_link_does_not_mutate_specs():
    a = F.link(R).link(W)
    b = F.link(W)
    assert F.may_link == ("Router", "Worker")
    assert [(s.name, d.name) for s, d in a.edges] == [("Frontend", "Router"), ("Router", "Worker")]
    assert [(s.name, d.name) for s, d in b.edges] == [("Frontend", "Worker")]


def test_link_refuses_unknown_dependency():
    with pytest.raises(GraphError, match="Frontend cannot link Prefill; it links to: Router, Worker"):
        F.link(P)


@pytest.mark.parametrize("root, served, links_of_worker, pruned_of_worker", [
    ("Frontend", ["Frontend", "Router", "Worker"], [], ["Prefill"]),
    ("Router", ["Router", "Worker"], [], ["Prefill"]),
    ("Worker", ["Worker"], [], ["Prefill"]),
])
def test_resolution_keeps_what_is_reachable(root, served, links_of_worker, pruned_of_worker):
    g = merge_pipelines([F.link(R).link(W)], root)
    assert sorted(g.components) == sorted(served)
    assert g.links_of("Worker") == links_of_worker
    assert g.pruned_of("Worker") == pruned_of_worker
    assert g.order()[-1] == root
    assert g.order().index("Worker") < g.order().index(root) or root == "Worker"


def test_pruning_of_unlinked_edges():
    g = merge_pipelines([F.link(W)], "Frontend")
    assert g.links_of("Frontend") == ["Worker"]
    assert g.pruned_of("Frontend") == ["Router"]


def test_unknown_root():
    with pytest.raises(GraphError, match="'Nope' is not in the graph"):
        merge_pipelines([F.link(R)], "Nope")


def test_cycle_detected():
    a = spec("A", "B")
    b = spec("B", "A")
    with pytest.raises(GraphError, match="cycle"):
        merge_pipelines([a.link(b).link(a)], "A")


def test_name_clash_detected():
    other = ComponentSpec("Worker", "elsewhere")
    with pytest.raises(GraphError, match="two different components are named Worker"):
        merge_pipelines([F.link(W), R.link(other)], "Frontend")


@pytest.mark.parametrize("ref, message", [
    ("tests.fixtures.echo_graph", "must look like module:Component"),
    ("tests.fixtures.nope:X", "not found"),
    ("tests.fixtures.echo_graph:Nope", "'Nope' is not in the graph"),
])
def test_load_graph_errors(ref, message):
    with pytest.raises(GraphError, match=message):
        load_graph(ref)


def test_load_graph_module():
    g = load_graph("tests.fixtures.echo_graph:EchoFront")
    assert g.order() == ["EchoWorker", "EchoFront"]
    assert "Unused" in g.defined and "Unused" not in g.components


def test_console_filter_drops_only_per_request_span_noise():
    from splitserve.serve.supervisor import console_worthy

    noise = b"\x1b[2m..\x1b[0m INFO router.route_request: request_span: route request completed x=1\n"
    assert not console_worthy(noise, verbose=False)
    assert console_worthy(noise, verbose=True)
    assert console_worthy(b"WARN route request failed\n", verbose=False)
    assert console_worthy(b"12:00:00 INFO splitserve.router: routing\n", verbose=False)


def test_console_filter_drops_dynamos_stop_noise_only_while_the_replica_stops():
    from splitserve.serve.supervisor import console_worthy

    noise = [b"WARN dynamo_runtime::pipeline::network::egress::push_router: Instance removal "
             b"watcher stream ended; reconnecting endpoint=generate\n",
             b"WARN dynamo_llm::entrypoint::input::endpoint: Endpoint service completed "
             b"unexpectedly for endpoint: dyn://dynamo.worker.generate\n",
             b"ERROR dynamo_runtime::storage::kv: KeyValueStoreManager.watch receiver closed\n"]
    for line in noise:
        assert not console_worthy(line, verbose=False, stopping=True)
        assert console_worthy(line, verbose=False)  # while serving it may mean something
        assert console_worthy(line, verbose=True, stopping=True)
    assert console_worthy(b"ERROR splitserve.worker: drain failed\n", verbose=False, stopping=True)
