"""LoRA adapters in a real etcd (loopback): worker replicas follow the records, publish
their statuses on their leases (gone with the replica), write their static adapters,
and a replica started later loads the current set; the frontend's catalog sees it all.
The engine is the worker tests' fake, which behaves as the contract says."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from splitserve.components.frontend.loras import AdapterCatalog, EtcdAdapterStore
from splitserve.components.worker.loras import AdapterSet, follow_adapters, static_records
from splitserve.contracts.kit.etcd import etcd_client
from splitserve.contracts.kit.loras import LoraKeys, LoraRecord
from splitserve.infra.embedded import EmbeddedInfra
from tests.unit.worker.lora_engine import FakeLoraEngine, adapter_dir

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep.etcd


async def eventually(predicate, timeout_s: float = 10.0) -> None:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.02)


def replica(etcd: str, keys: LoraKeys, worker_id: int, static=None, serves=True,
            role="serve", out: list | None = None):
    engine = FakeLoraEngine(serves=serves)
    adapters = AdapterSet(engine, "Worker", role=role)
    if out is not None:
        out.append(adapters)
    task = asyncio.create_task(follow_adapters(
        adapters, keys, worker_id, lambda: etcd_client(etcd), static or {}))
    return engine, task


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_replicas_follow_the_records_and_report_on_their_leases(etcd_url, tmp_path):
    ns = f"t{uuid.uuid4().hex[:8]}"
    keys, store, catalog = LoraKeys(ns), EtcdAdapterStore(etcd_url), AdapterCatalog()
    first = catalog.follow(etcd_url, ns)
    await asyncio.wait_for(first.wait(), 10)
    static = static_records({"cfg": str(adapter_dir(tmp_path, "cfg"))}, "base")
    one, t1 = replica(etcd_url, keys, 0x1, static)
    mocker, t3 = replica(etcd_url, keys, 0x3, serves=False)
    try:
        await eventually(lambda: "cfg" in one.loras())
        sql = adapter_dir(tmp_path, "sql")
        await store.put(ns, "sql", LoraRecord(path=str(sql), base_model="base"))
        await store.put(ns, "bad", LoraRecord(path=str(tmp_path / "x"), base_model="base"))
        await eventually(lambda: catalog.loaded_on(ns, "sql") == {0x1})
        await eventually(lambda: 0x1 in catalog.view(ns).problems("bad")
                         and 0x3 in catalog.view(ns).problems("sql"))
        view = catalog.view(ns)
        assert view.adapters["cfg"].source == "config"
        assert "no adapter_config.json" in view.problems("bad")[0x1]
        assert view.problems("sql") == {0x3: "the fake engine serves no LoRA adapters"}
        # a replica started later loads the current set
        decode: list[AdapterSet] = []
        two, t2 = replica(etcd_url, keys, 0x2, out=decode)
        await eventually(lambda: catalog.loaded_on(ns, "sql") == {0x1, 0x2})
        assert set(two.loras()) == {"cfg", "sql"}
        # a prefill worker loads it too; the decode replica sees the prefill pool has it,
        # and the frontend still serves it only where requests are routed
        assert not decode[0].prefill_serves("sql", live_prefill_workers=1)
        pre, t4 = replica(etcd_url, keys, 0x4, role="prefill")
        await eventually(lambda: catalog.view(ns).loaded_on("sql", role="prefill") == {0x4})
        assert catalog.loaded_on(ns, "sql") == {0x1, 0x2} and "sql" in pre.loras()
        await eventually(lambda: decode[0].prefill_serves("sql", live_prefill_workers=1))
        await stop(t4)
        await eventually(lambda: not decode[0].prefill_serves("sql", live_prefill_workers=1))
        # unloaded: every replica lets it go and withdraws its status
        await store.delete(ns, "sql")
        await eventually(lambda: "sql" not in one.loras() and "sql" not in two.loras())
        await eventually(lambda: "sql" not in catalog.view(ns).statuses)
        # a replica that stops takes its statuses with it (its lease is revoked)
        await stop(t2)
        await eventually(lambda: catalog.loaded_on(ns, "cfg") == {0x1})
    finally:
        for task in (t1, t3):
            await stop(task)
        await catalog.close()
    async with etcd_client(etcd_url) as client:
        left = [kv.key.decode() for kv in await client.get_prefix(keys.statuses.encode())]
    assert left == []
