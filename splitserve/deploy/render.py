"""Kubernetes manifests from a resolved serve plan: ``render(plan, target)``.

Pure: the plan ``dynamo serve --dry-run`` prints goes in, a list of manifest dicts comes
out, nothing is read or written.  Each component runs as one Deployment whose pods start
the component's own entrypoint (``python -m <entrypoint> --config FILE``), the command
the supervisor gives each replica, with the run config it would write taken from a
ConfigMap.  A pod is one replica: Kubernetes restarts, scales and drains it, so the
supervisor has no part there.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from splitserve.contracts.kit.component import DRAIN_CUT_GRACE_S
from splitserve.deploy.infra import (
    PART_OF,
    infra_objects,
    infra_urls,
    meta,
    namespace_object,
    planner_rbac,
)
from splitserve.planner.component_config import PlannerComponentConfig
from splitserve.planner.connectors.kubernetes import deployment_name
from splitserve.serve.plan import ComponentPlan, ServePlan

CONFIG_DIR = "/etc/splitserve"
STATUS_FILE = "/tmp/splitserve-status.json"
"""Where a pod's replica reports its state; its readiness probe reads it."""
METRICS_PORT = 9090
"""A section's ``metrics_port: 0`` (a free port) in a pod: each pod has its own
address, so one fixed port serves every replica and its Service."""
HTTP_PORT = 8000
"""The frontend's ``port: 0`` in a pod."""
POD_HOST = None
"""The frontend's HTTP listener in a pod: unset, so it binds ``Common.bind_host``, the
pod's IP from ``--bind-host $(POD_IP)`` like every other listener (Dynamo's, NIXL's, the
metrics servers'); never a wildcard."""
PRESTOP_SLEEP_S = 5
"""How long a frontend pod keeps serving after Kubernetes marks it terminating, so the
Service's endpoints drop it before SIGTERM makes it refuse new requests."""
GRACE_MARGIN_S = 10.0
"""Added to every pod's computed stop time: the runtime's shutdown and the exit."""
READY_CHECK = ("import json, sys; "
               f"sys.exit(json.load(open('{STATUS_FILE}'))['state'] != 'ready')")


@dataclass(frozen=True)
class Target:
    """Where and how the graph is deployed (``dynamo deploy render``'s options)."""

    namespace: str = "splitserve"
    image: str = "splitserve:latest"
    etcd: str | None = None
    """External etcd URL; with ``nats``, no etcd or NATS is rendered."""
    nats: str | None = None
    paths: dict[str, str] = field(default_factory=dict)
    """Path prefixes as the pods see them: a model checked here under one path and
    mounted in the pods under another (``{"/data/models": "/models"}``)."""
    models_claim: str = "models"
    """PersistentVolumeClaim mounted where a config names a model directory."""


def object_name(comp: ComponentPlan) -> str:
    """Deployment (and Service, ConfigMap key) name of a component: the planner's
    Kubernetes connector's name for it, a pool's name after it (``Worker@qwen`` ->
    ``worker-qwen``)."""
    return deployment_name(comp.name.replace("@", "-"))


def config_map_name(plan: ServePlan) -> str:
    return f"splitserve-{plan.common.namespace}-config".replace("_", "-").lower()


