"""The one place that opens etcd connections (aetcd, asyncio).

Why aetcd: it speaks etcd's v3 gRPC API with current protobuf; the older `etcd3` client
fails at import with protobuf >= 4 unless pure-Python protobuf is forced.  aetcd knows
user/password authentication but only plaintext channels; ``_TlsClient`` adds TLS.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import aetcd
import grpc
from aetcd import rpc

from splitserve.contracts.kit.connect import EtcdAccess


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel (server CA and optional client certificate)."""

    def __init__(self, *args, credentials: grpc.ChannelCredentials, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        plain = rpc.insecure_channel

        def secure(target, options=()):
            rpc.insecure_channel = plain
            return rpc.secure_channel(target, self._credentials, options=options)

        # aetcd builds its channel synchronously at the start of connect(): swap in a
        # secure one for that one call (restored as soon as it is made).
        rpc.insecure_channel = secure
        try:
            await super().connect()
        finally:
            rpc.insecure_channel = plain


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def make_client(access: EtcdAccess, timeout_s: int = 5) -> aetcd.Client:
    """An unconnected aetcd client for ``access`` (credentials and TLS applied)."""
    host, port = access.first_host_port()
    kwargs = {"host": host, "port": port, "timeout": timeout_s, "username": access.username,
              "password": access.password}
    if access.secure:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(access.tls.ca),
                                             private_key=_read(access.tls.key),
                                             certificate_chain=_read(access.tls.cert))
        return _TlsClient(credentials=creds, **kwargs)
    return aetcd.Client(**kwargs)


@contextlib.asynccontextmanager
async def etcd_client(endpoints: str, timeout_s: int = 5) -> AsyncIterator[aetcd.Client]:
    """An aetcd client for the first endpoint, closed on exit.

    Credentials and TLS files come from the URL or from the ``ETCD_AUTH_*`` variables
    (the ones Dynamo's runtime reads, set by the supervisor or by the operator).
    """
    client = make_client(EtcdAccess.from_env(os.environ, endpoints), timeout_s)
    try:
        yield client
    finally:
        await client.close()


async def get_prefix(endpoints: str, prefix: str) -> list[tuple[str, bytes]]:
    """All (key, value) pairs under ``prefix``."""
    async with etcd_client(endpoints) as c:
        res = await (c.get_prefix(prefix.encode()) if prefix else c.get_all())
        return [(kv.key.decode(), kv.value) for kv in res]
