"""The LoRA adapters this frontend serves, as etcd says (``contracts/kit/loras.py``).

One ``LoraView`` per Dynamo namespace the frontend serves (the first model's, each
``Models`` pool's), kept current by ``follow_prefix``.  An adapter is served under its
own model name on its base model's lane once a worker reports it loaded; the lane is
its base model's (tokenizer, chat template, workers) with ``lora`` set, so requests go
to the same workers with ``extra_args.splitserve.lora``.

``AdapterStore`` writes the records (``EtcdAdapterStore``; a dict in tests): only the
authenticated management endpoints (``lora_api.py``) call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from splitserve.contracts.kit.loras import LoraKeys, LoraRecord, LoraView, follow_prefix

log = logging.getLogger("splitserve.frontend.loras")


class AdapterStore(Protocol):
    """Writes adapter records; raises on an etcd failure."""

    async def put(self, namespace: str, name: str, record: LoraRecord) -> None: ...

    async def delete(self, namespace: str, name: str) -> None: ...


class EtcdAdapterStore:
    """``AdapterStore`` on the graph's etcd (one short connection per write)."""

    def __init__(self, endpoints: str) -> None:
        self.endpoints = endpoints

    async def put(self, namespace: str, name: str, record: LoraRecord) -> None:
        from splitserve.contracts.kit.etcd import etcd_client

        async with etcd_client(self.endpoints) as client:
            await client.put(LoraKeys(namespace).adapter(name).encode(),
                             record.model_dump_json().encode())

    async def delete(self, namespace: str, name: str) -> None:
        from splitserve.contracts.kit.etcd import etcd_client

        async with etcd_client(self.endpoints) as client:
            await client.delete(LoraKeys(namespace).adapter(name).encode())


class AdapterCatalog:
    """Every adapter of the namespaces this frontend serves: records and statuses."""

    def __init__(self) -> None:
        self.views: dict[str, LoraView] = {}
        self.tasks: list[asyncio.Task] = []

    def update(self, namespace: str, view: LoraView) -> None:
        """Called with a namespace's whole view after every change in etcd."""
        self.views[namespace] = view

    def find(self, name: str) -> tuple[str, LoraRecord] | None:
        """(namespace, record) of adapter ``name``, or None."""
        for namespace, view in self.views.items():
            record = view.adapters.get(name)
            if record is not None:
                return namespace, record
        return None

    def view(self, namespace: str) -> LoraView:
        return self.views.get(namespace) or LoraView()

    def loaded_on(self, namespace: str, name: str) -> set[int]:
        """Workers of ``namespace`` that report ``name`` loaded."""
        return self.view(namespace).loaded_on(name)

    def holders(self, namespace: str) -> Callable[[str], set[int]]:
        """``loaded_on`` for one namespace (a ``DirectBackend``'s ``adapter_workers``)."""
        return lambda name: self.loaded_on(namespace, name)

    def entries(self) -> list[tuple[str, str, LoraRecord]]:
        """(namespace, name, record) of every adapter, by name."""
        return sorted(((ns, name, rec) for ns, view in self.views.items()
                       for name, rec in view.adapters.items()), key=lambda e: e[1])

    def follow(self, endpoints: str, namespace: str) -> asyncio.Event:
        """Start following ``namespace``'s adapters in etcd; returns an event set after
        the first read (or the first failure to reach etcd)."""
        from splitserve.contracts.kit.etcd import etcd_client

        keys = LoraKeys(namespace)
        first = asyncio.Event()

        def on_items(items: dict[str, bytes]) -> None:
            self.update(namespace, LoraView.from_items(keys, items))

        self.tasks.append(asyncio.create_task(follow_prefix(
            lambda: etcd_client(endpoints), keys.root, on_items, first=first),
            name=f"loras-{namespace}"))
        return first

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