def _relocated(value: Any, paths: dict[str, str]) -> Any:
    """``value`` with every string under a key of ``paths`` moved under its value."""
    if isinstance(value, dict):
        return {k: _relocated(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocated(v, paths) for v in value]
    if isinstance(value, str):
        for local, pod in paths.items():
            if value == local or value.startswith(local.rstrip("/") + "/"):
                return pod.rstrip("/") + value[len(local.rstrip("/")):]
    return value


def pod_section(comp: ComponentPlan, target: Target) -> dict[str, Any]:
    """The component's section as its pods run it: fixed ports where the config asks
    for free ones, the frontend's HTTP API off loopback, and a planner that scales the
    Deployments of this namespace instead of the supervisor's replicas."""
    section = comp.config.model_dump(mode="json")
    if section.get("metrics_port") == 0:
        section["metrics_port"] = METRICS_PORT
    if "host" in section and "port" in section:  # the HTTP API (the frontend)
        section["host"] = POD_HOST  # the pod's IP, as Common.bind_host
        section["port"] = section["port"] or HTTP_PORT
    if isinstance(comp.config, PlannerComponentConfig):
        section["connector"] = "kubernetes"
        section["kubernetes_namespace"] = target.namespace
    return section


def run_config(plan: ServePlan, comp: ComponentPlan, target: Target) -> dict[str, Any]:
    """The ``--config`` file of the component's pods: the supervisor's run config of
    its replica 0 with ``pod_section`` and the pods' paths."""
    run = plan.run_config(comp, 0, PurePosixPath(STATUS_FILE))
    body = run.model_dump(mode="json")
    body["config"] = pod_section(comp, target)
    for params in body["engine_params"].values():  # sets: one order, so renders compare
        params["honoured"] = sorted(params["honoured"])
    return _relocated(body, target.paths)


def gpus_of(comp: ComponentPlan) -> int:
    """GPUs one replica's engine needs: its tensor parallelism for sections that
    declare it, else the section's ``gpus_per_replica`` (0: a CPU process)."""
    cfg = comp.config
    if getattr(cfg, "needs_gpu", False):
        return max(cfg.gpus_needed_per_replica(), cfg.gpus_per_replica)
    return cfg.gpus_per_replica


def grace_period_s(plan: ServePlan, comp: ComponentPlan) -> int:
    """Seconds Kubernetes waits between SIGTERM and SIGKILL.  A worker deregisters,
    drains for ``drain_timeout_s``, hands back what is left within the drain cut and
    keeps moved-away KV for ``kv_move_hold_s`` (with ``kv_moves``); every other
    component stops within ``Common.shutdown_timeout_s``, the frontend after its
    preStop sleep."""
    cfg, common = comp.config, comp.common or plan.common
    stop = common.shutdown_timeout_s
    drain = getattr(cfg, "drain_timeout_s", None)
    if drain is not None:
        hold = cfg.kv_move_hold_s if getattr(cfg, "kv_moves", False) else 0.0
        stop = max(stop, drain + DRAIN_CUT_GRACE_S + hold)
    if comp.name == plan.root:
        stop += PRESTOP_SLEEP_S
    return math.ceil(stop + GRACE_MARGIN_S)


def _ports(comp: ComponentPlan, section: dict[str, Any]) -> dict[str, int]:
    """Named ports a pod listens on: the HTTP API, metrics, and the per-replica ports
    the section opens for its peers (an SGLang prefill engine's bootstrap server)."""
    ports: dict[str, int] = {}
    if "host" in section and "port" in section:
        ports["http"] = section["port"]
    elif section.get("metrics_port"):
        ports["metrics"] = section["metrics_port"]
    replica_ports = getattr(comp.config, "replica_ports", None)
    for key, port in (replica_ports(0) if replica_ports else {}).items():
        name = re.sub(r"_?port$", "", key).replace("_", "-")[:15] or "peer"
        ports[name] = port
    return ports


def _probes(root: bool, ports: dict[str, int]) -> dict[str, Any]:
    """The frontend's /ready and /live; other components report their state in the
    status file (ready once registered), and live while their metrics server answers."""
    if root:
        return {"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                                   "periodSeconds": 5},
                "livenessProbe": {"httpGet": {"path": "/live", "port": "http"},
                                  "periodSeconds": 10, "failureThreshold": 3}}
    probes: dict[str, Any] = {"readinessProbe": {
        "exec": {"command": ["python", "-c", READY_CHECK]}, "periodSeconds": 5}}
    if "metrics" in ports:
        probes["livenessProbe"] = {"tcpSocket": {"port": "metrics"}, "periodSeconds": 10,
                                   "failureThreshold": 6}
    return probes


def _volumes(plan: ServePlan, comp: ComponentPlan, target: Target, gpus: int
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The config, a models claim where the model is a directory, shared memory for
    GPU engines (their workers exchange tensors through /dev/shm)."""
    name = config_map_name(plan)
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": name}}]
    model = _relocated((comp.common or plan.common).model, target.paths)
    if model.startswith("/"):
        mounts.append({"name": "models", "mountPath": str(PurePosixPath(model).parent),
                       "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": target.models_claim, "readOnly": True}})
    if gpus:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    return mounts, volumes


def deployment(plan: ServePlan, comp: ComponentPlan, target: Target,
               section: dict[str, Any]) -> dict[str, Any]:
    """One component's Deployment: ``comp.replicas`` pods of its entrypoint."""
    name, root = object_name(comp), comp.name == plan.root
    etcd, nats = infra_urls(target.namespace, target.etcd, target.nats)
    labels = {"app.kubernetes.io/name": name}
    ports = _ports(comp, section)
    gpus = gpus_of(comp)
    mounts, volumes = _volumes(plan, comp, target, gpus)
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "ETCD_ENDPOINTS", "value": etcd}, {"name": "NATS_SERVER", "value": nats}]
    env += [{"name": k, "value": v} for k, v in sorted(comp.config.env.items())]
    transfer = section.get("kv_transfer") or {}
    if section.get("engine") == "vllm" and "side_channel_host" in transfer \
            and transfer["side_channel_host"] is None:
        # vLLM's NIXL handshake listener: the decode pods must reach it at this pod's
        # address (vLLM's default is "localhost"); its port is picked at start and
        # handed to the decode engines with each prefill.
        env.append({"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"})
    container: dict[str, Any] = {
        "name": name, "image": target.image,
        "command": ["python", "-m", comp.entrypoint, "--config", f"{CONFIG_DIR}/{name}.json",
                    "--bind-host", "$(POD_IP)", "--advertise-host", "$(POD_IP)"],
        "env": env,
        "ports": [{"name": p, "containerPort": n} for p, n in ports.items()],
        **_probes(root, ports),
        "volumeMounts": mounts,
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    if root:
        container["lifecycle"] = {"preStop": {"exec": {
            "command": ["sleep", str(PRESTOP_SLEEP_S)]}}}
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": grace_period_s(plan, comp),
                           "containers": [container], "volumes": volumes}
    if isinstance(comp.config, PlannerComponentConfig):
        pod["serviceAccountName"] = name
    annotations = {"prometheus.io/scrape": "true",
                   "prometheus.io/port": str(ports.get("http") or ports["metrics"])
                   } if {"http", "metrics"} & set(ports) else {}
    template_meta: dict[str, Any] = {"labels": {**PART_OF, **labels}}
    if annotations:
        template_meta["annotations"] = annotations
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": meta(name, target.namespace, labels),
            "spec": {"replicas": comp.replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": template_meta, "spec": pod}}}


def service(comp: ComponentPlan, target: Target, section: dict[str, Any]
            ) -> dict[str, Any] | None:
    """A Service for a component that listens; None for one that does not."""
    ports = _ports(comp, section)
    if not ports:
        return None
    name = object_name(comp)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, target.namespace),
            "spec": {"selector": {"app.kubernetes.io/name": name},
                     "ports": [{"name": p, "port": n, "targetPort": p}
                               for p, n in ports.items()]}}


