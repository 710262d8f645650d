"""`dynamo deploy render`: every config's manifests pass the Kubernetes API schema, carry
the plan's replicas, ports, probes, GPUs and stop times, and the checked-in manifests of
deploy/kubernetes/ are exactly what the renderer writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from splitserve.contracts.kit.component import DRAIN_CUT_GRACE_S
from splitserve.deploy.render import Target, object_name, render, to_yaml
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import ServePlan, build_plan

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
K8S_VERSION = kubernetes_validate.latest_version()
MODEL_MOUNT = "/models"
CHECKED_IN = {"disagg_router": "disagg_router", "sglang_disagg": "sglang_disagg",
              "trtllm_disagg": "trtllm_disagg", "vllm_disagg": "vllm_disagg_gpu"}
"""deploy/kubernetes/<file>.yaml -> the config it is rendered from."""


def graph_of(text: str) -> str:
    """The graph a config is served with, from its `dynamo serve GRAPH -f` line."""
    found = re.search(r"dynamo serve (\S+) -f", text)
    assert found, "every config names its graph in a `dynamo serve GRAPH -f` comment"
    return found.group(1)


def header(graph: str, name: str, text: str) -> str:
    command = f"dynamo deploy render {graph} -f configs/{name}.yaml"
    lines = [f"Rendered by: {command}", "Do not edit: render again from the config."]
    if f"{MODEL_MOUNT}/" in text:
        lines.insert(1, f"(where the model sits at the pods' path, {MODEL_MOUNT}/...)")
    return "\n".join(lines)


def planned(name: str, stand_ins: Path) -> tuple[ServePlan, Target, str]:
    """The plan of configs/<name>.yaml, its target and the file's header.  A model the
    config names under /models (the pods' mount) is checked against an empty stand-in
    directory here and rendered back under /models, as `--pod-path` does."""
    text = (ROOT / "configs" / f"{name}.yaml").read_text()
    paths = {}
    if f"{MODEL_MOUNT}/" in text:
        for model in set(re.findall(rf"{MODEL_MOUNT}/[\w.\-]+", text)):
            here = stand_ins / model.lstrip("/")
            here.mkdir(parents=True, exist_ok=True)
            (here / "config.json").write_text("{}")
        paths = {str(stand_ins / MODEL_MOUNT.lstrip("/")): MODEL_MOUNT}
        text = text.replace(f"{MODEL_MOUNT}/", f"{stand_ins}{MODEL_MOUNT}/")
    graph = graph_of(text)
    g = load_graph(graph)
    plan = build_plan(g, graph, yaml.safe_load(text), f"configs/{name}.yaml", [], g.defined)
    return plan, Target(paths=paths), header(graph, name, text)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stand-ins")


def by_kind(docs: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return out


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_manifest_passes_the_kubernetes_schema(name, stand_ins):
    plan, target, _ = planned(name, stand_ins)
    docs = render(plan, target)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = by_kind(docs)
    assert set(kinds["StatefulSet"]) == {"etcd", "nats"}
    for comp in plan.components:
        dep = kinds["Deployment"][object_name(comp)]
        assert dep["spec"]["replicas"] == comp.replicas
        cmd = container(dep)["command"]
        assert cmd[:3] == ["python", "-m", comp.entrypoint]
        # every Dynamo listener, NIXL and the metrics server on the pod's own address
        assert cmd[cmd.index("--bind-host") + 1] == "$(POD_IP)"
        assert cmd[cmd.index("--advertise-host") + 1] == "$(POD_IP)"


@pytest.mark.parametrize("name", CONFIGS)
def test_no_listener_stays_on_loopback_in_a_pod(name, stand_ins):
    plan, target, _ = planned(name, stand_ins)
    kinds = by_kind(render(plan, target))
    for key, text in kinds["ConfigMap"][next(iter(kinds["ConfigMap"]))]["data"].items():
        run = json.loads(text)
        if "host" in run["config"]:  # the frontend: unset, so it binds --bind-host's IP
            assert run["config"]["host"] is None, key
        assert run["config"].get("metrics_port") != 0, (key, "a pod needs a known port")
    for dep in kinds["Deployment"].values():
        env = {e["name"]: e for e in container(dep)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("name", CONFIGS)
def test_probes_ports_grace_and_budgets(name, stand_ins):
    plan, target, _ = planned(name, stand_ins)
    kinds = by_kind(render(plan, target))
    front = kinds["Deployment"][object_name(plan.component(plan.root))]
    c = container(front)
    port = plan.component(plan.root).config.port or 8000
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert {"name": "http", "containerPort": port} in c["ports"]
    assert kinds["Service"][front["metadata"]["name"]]["spec"]["ports"][0]["port"] == port
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    spec = front["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > sleep + plan.common.shutdown_timeout_s
    for comp in plan.components:
        drain = getattr(comp.config, "drain_timeout_s", None)
        if drain is None:
            continue
        hold = comp.config.kv_move_hold_s if getattr(comp.config, "kv_moves", False) else 0
        dep = kinds["Deployment"][object_name(comp)]
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain + DRAIN_CUT_GRACE_S + hold + 10, (comp.name, grace)
        assert "exec" in container(dep)["readinessProbe"]
        assert kinds["PodDisruptionBudget"][object_name(comp)]["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("name", CONFIGS)
def test_planner_rbac_exactly_with_a_planner(name, stand_ins):
    plan, target, _ = planned(name, stand_ins)
    kinds = by_kind(render(plan, target))
    planners = [c for c in plan.components if c.component == "Planner"]
    assert bool(planners) == ("Role" in kinds) == ("RoleBinding" in kinds)
    for comp in planners:
        name = object_name(comp)
        spec = kinds["Deployment"][name]["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == name
        role = kinds["Role"][name]
        assert any("deployments/scale" in r["resources"] and "patch" in r["verbs"]
                   for r in role["rules"])
        run = json.loads(next(iter(kinds["ConfigMap"].values()))["data"][f"{name}.json"])
        assert run["config"]["connector"] == "kubernetes"


@pytest.mark.parametrize("name,gpus", [("vllm_disagg_gpu", 1), ("sglang_disagg", 1),
                                       ("trtllm_disagg", 1), ("disagg_router", 0),
                                       ("vllm_disagg", 0)])
def test_gpu_counts_follow_the_engine_placement(name, gpus, stand_ins):
    plan, target, _ = planned(name, stand_ins)
    kinds = by_kind(render(plan, target))
    for worker in ("decode-worker", "prefill-worker"):
        c = container(kinds["Deployment"][worker])
        assert c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0) == gpus
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert ("/dev/shm" in mounts) == bool(gpus)
    for other in ("frontend", "router"):
        assert "resources" not in container(kinds["Deployment"][other])


def test_external_etcd_and_nats_replace_the_in_cluster_servers(stand_ins):
    plan, _, _ = planned("disagg_router", stand_ins)
    target = Target(namespace="llm", etcd="http://etcd.infra:2379", nats="nats://nats.infra:4222")
    kinds = by_kind(render(plan, target))
    assert "StatefulSet" not in kinds
    for dep in kinds["Deployment"].values():
        assert dep["metadata"]["namespace"] == "llm"
        env = {e["name"]: e.get("value") for e in container(dep)["env"]}
        assert env["ETCD_ENDPOINTS"] == "http://etcd.infra:2379"
        assert env["NATS_SERVER"] == "nats://nats.infra:4222"


@pytest.mark.parametrize("file,config", sorted(CHECKED_IN.items()))
def test_checked_in_manifests_are_the_renderers_output(file, config, stand_ins):
    plan, target, head = planned(config, stand_ins)
    want = to_yaml(render(plan, target), head)
    have = (ROOT / "deploy" / "kubernetes" / f"{file}.yaml").read_text()
    assert have == want, (f"deploy/kubernetes/{file}.yaml differs from the renderer's output "
                          f"for configs/{config}.yaml: render it again")
