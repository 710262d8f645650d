"""Deploy files parse, and every metric they query is one this project documents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bsplitserve_[a-z_]+")


def documented() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    text += (ROOT / "docs" / "kv_tiers.md").read_text()  # the KV tiers' own metrics
    names = set(METRIC.findall(text))
    # `a` / `_total` shorthand in the table: splitserve_worker_kv_blocks_used / `_total`
    names.add("splitserve_worker_kv_blocks_total")
    return names


def base(name: str) -> str:
    return re.sub(r"_(bucket|count|sum)$", "", name)


def test_kubernetes_manifests_parse_and_name_the_graph_components():
    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/disagg_router.yaml").read_text()))
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"frontend", "router", "decode-worker", "prefill-worker"}
    for d in deployments.values():
        cmd = d["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[:2] == ["python", "-m"] and cmd[2].startswith("splitserve.components.")


@pytest.mark.parametrize("name,config", [("sglang_disagg", "sglang_disagg"),
                                         ("trtllm_disagg", "trtllm_disagg"),
                                         ("vllm_disagg", "vllm_disagg_gpu")])
def test_gpu_engine_manifests(name, config):
    docs = list(yaml.safe_load_all((ROOT / f"deploy/kubernetes/{name}.yaml").read_text()))
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"frontend", "router", "decode-worker", "prefill-worker"}
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet"} == {"etcd", "nats"}
    front = deployments["frontend"]["spec"]["template"]["spec"]["containers"][0]
    assert front["readinessProbe"]["httpGet"]["path"] == "/ready"
    for worker in ("decode-worker", "prefill-worker"):
        c = deployments[worker]["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["command"][:3] == ["python", "-m", (f"splitserve.components.worker."
                                    f"{worker.removesuffix('-worker')}_main")]
        env = {e["name"] for e in c["env"]}
        assert {"ETCD_ENDPOINTS", "NATS_SERVER"} <= env
    assert f"configs/{config}.yaml" in (ROOT / f"deploy/kubernetes/{name}.yaml").read_text()
    text = (ROOT / "configs" / f"{config}.yaml").read_text()
    assert "engine: " + name.split("_")[0] in text


def test_prometheus_rules_and_dashboard_use_documented_metrics():
    known = documented()
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((ROOT / "deploy/grafana/dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {base(m) for e in exprs for m in METRIC.findall(e)} - {"splitserve"}
    unknown = sorted(m for m in used if m not in known)
    assert unknown == [], unknown


@pytest.mark.parametrize("name,config", [("disagg_router", "disagg_router"),
                                         ("sglang_disagg", "sglang_disagg"),
                                         ("trtllm_disagg", "trtllm_disagg"),
                                         ("vllm_disagg", "vllm_disagg_gpu")])
def test_worker_pods_get_their_whole_drain_before_kubernetes_kills_them(name, config):
    """A worker pod's grace period covers its drain, the hand-back after the cut and the
    time it keeps parked KV for live moves; a shorter one would SIGKILL streams the drain
    was about to finish or hand back."""
    from splitserve.contracts.kit.component import DRAIN_CUT_GRACE_S

    docs = list(yaml.safe_load_all((ROOT / f"deploy/kubernetes/{name}.yaml").read_text()))
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    sections = yaml.safe_load((ROOT / "configs" / f"{config}.yaml").read_text())
    for worker, section in (("decode-worker", "DecodeWorker"),
                            ("prefill-worker", "PrefillWorker")):
        cfg = sections[section]
        need = (cfg.get("drain_timeout_s", 30.0) + DRAIN_CUT_GRACE_S
                + (cfg.get("kv_move_hold_s", 15.0) if cfg.get("kv_moves") else 0.0))
        grace = deployments[worker]["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"]
        assert grace >= need + 10, (worker, grace, need)
    # the frontend leaves the Service before SIGTERM, then finishes its streams
    front = deployments["frontend"]["spec"]["template"]["spec"]
    pre = front["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    stop = sections["Common"].get("shutdown_timeout_s", 20.0)
    assert pre[0] == "sleep" and front["terminationGracePeriodSeconds"] > int(pre[1]) + stop


def pool_series() -> set[str]:
    """The histograms labelled by pool and model that the workers register."""
    from prometheus_client import CollectorRegistry

    from splitserve.components.worker.disagg_metrics import PrefillMetrics
    from splitserve.components.worker.latency_metrics import TokenLatency

    registry = CollectorRegistry()
    TokenLatency(registry, "DecodeWorker", "m")
    PrefillMetrics(registry, "PrefillWorker", "m")
    return {m.name for m in registry.collect()
            if m.type == "histogram" and {"pool", "model"} <= {
                k for s in m.samples for k in s.labels}}


def test_latency_by_pool_is_on_the_dashboard_and_recorded_for_every_series():
    series = pool_series()
    assert len(series) == 5 and series <= documented()
    dash = json.loads((ROOT / "deploy/grafana/dashboard.json").read_text())
    panels = dash["panels"]
    row = next(i for i, p in enumerate(panels) if p["title"] == "Latency by pool")
    mine = panels[row + 1:]
    mine = mine[:next((i for i, p in enumerate(mine) if p["type"] == "row"), len(mine))]
    exprs = [t["expr"] for p in mine for t in p["targets"]]
    assert {base(m) for e in exprs for m in METRIC.findall(e)} == series | {
        "splitserve_frontend_ttft_seconds"}
    for e in exprs:
        by = "(model, le)" if "frontend" in e else "(pool, model, le)"
        assert e.startswith("histogram_quantile(") and f"sum by {by}" in e, e
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules.yaml").read_text())
    group = next(g for g in rules["groups"] if g["name"] == "splitserve.latency_by_pool")
    recorded = {}
    for r in group["rules"]:
        assert "sum by (pool, model, le)" in r["expr"], r
        (metric,) = {base(m) for m in METRIC.findall(r["expr"])}
        recorded.setdefault(metric, set()).add(r["record"].rsplit(":", 1)[1])
    assert recorded == {s: {"p50_5m", "p95_5m", "p99_5m"} for s in series}


@pytest.mark.parametrize("engine", ["cpu", "vllm", "sglang", "trtllm"])
def test_each_container_recipe_installs_an_extra_and_the_pins_setup_uses(engine):
    """The images install what the setup installs: an extra pyproject.toml declares, and
    the packages that go in without their dependencies at the setup's exact pins."""
    import tomllib

    recipe = (ROOT / "deploy" / "docker" / f"Dockerfile.{engine}").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = re.findall(r'"\.\[(\w+)\]"', recipe)
    assert named and all(e in extras for e in named), (engine, named)
    setup_pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', (ROOT / "scripts" / "setup.sh")
                                 .read_text()))
    for name, version in re.findall(r'"([\w-]+)==([\w.]+)"', recipe):
        if name in setup_pins:
            assert setup_pins[name] == version, (engine, name, version)
    assert (ROOT / "deploy" / "docker" / f"Dockerfile.{engine}.dockerignore").exists()