def disruption_budget(comp: ComponentPlan, target: Target) -> dict[str, Any]:
    """At most one pod of a worker pool drained at a time by voluntary disruptions."""
    name = object_name(comp)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(name, target.namespace),
            "spec": {"maxUnavailable": 1,
                     "selector": {"matchLabels": {"app.kubernetes.io/name": name}}}}


def config_map(plan: ServePlan, target: Target) -> dict[str, Any]:
    """Every component's run config, one key per Deployment."""
    data = {f"{object_name(c)}.json": json.dumps(run_config(plan, c, target), indent=2,
                                                  sort_keys=True) + "\n"
            for c in plan.components}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {**meta(config_map_name(plan), target.namespace),
                         "annotations": {"splitserve/graph": plan.graph_ref,
                                         "splitserve/config": plan.source}},
            "data": data}


def render(plan: ServePlan, target: Target) -> list[dict[str, Any]]:
    """Every manifest of the graph, in the order ``kubectl apply`` should create them:
    namespace, etcd and NATS (unless external), the planner's RBAC, the ConfigMap, then
    per component (frontend last) its Deployment, Service and disruption budget."""
    out = [namespace_object(target.namespace)]
    if not (target.etcd and target.nats):
        out += infra_objects(target.namespace, target.image)
    for comp in plan.components:
        if isinstance(comp.config, PlannerComponentConfig):
            out += planner_rbac(object_name(comp), target.namespace)
    out.append(config_map(plan, target))
    for comp in plan.components:
        section = pod_section(comp, target)
        out.append(deployment(plan, comp, target, section))
        svc = service(comp, target, section)
        if svc is not None:
            out.append(svc)
        if getattr(comp.config, "drain_timeout_s", None) is not None:
            out.append(disruption_budget(comp, target))
    return out


def to_yaml(docs: list[dict[str, Any]], header: str) -> str:
    """The manifests as one multi-document YAML file, ``header`` as its first comment
    lines (the command that rendered it).  Multi-line strings (the ConfigMap's files)
    are written as literal blocks, and no anchors: every object reads on its own."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.dump_all(docs, Dumper=Dumper, sort_keys=False,
                                   default_flow_style=False, width=100, explicit_start=True)
