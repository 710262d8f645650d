"""LoRA adapters of a graph in etcd: the key layout, the records, and a prefix follower.

etcd is the adapters' source of truth.  Layout under ``splitserve/<namespace>/loras/``
(the namespace of the base model's pool, so a ``Models`` pool has adapters of its own)::

    adapters/<name>             LoraRecord: the adapter's directory and base model
    status/<name>/<worker>      LoraStatus of one worker replica (its instance id in hex),
                                written on that replica's lease: it goes with the replica

Writers: the frontend's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (which
``dynamo lora`` calls), and each worker for the adapters of its section's ``loras``.
Readers: every worker replica whose engine serves LoRA follows ``adapters/`` and loads or
unloads to match (a replica started later loads the current set); the frontend follows
the whole prefix to serve each adapter under its own model name once a worker reports it
loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("splitserve.loras")

RECORD_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ADAPTER_CONFIG = "adapter_config.json"
"""The file every PEFT adapter directory has (``save_pretrained`` writes it)."""


def lora_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an adapter, or None.  Names become etcd key segments,
    OpenAI model ids and metric label values: letters, digits, ``.``, ``_`` and ``-``,
    starting with a letter or digit, at most 128 characters."""
    if not isinstance(name, str) or not _NAME.match(name):
        return (f"{name!r} is not a valid adapter name (letters, digits, '.', '_' and '-', "
                "starting with a letter or digit, at most 128 characters)")
    return None


class LoraRecord(BaseModel):
    """``adapters/<name>``: what every worker of the namespace should have loaded."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    version: int = RECORD_VERSION
    path: str = Field(min_length=1, description="The PEFT adapter directory (absolute).")
    base_model: str = Field(min_length=1, description="Served name of the base model.")
    source: Literal["api", "config"] = Field(
        "api", description="`api`: loaded at run time (`dynamo lora load`, the HTTP "
        "endpoint); `config`: a worker section's `loras`, which unload refuses.")


LoraState = Literal["loaded", "failed", "unsupported"]


class LoraStatus(BaseModel):
    """``status/<name>/<worker>``: how one worker replica stands with an adapter."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    state: LoraState
    path: str = ""
    """The directory the state is about (a reload from another path starts over)."""
    error: str = ""
    """Why it failed, or why the engine cannot serve it (``unsupported``)."""
    component: str = ""
    engine: str = ""
    role: Literal["serve", "prefill"] = "serve"
    """``serve``: a replica requests are routed to (aggregated or decode); ``prefill``: a
    prefill worker, which computes the prompts of the adapter's requests that its decode
    workers offload (written by this release on; earlier statuses read as ``serve``)."""


@dataclass(frozen=True)
class LoraKeys:
    """The etcd keys of one namespace's adapters."""

    namespace: str

    @property
    def root(self) -> str:
        return f"splitserve/{self.namespace}/loras/"

    @property
    def adapters(self) -> str:
        return self.root + "adapters/"

    @property
    def statuses(self) -> str:
        return self.root + "status/"

    def adapter(self, name: str) -> str:
        return self.adapters + name

    def status(self, name: str, worker_id: int) -> str:
        return f"{self.statuses}{name}/{worker_id:x}"


@dataclass
class LoraView:
    """The adapters of one namespace as read from etcd: records and worker statuses."""

    adapters: dict[str, LoraRecord] = field(default_factory=dict)
    statuses: dict[str, dict[int, LoraStatus]] = field(default_factory=dict)
    """Adapter name -> worker instance id -> its status."""

    @classmethod
    def from_items(cls, keys: LoraKeys, items: Mapping[str, bytes]) -> LoraView:
        """Parse a prefix's keys; an unreadable value is skipped (and logged)."""
        view = cls()
        for key, raw in items.items():
            try:
                if key.startswith(keys.adapters):
                    name = key[len(keys.adapters):]
                    if lora_name_problem(name) is None:
                        view.adapters[name] = LoraRecord.model_validate_json(raw)
                elif key.startswith(keys.statuses):
                    name, _, worker = key[len(keys.statuses):].partition("/")
                    view.statuses.setdefault(name, {})[int(worker, 16)] = (
                        LoraStatus.model_validate_json(raw))
            except ValueError as exc:
                log.warning("loras: unreadable %s: %s", key, str(exc).splitlines()[0])
        return view

    def current(self, name: str) -> dict[int, LoraStatus]:
        """The statuses of ``name`` that are about its current path."""
        record = self.adapters.get(name)
        if record is None:
            return {}
        return {w: s for w, s in self.statuses.get(name, {}).items()
                if s.state == "unsupported" or s.path == record.path}

    def loaded_on(self, name: str, role: str = "serve") -> set[int]:
        """Workers of ``role`` that report ``name`` loaded from its current path (by
        default the replicas requests are routed to)."""
        return {w for w, s in self.current(name).items()
                if s.state == "loaded" and s.role == role}

    def problems(self, name: str, role: str | None = None) -> dict[int, str]:
        """Workers (of ``role``; None: of any) that could not load ``name`` (or cannot
        serve adapters), and why."""
        return {w: s.error or s.state for w, s in self.current(name).items()
                if s.state != "loaded" and role in (None, s.role)}


OnItems = Callable[[dict[str, bytes]], Awaitable[None] | None]


async def follow_prefix(connect: Callable[[], contextlib.AbstractAsyncContextManager],
                        prefix: str, on_items: OnItems, *,
                        first: asyncio.Event | None = None,
                        retry_s: tuple[float, float] = (0.5, 10.0)) -> None:
    """Keep ``on_items(every key under prefix -> value)`` current until cancelled.

    ``connect()`` opens an aetcd client (``etcd.etcd_client(endpoints)``).  Reads the
    prefix, calls ``on_items`` with it, then watches from the next revision and calls
    it again after every change; a lost connection is retried with backoff and the
    prefix read again (nothing is missed: the new read is the whole state).  ``first``
    is set after the first read, or after the first failure to connect (callers then go
    on with nothing loaded rather than hang)."""
    delay = retry_s[0]
    while True:
        try:
            async with connect() as client:
                got = await client.get_prefix(prefix.encode())
                items = {kv.key.decode(): kv.value for kv in got}
                watch = await client.watch_prefix(prefix.encode(),
                                                  start_revision=got.header.revision + 1)
                await _call(on_items, dict(items))
                if first is not None:
                    first.set()
                delay = retry_s[0]
                async for event in watch:
                    key = event.kv.key.decode()
                    if event.kind == "PUT":
                        items[key] = event.kv.value
                    else:
                        items.pop(key, None)
                    await _call(on_items, dict(items))
                raise ConnectionError("watch stream closed")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any client error: reconnect
            log.warning("loras: etcd %s unavailable (%s: %s); retrying in %.1fs", prefix,
                        type(exc).__name__, exc, delay)
            if first is not None:
                first.set()
            await asyncio.sleep(delay)
            delay = min(delay * 2, retry_s[1])


async def _call(fn: OnItems, items: dict[str, bytes]) -> None:
    result = fn(items)
    if inspect.isawaitable(result):
        await result
