"""`dynamo serve --only`: part of a graph on this host, the rest on others (pure checks
and the CLI's dry run; the live graph over three hosts is tests/e2e/test_multihost.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from splitserve.cli.main import app
from splitserve.contracts.config import CommonConfig, ConfigError
from splitserve.serve.graph import load_graph
from splitserve.serve.hosts import host_checks, host_listener_env, select_components, ucx_device
from splitserve.serve.plan import load_plan

pytestmark = pytest.mark.unit

DISAGG = "graphs.disagg:Frontend"
ETCD, NATS = "http://10.0.0.1:2379", "nats://10.0.0.1:4222"


def disagg_plan():
    g = load_graph(DISAGG)
    return load_plan(g, DISAGG, None, [], g.defined)


@pytest.mark.parametrize("only, chosen", [
    (["DecodeWorker"], ["DecodeWorker"]),
    (["Frontend", "Router"], ["Router", "Frontend"]),
    ([" PrefillWorker ", ""], ["PrefillWorker"]),
])
def test_only_keeps_the_named_components_with_their_links(only, chosen):
    plan = select_components(disagg_plan(), only)
    assert [c.name for c in plan.components] == chosen == plan.only
    assert plan.component(chosen[0]).links == disagg_plan().component(chosen[0]).links


@pytest.mark.parametrize("only, says", [
    (["Decoder"], "--only: unknown component 'Decoder' of graphs.disagg:Frontend (its "
                  "components: PrefillWorker, DecodeWorker, Router, Frontend)"),
    ([" ", ""], "--only: names no component"),
])
def test_only_refuses_unknown_names_listing_the_valid_ones(only, says):
    with pytest.raises(ConfigError) as exc:
        select_components(disagg_plan(), only)
    assert says in str(exc.value)


def test_a_graph_component_name_takes_its_copy_in_every_model_pool(tiny_models):
    g = load_graph("graphs.agg_router:Frontend")
    from splitserve.serve.plan import build_plan

    raw = {"Worker": {"engine": "torch"}, "Models": {"q": {"model": str(tiny_models["qwen3"])}}}
    plan = build_plan(g, "graphs.agg_router:Frontend", raw, "cfg.yaml", known_sections=g.defined)
    assert select_components(plan, ["Worker"]).only == ["Worker", "Worker@q"]
    assert select_components(plan, ["Worker@q"]).only == ["Worker@q"]


@pytest.mark.parametrize("bind, etcd, nats, says", [
    ("10.0.0.2", None, None, "give --etcd and --nats"),
    ("10.0.0.2", ETCD, None, "give --etcd and --nats"),
    ("127.0.0.1", ETCD, NATS, "Common.bind_host: 127.0.0.1 is loopback, but etcd/NATS run "
                              "on 10.0.0.1"),
    ("127.0.0.1", "http://etcd.internal:2379", "nats://localhost:4222", "etcd.internal"),
    ("10.0.0.2", ETCD, NATS, None),
    ("127.0.0.1", "http://127.0.0.1:2379", "nats://localhost:4222", None),  # one machine
])
def test_host_checks(bind, etcd, nats, says):
    problems = host_checks(CommonConfig(bind_host=bind), etcd, nats)
    if says is None:
        assert problems == []
    else:
        assert len(problems) == 1 and says in problems[0], problems


IFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2", "fe80::1%eth0"],
          "eth1": ["192.168.1.5"]}


@pytest.mark.parametrize("host, device", [
    ("10.0.0.2", "eth0"), ("192.168.1.5", "eth1"), ("fe80::1", "eth0"), ("10.9.9.9", None)])
def test_ucx_device_is_the_interface_holding_the_bind_host(host, device):
    assert ucx_device(host, IFACES) == device


def test_replicas_get_ucx_limited_to_the_bind_hosts_interface():
    assert host_listener_env("10.0.0.2", IFACES)["UCX_NET_DEVICES"] == "eth0"
    assert host_listener_env("127.0.0.1", IFACES)["UCX_NET_DEVICES"] == "lo"
    # an address no interface holds (behind NAT): UCX keeps every device
    assert host_listener_env("10.9.9.9", IFACES)["UCX_NET_DEVICES"] == "all"
    assert host_listener_env("10.0.0.2", IFACES)["DYN_TCP_RPC_HOST"] == "10.0.0.2"


def test_this_hosts_interfaces_include_loopback():
    from splitserve.serve.hosts import local_interfaces

    assert "127.0.0.1" in local_interfaces()["lo"]


def dry_run(*args: str):
    return CliRunner().invoke(app, ["serve", DISAGG, "-f", "configs/disagg.yaml", *args,
                                    "--dry-run"], env={"ETCD_ENDPOINTS": "", "NATS_SERVER": ""})


def test_dry_run_shows_only_this_hosts_part():
    res = dry_run("--only", "DecodeWorker", "--etcd", ETCD, "--nats", NATS,
                  "--Common.bind_host=10.0.0.2", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert [c["name"] for c in plan["components"]] == ["DecodeWorker"] == plan["only"]
    text = dry_run("--only", "DecodeWorker", "--etcd", ETCD, "--nats", NATS,
                   "--Common.bind_host=10.0.0.2").output
    assert "this host runs DecodeWorker" in text
    started = [line.split()[0] for line in text.splitlines() if " python -m " in line]
    assert started == ["DecodeWorker"], text


@pytest.mark.parametrize("args, says", [
    (["--only", "Decoder", "--etcd", ETCD, "--nats", NATS], "--only: unknown component "
     "'Decoder'"),
    (["--only", "DecodeWorker"], "give --etcd and --nats"),
    (["--only", "DecodeWorker", "--etcd", ETCD, "--nats", NATS], "Common.bind_host: "
     "127.0.0.1 is loopback"),
])
def test_the_cli_refuses_a_part_that_cannot_work(args, says):
    res = dry_run(*args)
    assert res.exit_code == 2
    assert "configs/disagg.yaml" in res.output and says in " ".join(res.output.split())
