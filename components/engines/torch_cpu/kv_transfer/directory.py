"""Agent records in etcd: publish once, fetch and cache on the remote side.

The etcd adapter of the transfer layer.  Records are JSON ``AgentRecord`` models; the
NIXL metadata blob travels inside as base64.
"""

from __future__ import annotations

import logging

from splitserve.contracts.kit.etcd import etcd_client

from .errors import PeerNotFound
from .messages import AgentRecord, agent_key

log = logging.getLogger(__name__)


class AgentDirectory:
    """Reads and writes records under ``splitserve/<namespace>/kv-agents/``."""

    def __init__(self, endpoints: str, namespace: str) -> None:
        self.endpoints = endpoints
        self.namespace = namespace

    async def publish(self, record: AgentRecord) -> None:
        """Called once when an agent starts."""
        async with etcd_client(self.endpoints) as c:
            await c.put(agent_key(self.namespace, record.name).encode(),
                        record.model_dump_json().encode())

    async def remove(self, name: str, instance_id: str) -> None:
        """Called when an agent closes; leaves a newer instance's record alone."""
        key = agent_key(self.namespace, name).encode()
        async with etcd_client(self.endpoints) as c:
            got = await c.get(key)
            if got is not None and AgentRecord.model_validate_json(got.value).instance_id \
                    == instance_id:
                await c.delete(key)

    async def fetch(self, name: str) -> AgentRecord:
        """The current record of ``name``; raises PeerNotFound when there is none."""
        async with etcd_client(self.endpoints) as c:
            got = await c.get(agent_key(self.namespace, name).encode())
        if got is None:
            raise PeerNotFound(f"no KV agent {name!r} in namespace {self.namespace!r}")
        return AgentRecord.model_validate_json(got.value)


class MetadataCache:
    """Peer records fetched on first use and kept until a transfer to the peer fails."""

    def __init__(self, directory: AgentDirectory) -> None:
        self._directory = directory
        self._records: dict[str, AgentRecord] = {}

    async def get(self, name: str) -> tuple[AgentRecord, bool]:
        """(record, fetched_now): from the cache, else from etcd."""
        rec = self._records.get(name)
        if rec is not None:
            return rec, False
        rec = await self._directory.fetch(name)
        self._records[name] = rec
        return rec, True

    def cached(self, name: str) -> AgentRecord | None:
        return self._records.get(name)

    def invalidate(self, name: str) -> None:
        """Called when a transfer to ``name`` failed: the next get() re-fetches."""
        self._records.pop(name, None)
