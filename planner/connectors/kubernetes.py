"""Scales pools on Kubernetes by patching the scale subresource of their Deployments.

Each component of the graph runs as a Deployment named after it (``PrefillWorker`` ->
``prefill-worker``, optionally prefixed with the graph's name).  The planner patches
``/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` through the official client's
``AppsV1Api.patch_namespaced_deployment_scale``.  That client sends the first patch type
the API lists, ``application/json-patch+json``, so the body is a JSON Patch; ``add`` (not
``replace``) because a Scale with zero replicas omits ``spec.replicas`` entirely.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

from .base import DEFAULT_COMPONENTS, ReplicaConnector


def deployment_name(component: str, prefix: str = "") -> str:
    """The Deployment of a component: kebab-case (DNS-1123), ``prefix-`` in front if set."""
    kebab = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", component).replace("_", "-").lower()
    return f"{prefix}-{kebab}" if prefix else kebab


def scale_patch(replicas: int) -> list[dict[str, Any]]:
    """The JSON Patch that sets a scale subresource to ``replicas``."""
    return [{"op": "add", "path": "/spec/replicas", "value": replicas}]


class KubernetesConnector(ReplicaConnector):
    """Sets replicas of the prefill and decode Deployments in one namespace.

    ``api`` is an ``AppsV1Api``; ``from_environment`` builds one from the in-cluster
    service account or the user's kubeconfig.  The client is synchronous, so each call
    runs in a worker thread to keep the planner's event loop free.
    """

    def __init__(self, api: Any, namespace: str, components: Mapping[str, str] =
                 DEFAULT_COMPONENTS, prefix: str = "",
                 deployments: Mapping[str, str] | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self.deployments = dict(deployments or {pool: deployment_name(comp, prefix)
                                                for pool, comp in components.items()})

    @classmethod
    def from_environment(cls, namespace: str, **kwargs: Any) -> KubernetesConnector:
        """Load cluster credentials (in-cluster first, then kubeconfig) and connect.

        Called by the CLI or the planner component at start-up, never by the core.
        """
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.AppsV1Api(), namespace, **kwargs)

    async def set_replicas(self, pool: str, replicas: int) -> str:
        name = self.deployments[pool]
        scale = await asyncio.to_thread(self.api.patch_namespaced_deployment_scale, name,
                                        self.namespace, scale_patch(replicas))
        return f"deployment/{name}: spec.replicas={scale.spec.replicas}"

    async def replicas(self, pool: str) -> int:
        """Replicas the Deployment of ``pool`` runs now (its scale's status)."""
        name = self.deployments[pool]
        scale = await asyncio.to_thread(self.api.read_namespaced_deployment_scale, name,
                                        self.namespace)
        return int(scale.status.replicas or 0)
