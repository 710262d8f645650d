"""Scales pools through the local `dynamo serve` supervisor's control endpoint.

``POST {control_url}/v1/components/{name}/replicas {"replicas": N}``: the supervisor
starts replicas, or SIGTERMs the newest ones, which deregister first and drain.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from .base import DEFAULT_COMPONENTS, ReplicaConnector


class LocalConnector(ReplicaConnector):
    """Sets replicas of the graph's prefill and decode components on one supervisor."""

    def __init__(self, control_url: str, components: Mapping[str, str] = DEFAULT_COMPONENTS,
                 client: httpx.AsyncClient | None = None, timeout_s: float = 10.0,
                 token: str | None = None) -> None:
        self.control_url = control_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.components = dict(components)
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def set_replicas(self, pool: str, replicas: int) -> str:
        name = self.components[pool]
        url = f"{self.control_url}/v1/components/{name}/replicas"
        reply = await self._client.post(url, json={"replicas": replicas}, headers=self._headers)
        if reply.status_code != 200:
            raise RuntimeError(f"{name}: HTTP {reply.status_code}: {reply.text[:200]}")
        return f"{name}: {reply.json()}"

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()
