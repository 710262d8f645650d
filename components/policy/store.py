"""The versioned policy store in etcd: apply, read, roll back and compare versions.

Used by the ``dynamo policy`` CLI and by tests; components only read, through
``PolicyWatcher``.  Versions are immutable and numbered 1, 2, 3...; ``current`` always
points at the newest one, because a rollback is itself a new version whose content equals
an older one.  Every write is one etcd transaction that creates the version key and moves
``current``, guarded by a compare-and-swap on ``current``'s revision, so of two concurrent
applies exactly one wins and the other gets ``PolicyConflict``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import aetcd

from splitserve.contracts.kit.etcd import etcd_client

from .canonical import canonical_dict, policy_sha256, unified_diff
from .records import ComponentStatus, CurrentPointer, PolicyKeys, PolicyVersion
from .schema import PolicyFile, PolicyRegistries, parse_policy
from .signing import PolicyKey


class PolicyConflict(RuntimeError):
    """Another writer moved ``current`` between this writer's read and its transaction."""


class PolicyNotFound(LookupError):
    """The version asked for does not exist (or nothing has been applied yet)."""


async def read_pointer(client: aetcd.Client, keys: PolicyKeys) -> tuple[CurrentPointer | None,
                                                                         int]:
    """Return the current pointer (None if unset) and the key's mod revision (0 if unset)."""
    got = await client.get(keys.current.encode())
    if got is None:
        return None, 0
    return CurrentPointer.model_validate_json(got.value), got.mod_revision


async def read_version(client: aetcd.Client, keys: PolicyKeys, number: int) -> PolicyVersion:
    """Return stored version ``number``; raises ``PolicyNotFound``."""
    got = await client.get(keys.version(number).encode())
    if got is None:
        raise PolicyNotFound(f"no policy version {number} in namespace {keys.namespace!r}")
    return PolicyVersion.model_validate_json(got.value)


