"""GPU placement per replica: the plan gives each replica its CUDA_VISIBLE_DEVICES and
ports, refuses two replicas on one device (unless allowed) and GPU engines that would all
start on the same default device; component processes take their bind and advertised
addresses from the command line (a pod's IP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from splitserve.contracts.kit.component import load_run_config
from splitserve.contracts.config import ConfigError
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan

pytestmark = pytest.mark.unit

GRAPH = "graphs.disagg:Frontend"
ROOT_DIR = Path(__file__).resolve().parents[3]
STAND_IN: list[str] = []  # --Common.model=<a tiny model>, set by the fixture below


@pytest.fixture(autouse=True)
def model_stand_in(tiny_models):
    """The GPU configs' model (/models/Llama-3.1-8B-Instruct) is not on this machine and
    the plan checks it is there: a tiny model directory stands in."""
    STAND_IN[:] = [f"--Common.model={tiny_models['llama']}"]


def plan_of(config: str, overrides: list[str] | None = None):
    path = ROOT_DIR / "configs" / config
    g = load_graph(GRAPH)
    return build_plan(g, GRAPH, yaml.safe_load(path.read_text()), str(path),
                      [*STAND_IN, *(overrides or [])], g.defined)


def errors_of(config: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as exc:
        plan_of(config, overrides)
    return "\n".join(exc.value.errors)


@pytest.mark.parametrize("config", ["trtllm_disagg.yaml", "sglang_disagg.yaml"])
def test_shipped_disagg_configs_put_prefill_and_decode_on_distinct_gpus(config):
    if config.startswith("sglang"):
        pytest.importorskip("sglang.srt.server_args")
    plan = plan_of(config, ["--PrefillWorker.replicas=2", "--PrefillWorker.devices=[1, 2]"])
    dec, pre = plan.component("DecodeWorker"), plan.component("PrefillWorker")
    assert plan.replica_env(dec, 0) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert [plan.replica_env(pre, i) for i in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "2"}]
    assert plan.replica_env(plan.component("Router"), 0) == {}
    placement = plan.to_dict()["components"]
    pre_rows = next(c for c in placement if c["name"] == "PrefillWorker")["placement"]
    if config.startswith("sglang"):
        assert [r["bootstrap_port"] for r in pre_rows] == [8998, 8999]


def test_a_device_shared_by_prefill_and_decode_is_refused_unless_allowed():
    shared = ["--PrefillWorker.devices=[0]"]
    assert "GPU 0 is given to both" in errors_of("trtllm_disagg.yaml", shared)
    plan_of("trtllm_disagg.yaml", [*shared, "--Common.allow_shared_devices=true"])


def test_gpu_engines_without_devices_are_refused_when_several_would_share_one():
    msg = errors_of("trtllm_disagg.yaml", ["--PrefillWorker.gpus_per_replica=0",
                                           "--PrefillWorker.devices=[]"])
    assert "PrefillWorker.devices" in msg and "same GPU" in msg


def test_devices_must_cover_the_replicas_and_match_tensor_parallelism():
    assert "need 2 devices" in errors_of("trtllm_disagg.yaml", ["--PrefillWorker.replicas=2"])
    assert "tensor parallelism" in errors_of(
        "trtllm_disagg.yaml", ["--PrefillWorker.gpus_per_replica=2",
                               "--PrefillWorker.devices=[1, 2]"])
    assert "CUDA_VISIBLE_DEVICES" in errors_of(
        "trtllm_disagg.yaml", ['--PrefillWorker.env={CUDA_VISIBLE_DEVICES: "3"}'])


def test_a_replica_beyond_the_device_list_sees_no_gpu():
    plan = plan_of("trtllm_disagg.yaml")
    pre = plan.component("PrefillWorker")
    assert plan.replica_env(pre, 5) == {"CUDA_VISIBLE_DEVICES": ""}


def test_dry_run_shows_devices_and_bootstrap_ports_per_replica():
    pytest.importorskip("sglang.srt.server_args")
    from splitserve.cli.main import app

    res = CliRunner().invoke(app, [
        "serve", GRAPH, "-f", "configs/sglang_disagg.yaml", "--dry-run", *STAND_IN,
        "--PrefillWorker.replicas=2", "--PrefillWorker.devices=[1, 2]"])
    assert res.exit_code == 0, res.output
    assert "replica 0: CUDA_VISIBLE_DEVICES=1 bootstrap_port=8998" in res.output
    assert "replica 1: CUDA_VISIBLE_DEVICES=2 bootstrap_port=8999" in res.output
    assert "replica 0: CUDA_VISIBLE_DEVICES=0" in res.output


def test_bind_and_advertised_host_come_from_the_command_line(tmp_path):
    plan = plan_of("trtllm_disagg.yaml")
    cfg = plan.run_config(plan.component("PrefillWorker"), 0, tmp_path / "s")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    assert load_run_config(["--config", str(path)]).common.advertised_host() == "127.0.0.1"
    run = load_run_config(["--config", str(path), "--bind-host", "10.1.2.3",
                           "--advertise-host", "10.1.2.3"])
    assert (run.common.bind_host, run.common.advertised_host()) == ("10.1.2.3", "10.1.2.3")
    with pytest.raises(ValueError, match="wildcard"):
        load_run_config(["--config", str(path), "--advertise-host", "0.0.0.0"])


def deployments(name: str) -> dict[str, dict]:
    """The manifest's Deployments by name, each as its (only) container."""
    docs = yaml.safe_load_all((ROOT_DIR / f"deploy/kubernetes/{name}.yaml").read_text())
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
            for d in docs if d.get("kind") == "Deployment"}


