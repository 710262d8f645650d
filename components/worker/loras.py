"""A worker replica's LoRA adapters, kept in line with the records in etcd.

Every worker replica runs one ``AdapterSet``: aggregated and decode replicas (role
``serve``) and prefill workers (role ``prefill``, which compute the prompts of adapter
requests that decode workers offload).  ``follow_adapters`` writes the section's static
``loras`` to etcd, follows the namespace's adapters and statuses
(``contracts/kit/loras.py``) and hands every change of the records to
``AdapterSet.apply``, which loads and unloads through the engine (``load_lora`` /
``unload_lora`` / ``loras``) and publishes this replica's status of each adapter on its
lease.  A replica started later reads the whole set first, so it loads what the others
have.  The statuses tell a decode replica which adapters the prefill pool can compute
(``prefill_serves``): a request for any other is prefilled where it decodes.

Failures never end the replica: a load that fails (a bad path, no slot left) is reported
as ``failed`` with the engine's message, in etcd and in the load reports, and not tried
again until the record changes; an unload refused while requests use the adapter is
retried every ``RETRY_S``.  An engine without ``serves_lora`` reports every adapter as
``unsupported``, so the frontend can tell an operator at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from splitserve.contracts.engine import Engine
from splitserve.contracts.kit.loras import LoraKeys, LoraRecord, LoraStatus, LoraView, follow_prefix

log = logging.getLogger("splitserve.worker.loras")

RETRY_S = 1.0
"""How often an unload refused while the adapter had requests in flight is tried again."""
LEASE_TTL_S = 10

Publish = Callable[[str, LoraStatus | None], Awaitable[None]]
"""Write (a status) or withdraw (None) this replica's status of one adapter."""


@dataclass(frozen=True)
class Step:
    """One engine call that brings the loaded set closer to the wanted one."""

    kind: Literal["load", "unload"]
    name: str
    path: str = ""


def plan_steps(wanted: Mapping[str, str], loaded: Mapping[str, str],
               failed: Mapping[str, str]) -> list[Step]:
    """The engine calls that turn ``loaded`` (name -> path) into ``wanted``: unloads
    first (they free slots), then loads, each in name order.  An adapter whose record
    moved to another path is unloaded and loaded again; one that ``failed`` from the
    path it still has is not tried again (the record must change first)."""
    unloads = [Step("unload", n) for n in sorted(loaded) if wanted.get(n) != loaded[n]]
    loads = [Step("load", n, p) for n, p in sorted(wanted.items())
             if loaded.get(n) != p and failed.get(n) != p]
    return unloads + loads


class AdapterSet:
    """The adapters of one replica's engine; ``apply`` is called with etcd's records
    after every change (and every ``RETRY_S`` while an unload waits)."""

    def __init__(self, engine: Engine, component: str, publish: Publish | None = None,
                 role: Literal["serve", "prefill"] = "serve") -> None:
        self.engine = engine
        self.component = component
        self.role = role
        self.publish: Publish | None = publish
        self.view = LoraView()
        """The namespace's records and every replica's statuses, as last read."""
        self.records: dict[str, LoraRecord] = {}
        self.failed: dict[str, tuple[str, str]] = {}
        """name -> (path, why) of loads that failed."""
        self.reported: dict[str, LoraStatus] = {}
        """What this replica has published, by adapter (republished on a new lease)."""
        self.busy: set[str] = set()
        """Adapters whose unload was refused while requests used them."""
        self._lock = asyncio.Lock()

    @property
    def serves(self) -> bool:
        return self.engine.info.capabilities.serves_lora

    def loaded(self) -> list[str]:
        """The adapters loaded now (for load reports)."""
        return sorted(self.engine.loras()) if self.serves else []

    def prefill_serves(self, name: str, live_prefill_workers: int) -> bool:
        """True when every live prefill worker (``live_prefill_workers`` of them, at
        least one) reports adapter ``name`` loaded from its current path and none reports
        a problem with it: only then may a job for it go to the shared prefill queue,
        which any of them may pull."""
        loaded = self.view.loaded_on(name, role="prefill")
        return (live_prefill_workers > 0 and len(loaded) >= live_prefill_workers
                and not self.view.problems(name, role="prefill"))

    def errors(self) -> dict[str, str]:
        """Adapters that could not be loaded (or served), and why (for load reports)."""
        out = {n: why for n, (_, why) in self.failed.items()}
        out.update({n: s.error for n, s in self.reported.items() if s.state == "unsupported"})
        return out

    async def apply(self, records: Mapping[str, LoraRecord]) -> None:
        """Load and unload until the engine holds ``records``; never raises for one
        adapter's failure (it is reported instead)."""
        async with self._lock:
            self.records = dict(records)
            if not self.serves:
                await self._unsupported()
                return
            wanted = {n: r.path for n, r in self.records.items()}
            for name in [n for n, (p, _) in self.failed.items() if wanted.get(n) != p]:
                del self.failed[name]
                if name not in wanted:
                    await self._report(name, None)
            refused: set[str] = set()
            failed = {n: p for n, (p, _) in self.failed.items()}
            for step in plan_steps(wanted, self.engine.loras(), failed):
                if step.kind == "unload":
                    if not await self._unload(step.name, step.name in wanted):
                        refused.add(step.name)
                elif step.name not in refused:  # its old path is still loaded
                    await self._load(step.name, step.path)

    async def retry(self) -> None:
        """Try the unloads that were refused again (called every ``RETRY_S``)."""
        if self.busy:
            await self.apply(self.records)

    async def republish(self) -> None:
        """Publish every status again (a new lease: the old statuses expired with it)."""
        for name, status in list(self.reported.items()):
            await self._report(name, status)

    def _status(self, state: str, path: str, error: str = "") -> LoraStatus:
        return LoraStatus(state=state, path=path, error=error, component=self.component,
                          engine=self.engine.info.name, role=self.role)

    async def _unsupported(self) -> None:
        why = f"the {self.engine.info.name} engine serves no LoRA adapters"
        for name, record in self.records.items():
            status = self._status("unsupported", record.path, why)
            if self.reported.get(name) != status:
                await self._report(name, status)
        for name in [n for n in self.reported if n not in self.records]:
            await self._report(name, None)

    async def _unload(self, name: str, reloading: bool) -> bool:
        try:
            await self.engine.unload_lora(name)
        except KeyError:
            pass  # already gone
        except ValueError as exc:  # requests still use it: try again later
            if name not in self.busy:
                log.info("adapter %s: unload waits (%s)", name, exc)
            self.busy.add(name)
            return False
        self.busy.discard(name)
        log.info("adapter %s unloaded", name)
        if not reloading:
            await self._report(name, None)
        return True

    async def _load(self, name: str, path: str) -> None:
        try:
            await self.engine.load_lora(name, path)
        except Exception as exc:  # noqa: BLE001 - reported; the replica serves on
            why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
            log.warning("adapter %s from %s could not be loaded: %s", name, path, why)
            self.failed[name] = (path, why)
            await self._report(name, self._status("failed", path, why))
            return
        self.failed.pop(name, None)
        log.info("adapter %s loaded from %s", name, path)
        await self._report(name, self._status("loaded", path))

    async def _report(self, name: str, status: LoraStatus | None) -> None:
        if status is None:
            self.reported.pop(name, None)
        else:
            self.reported[name] = status
        if self.publish is None:
            return
        try:
            await self.publish(name, status)
        except Exception as exc:  # noqa: BLE001 - republished on the next session
            log.warning("adapter %s: status not published (%s)", name, exc)