class PolicyStore:
    """The policy versions of one namespace in one etcd cluster.

    Each method opens its own short connection, so a store object is cheap and holds no
    socket between CLI calls.  Methods raise aetcd's ``ConnectionFailedError`` when etcd
    cannot be reached.
    """

    def __init__(self, etcd_endpoints: str, namespace: str,
                 registries: PolicyRegistries | None = None,
                 signing_key: PolicyKey | None = None) -> None:
        self.endpoints = etcd_endpoints
        self.keys = PolicyKeys(namespace)
        self.registries = registries
        self.signing_key = signing_key

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[aetcd.Client]:
        """An etcd client for this store's cluster; the watcher keeps one open."""
        async with etcd_client(self.endpoints) as client:
            yield client

    def parse(self, record: PolicyVersion) -> PolicyFile:
        """Validate a stored version's policy with this release's schema.

        Called on every read that hands a policy to someone; raises ``PolicyError`` when
        the stored document no longer validates (written by a newer release, say).
        """
        return parse_policy(record.policy, f"version {record.version}", self.registries)

    def authenticity(self, record: PolicyVersion, policy: PolicyFile) -> str | None:
        """Why a component must refuse ``record`` (unsigned, wrong key, content not
        matching its hash), or None.  Called by the watcher before applying; needs the
        store's key (a store without one refuses everything: nothing can be verified)."""
        if self.signing_key is None:
            return "no policy key configured in this component (SPLITSERVE_POLICY_KEY_FILE)"
        problem = self.signing_key.check(self.keys.namespace, record)
        if problem is None and policy_sha256(policy) != record.sha256:
            problem = "policy content does not match its signed hash"
        return problem

    async def apply(self, policy: PolicyFile | Mapping[str, Any], source: str, author: str,
                    *, force: bool = False, expect_version: int | None = None) -> int:
        """Validate ``policy`` and make it current; called by ``dynamo policy apply``.

        Returns the new version number, or the current one when the policy equals it and
        ``force`` is false (nothing is written then).  ``expect_version`` (0: nothing
        applied yet) makes the apply conditional on what the caller last saw.  Raises
        ``PolicyError`` before any write when invalid, ``PolicyConflict`` when a concurrent
        writer won or ``current`` is not ``expect_version``.
        """
        data = canonical_dict(policy) if isinstance(policy, PolicyFile) else policy
        checked = parse_policy(data, source, self.registries)  # before anything is written
        async with self.connect() as client:
            pointer, revision = await read_pointer(client, self.keys)
            seen = pointer.version if pointer else 0
            if expect_version is not None and seen != expect_version:
                raise PolicyConflict(f"current is v{seen}, not the expected v{expect_version}; "
                                     "review it (dynamo policy diff) and apply again")
            return await self._commit(client, checked, pointer, revision, source, author,
                                      rollback_of=None, force=force)

    async def _commit(self, client: aetcd.Client, policy: PolicyFile,
                      pointer: CurrentPointer | None, revision: int, source: str, author: str,
                      rollback_of: int | None, force: bool) -> int:
        sha = policy_sha256(policy)
        if pointer is not None and pointer.sha256 == sha and not force:
            return pointer.version
        number = pointer.version + 1 if pointer else 1
        record = PolicyVersion(version=number, created_at=datetime.now(UTC), source=source,
                               author=author, sha256=sha, rollback_of=rollback_of,
                               policy=canonical_dict(policy))
        if self.signing_key is not None:
            record.signature = self.signing_key.sign(self.keys.namespace, record)
        new_pointer = CurrentPointer(version=number, sha256=sha)
        tx = client.transactions
        current_key = self.keys.current.encode()
        version_key = self.keys.version(number).encode()
        # `current` unchanged since we read it (or still absent), and the version is new.
        guard = tx.mod(current_key) == revision if pointer else tx.version(current_key) == 0
        won, _ = await client.transaction(
            compare=[guard, tx.version(version_key) == 0],
            success=[tx.put(version_key, record.model_dump_json().encode()),
                     tx.put(current_key, new_pointer.model_dump_json().encode())],
            failure=[])
        if not won:
            now, _ = await read_pointer(client, self.keys)
            seen = f"v{pointer.version}" if pointer else "no policy"
            raise PolicyConflict(
                f"another apply won: current moved from {seen} to "
                f"v{now.version if now else '?'} while this one was being written; "
                "review it (dynamo policy diff) and apply again")
        return number

    async def current(self) -> PolicyVersion | None:
        """Return the version in force, or None before the first apply."""
        async with self.connect() as client:
            pointer, _ = await read_pointer(client, self.keys)
            return None if pointer is None else await read_version(client, self.keys,
                                                                   pointer.version)

    async def get(self, version: int) -> PolicyVersion:
        """Return version ``version``; raises ``PolicyNotFound``."""
        async with self.connect() as client:
            return await read_version(client, self.keys, version)

    async def history(self, limit: int | None = 20) -> list[PolicyVersion]:
        """Return up to ``limit`` versions, newest first (all when ``limit`` is None)."""
        async with self.connect() as client:
            rows = await client.get_prefix(self.keys.versions.encode(), sort_order="descend")
            records = [PolicyVersion.model_validate_json(kv.value) for kv in rows]
        return records if limit is None else records[:limit]

    async def rollback(self, to_version: int | None = None, author: str = "") -> int:
        """Make an older version's content current again, as a new version.

        ``to_version`` defaults to the version before the current one, so a second
        rollback undoes the first.  Returns the new version number (the current one when
        the content is already in force).  Raises ``PolicyNotFound`` when there is nothing
        to roll back to, ``PolicyConflict`` when a concurrent writer won.
        """
        async with self.connect() as client:
            pointer, revision = await read_pointer(client, self.keys)
            if pointer is None:
                raise PolicyNotFound(f"no policy applied in namespace {self.keys.namespace!r}")
            target = pointer.version - 1 if to_version is None else to_version
            if target < 1:
                raise PolicyNotFound(f"v{pointer.version} is the first version; nothing to "
                                     "roll back to")
            record = await read_version(client, self.keys, target)
            return await self._commit(client, self.parse(record), pointer, revision,
                                      f"rollback to v{target}", author, rollback_of=target,
                                      force=False)

    async def diff(self, a: int | None = None, b: int | None = None) -> str:
        """Return a unified diff of versions ``a`` and ``b`` (canonical YAML).

        ``b`` defaults to the current version and ``a`` to the one before ``b``.  Returns
        an empty string when they are equal; raises ``PolicyNotFound``.
        """
        async with self.connect() as client:
            if b is None:
                pointer, _ = await read_pointer(client, self.keys)
                if pointer is None:
                    raise PolicyNotFound("no policy applied yet")
                b = pointer.version
            a = b - 1 if a is None else a
            old = await read_version(client, self.keys, a)
            new = await read_version(client, self.keys, b)
        return unified_diff(old.policy, new.policy, f"v{a}", f"v{b}")

    async def statuses(self) -> list[ComponentStatus]:
        """Return the statuses live component instances published, by key order."""
        async with self.connect() as client:
            rows = await client.get_prefix(self.keys.statuses.encode())
            return [ComponentStatus.model_validate_json(kv.value) for kv in rows]
