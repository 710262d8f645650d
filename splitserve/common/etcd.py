"""The one place that opens etcd connections (aetcd, asyncio).

Why aetcd: it speaks etcd's v3 gRPC API with current protobuf; the older `etcd3` client
fails at import with protobuf >= 4 unless pure-Python protobuf is forced.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlparse

import aetcd


def parse_endpoint(endpoints: str) -> tuple[str, int]:
    """First ``host:port`` of an ETCD_ENDPOINTS value like ``http://127.0.0.1:2379,...``."""
    first = endpoints.split(",")[0].strip()
    if "://" not in first:
        first = "http://" + first
    u = urlparse(first)
    return u.hostname or "127.0.0.1", u.port or 2379


@contextlib.asynccontextmanager
async def etcd_client(endpoints: str, timeout_s: int = 5) -> AsyncIterator[aetcd.Client]:
    """An aetcd client for the first endpoint, closed on exit."""
    host, port = parse_endpoint(endpoints)
    client = aetcd.Client(host=host, port=port, timeout=timeout_s)
    try:
        yield client
    finally:
        await client.close()


async def get_prefix(endpoints: str, prefix: str) -> list[tuple[str, bytes]]:
    """All (key, value) pairs under ``prefix``."""
    async with etcd_client(endpoints) as c:
        res = await (c.get_prefix(prefix.encode()) if prefix else c.get_all())
        return [(kv.key.decode(), kv.value) for kv in res]
