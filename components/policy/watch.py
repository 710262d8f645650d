"""Hot reload for components: follow ``current`` in etcd and apply each new version.

A component creates one ``PolicyWatcher`` at start-up with a function that applies a
policy (rebuild its router, its decider, its admission limits) and raises if it cannot;
only versions signed with the graph's key reach it (see ``signing``).  When the function
raises, the component keeps running the previous policy; the watcher
reports why through ``on_status`` and publishes it under
``splitserve/<ns>/policy/status/<component>/<instance>`` (on a lease, so the entry goes
away with the instance), which is what ``dynamo policy show`` lists.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import aetcd

from .decide import StepKind, WatchState, after_attempt, backoff_delay, decide, status_record
from .records import CurrentPointer
from .schema import PolicyError, PolicyFile
from .store import PolicyStore, read_pointer, read_version

log = logging.getLogger(__name__)

ApplyFn = Callable[[PolicyFile, int], Awaitable[None] | None]
StatusFn = Callable[[int, bool, str], None]


class PolicyWatcher:
    """Keeps one component instance on the current policy version.

    ``start()`` loads the current version (applying it) and returns once that first
    attempt is over; a background task then watches ``current`` and reconnects with
    backoff when etcd goes away.  ``stop()`` ends it and withdraws the status entry.
    """

    def __init__(self, store: PolicyStore, apply_fn: ApplyFn, on_status: StatusFn | None = None,
                 *, component: str, instance: str, lease_ttl_s: int = 10) -> None:
        self.store = store
        self.component = component
        self.instance = instance
        self._apply_fn = apply_fn
        self._on_status = on_status
        self._lease_ttl_s = lease_ttl_s
        self._state = WatchState()
        self._policy: PolicyFile | None = None
        self._task: asyncio.Task | None = None
        self._first_attempt = asyncio.Event()
        self._last_attempt: tuple[int | None, str | None] = (None, None)  # republished per lease
        self._connected = False

    @property
    def state(self) -> WatchState:
        """What runs and what was last refused."""
        return self._state

    @property
    def policy(self) -> PolicyFile | None:
        """The policy in effect; None until one has applied."""
        return self._policy

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start watching; returns after the first load (applied, refused or unreachable)."""
        self._task = asyncio.create_task(self._run(), name=f"policy-watch-{self.component}")
        try:
            await asyncio.wait_for(self._first_attempt.wait(), timeout_s)
        except TimeoutError:
            log.warning("policy: no answer from etcd after %.0fs; running on", timeout_s)

    async def stop(self) -> None:
        """Stop watching; the status entry disappears with the revoked lease."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        failures = 0
        while True:
            self._connected = False
            try:
                async with self.store.connect() as client:
                    await self._session(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any client error: reconnect
                # Back off harder only while reconnects keep failing before the first read.
                failures = 1 if self._connected else failures + 1
                delay = backoff_delay(failures)
                log.warning("policy: etcd connection lost (%s); retrying in %.1fs",
                            exc.__class__.__name__, delay)
                self._first_attempt.set()
                await asyncio.sleep(delay)

    async def _session(self, client: aetcd.Client) -> None:
        lease = await client.lease(self._lease_ttl_s)
        try:
            # Watch before reading, so a change between the read and the watch is not lost;
            # the decision core ignores the pointer if it arrives twice.
            watch = await client.watch(self.store.keys.current.encode())
            pointer, _ = await read_pointer(client, self.store.keys)
            await self._consider(client, lease, pointer, initial=True)
            self._connected = True
            self._first_attempt.set()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._keep_alive(lease))
                group.create_task(self._follow(client, lease, watch))
        finally:
            try:
                await asyncio.wait_for(asyncio.shield(lease.revoke()), 2.0)
            except Exception as exc:  # noqa: BLE001 - etcd gone: the lease expires by itself
                log.debug("policy: lease not revoked (%s); it expires on its own", exc)

    async def _keep_alive(self, lease: aetcd.Lease) -> None:
        while True:
            await asyncio.sleep(self._lease_ttl_s / 3)
            reply = await lease.refresh()
            if reply is None or reply.TTL <= 0:
                raise ConnectionError("status lease expired")

    async def _follow(self, client: aetcd.Client, lease: aetcd.Lease, watch: aetcd.Watch) -> None:
        async for event in watch:
            pointer = (CurrentPointer.model_validate_json(event.kv.value)
                       if event.kind == "PUT" else None)
            await self._consider(client, lease, pointer)
        raise ConnectionError("watch stream closed")

    async def _consider(self, client: aetcd.Client, lease: aetcd.Lease,
                        pointer: CurrentPointer | None, initial: bool = False) -> None:
        step = decide(self._state, pointer)
        log.info("policy: %s (%s)", step.kind, step.reason)
        if step.kind is StepKind.SKIP or pointer is None:
            if initial:  # a fresh lease has no status yet: publish the last outcome again
                await self._publish(client, lease, *self._last_attempt)
            return
        error = None
        if step.kind is StepKind.APPLY:
            error = await self._try_apply(client, pointer)
        self._state = after_attempt(self._state, pointer, error)
        if self._on_status is not None:
            try:
                self._on_status(pointer.version, error is None, error or "applied")
            except Exception:  # a broken callback must not stop hot reload
                log.exception("policy: on_status callback failed")
        await self._publish(client, lease, pointer.version, error)

    async def _try_apply(self, client: aetcd.Client, pointer: CurrentPointer) -> str | None:
        """Apply version ``pointer.version``; returns None or why it was refused."""
        record = await read_version(client, self.store.keys, pointer.version)
        try:
            policy = self.store.parse(record)
        except PolicyError as exc:
            return "invalid for this release: " + "; ".join(exc.errors)
        if problem := self.store.authenticity(record, policy):
            log.warning("policy: v%d refused: %s", pointer.version, problem)
            return "refused: " + problem
        try:
            result = self._apply_fn(policy, pointer.version)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # noqa: BLE001 - any failure means: keep the previous one
            log.warning("policy: v%d refused: %s", pointer.version, exc)
            return f"{exc.__class__.__name__}: {exc}"
        self._policy = policy
        return None

    async def _publish(self, client: aetcd.Client, lease: aetcd.Lease, attempted: int | None,
                       error: str | None) -> None:
        status = status_record(self._state, self.component, self.instance, attempted, error,
                               datetime.now(UTC))
        self._last_attempt = (attempted, error)
        key = self.store.keys.status(self.component, self.instance).encode()
        await client.put(key, status.model_dump_json().encode(), lease=lease)