def static_records(loras: Mapping[str, str], base_model: str) -> dict[str, LoraRecord]:
    """The records of a section's ``loras`` (source ``config``)."""
    return {name: LoraRecord(path=path, base_model=base_model, source="config")
            for name, path in loras.items()}


async def follow_adapters(adapters: AdapterSet, keys: LoraKeys, worker_id: int,
                          connect: Callable[[], contextlib.AbstractAsyncContextManager],
                          static: Mapping[str, LoraRecord] = {},  # noqa: B006 - never mutated
                          first: asyncio.Event | None = None) -> None:
    """Keep ``adapters`` in line with etcd until cancelled (a task of the shell).

    Each etcd session: a lease for this replica's statuses, the static records written
    (config wins over a record of the same name), every status published again, then the
    prefix read and watched (``follow_prefix``, which reconnects): ``adapters.view`` is
    kept current with every change, and ``apply`` called when the records change."""

    @contextlib.asynccontextmanager
    async def session() -> AsyncIterator:
        async with connect() as client:
            lease = await client.lease(LEASE_TTL_S)

            async def publish(name: str, status: LoraStatus | None) -> None:
                key = keys.status(name, worker_id).encode()
                if status is None:
                    await client.delete(key)
                else:
                    await client.put(key, status.model_dump_json().encode(), lease=lease)

            keeper = asyncio.create_task(_keep_alive(lease, client))
            try:
                for name, record in static.items():
                    raw = record.model_dump_json().encode()
                    got = await client.get(keys.adapter(name).encode())
                    if got is None or got.value != raw:
                        await client.put(keys.adapter(name).encode(), raw)
                adapters.publish = publish
                await adapters.republish()
                yield client
            finally:
                adapters.publish = None
                keeper.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(lease.revoke()), 2.0)

    applied: dict[str, LoraRecord] | None = None

    async def on_items(items: dict[str, bytes]) -> None:
        nonlocal applied
        adapters.view = LoraView.from_items(keys, items)
        if adapters.view.adapters != applied:  # a status change alone loads nothing
            applied = dict(adapters.view.adapters)
            await adapters.apply(applied)

    retry = asyncio.create_task(_retry_busy(adapters))
    try:
        await follow_prefix(session, keys.root, on_items, first=first)
    finally:
        retry.cancel()


async def _keep_alive(lease, client) -> None:
    """Refresh the lease; when it cannot be, close the client, which ends the session's
    watch (``follow_prefix`` then reconnects with a new lease)."""
    try:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            reply = await lease.refresh()
            if reply is None or reply.TTL <= 0:
                raise ConnectionError("the status lease expired")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure: start a new session
        log.warning("adapters: lease lost (%s); reconnecting", exc)
        with contextlib.suppress(Exception):
            await client.close()


async def _retry_busy(adapters: AdapterSet) -> None:
    while True:
        await asyncio.sleep(RETRY_S)
        try:
            await adapters.retry()
        except Exception:  # noqa: BLE001 - the next tick tries again
            log.exception("adapters: retrying refused unloads failed")