@pytest.mark.parametrize("name", ["disagg_router", "sglang_disagg", "trtllm_disagg",
                                  "vllm_disagg"])
def test_kubernetes_pods_bind_the_pod_ip_and_workers_advertise_it(name):
    # Every pod runs Dynamo's runtime: workers' request planes and the callers'
    # response streams must be reachable from the other pods.
    containers = deployments(name)
    assert set(containers) == {"frontend", "router", "decode-worker", "prefill-worker"}
    for pod, c in containers.items():
        cmd = c["command"]
        assert cmd[cmd.index("--bind-host") + 1] == "$(POD_IP)", pod
        if pod.endswith("worker"):
            assert cmd[cmd.index("--advertise-host") + 1] == "$(POD_IP)", pod
        env = [e["name"] for e in c["env"]]
        pod_ip = c["env"][env.index("POD_IP")]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # $(POD_IP) in a later variable is expanded only when POD_IP comes first
        later = [e["name"] for e in c["env"] if "$(POD_IP)" in e.get("value", "")]
        assert all(env.index(v) > env.index("POD_IP") for v in later), pod


def test_vllm_pods_announce_their_own_address_for_the_nixl_handshake():
    """vLLM's NIXL side channel listens on VLLM_NIXL_SIDE_CHANNEL_HOST (vLLM's default:
    "localhost"): the rendered prefill and decode pods set it to their own address; its
    port is picked at start and handed to the decode engines with each prefill."""
    plan = plan_of("vllm_disagg_gpu.yaml")
    assert plan.component("PrefillWorker").config.kv_transfer.side_channel_host is None
    pods = deployments("vllm_disagg")
    for name in ("prefill-worker", "decode-worker"):
        env = {e["name"]: e for e in pods[name]["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)", name
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in {e["name"] for e in pods["router"]["env"]}


def test_engines_sharing_a_gpu_must_fit_in_its_memory():
    pytest.importorskip("sglang.srt.server_args")
    shared = ["--PrefillWorker.devices=[0]", "--Common.allow_shared_devices=true"]
    assert "add up to more than 0.95" in errors_of("sglang_disagg.yaml", shared)
    plan_of("sglang_disagg.yaml", [*shared,
                                   "--PrefillWorker.engine_args.mem_fraction_static=0.4",
                                   "--DecodeWorker.engine_args.mem_fraction_static=0.4"])
