"""The policy store, the watcher and `dynamo policy` against a real etcd (loopback)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Self
from urllib.parse import urlparse

import pytest
from typer.testing import CliRunner

from splitserve.cli.main import app
from splitserve.infra.embedded import EmbeddedInfra
from splitserve.components.policy import (
    PolicyConflict,
    PolicyError,
    PolicyKey,
    PolicyNotFound,
    PolicyStore,
    PolicyWatcher,
    parse_policy,
)
from splitserve.contracts.kit.credentials import write_secret
from tests.unit.policy.policy_factories import CONFIGS, edited, seed

pytestmark = pytest.mark.integration

SEED = CONFIGS / "policies" / "seed.yaml"
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep.etcd


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The operator's policy signing key (0600), as `dynamo serve` writes it."""
    path = tmp_path_factory.mktemp("key") / "policy.key"
    write_secret(path)
    return path


@pytest.fixture
def store(etcd_url: str, key_file: Path) -> PolicyStore:
    """A store on a namespace of its own, so tests never see each other's versions."""
    return PolicyStore(etcd_url, f"t{uuid.uuid4().hex[:8]}",
                       signing_key=PolicyKey.from_file(key_file))


def threshold(n: int) -> dict:
    return edited(seed(), "split_policy.prompt_length_threshold", n)


async def eventually(predicate, timeout_s: float) -> float:
    """Poll ``predicate`` until true; returns seconds waited, fails after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.asyncio
async def test_apply_history_rollback_diff(store: PolicyStore) -> None:
    assert await store.current() is None
    assert await store.apply(threshold(256), "a.yaml", "alice") == 1
    assert await store.apply(threshold(512), "b.yaml", "bob") == 2
    assert await store.apply(threshold(512), "b.yaml", "bob") == 2  # same content: no write
    current = await store.current()
    assert (current.version, current.author, current.source) == (2, "bob", "b.yaml")
    assert store.parse(current) == parse_policy(threshold(512))

    assert await store.rollback(author="carol") == 3
    rolled = await store.get(3)
    assert (rolled.rollback_of, rolled.sha256) == (1, (await store.get(1)).sha256)
    assert await store.rollback() == 4  # the default target is the previous version: undo
    assert (await store.get(4)).sha256 == (await store.get(2)).sha256
    assert await store.rollback(to_version=1) == 5

    assert [r.version for r in await store.history(limit=3)] == [5, 4, 3]
    assert "-  prompt_length_threshold: 512\n+  prompt_length_threshold: 256\n" in \
        await store.diff()
    assert await store.diff(1, 3) == ""


@pytest.mark.asyncio
async def test_refuses_invalid_documents_and_unknown_versions(store: PolicyStore) -> None:
    with pytest.raises(PolicyError):
        await store.apply(edited(seed(), "autoscale.prefill.min_replicas", 99), "x", "x")
    assert await store.history() == []  # nothing was written
    with pytest.raises(PolicyNotFound):
        await store.rollback()
    await store.apply(seed(), "a", "a")
    with pytest.raises(PolicyNotFound, match="first version"):
        await store.rollback()
    with pytest.raises(PolicyNotFound):
        await store.get(7)


@pytest.mark.asyncio
async def test_two_applies_from_the_same_base_cannot_both_win(store: PolicyStore) -> None:
    await store.apply(seed(), "base", "a")
    results = await asyncio.gather(*(store.apply(threshold(300 + i), f"f{i}", "w",
                                                 expect_version=1) for i in range(2)),
                                   return_exceptions=True)
    assert sorted(map(type, results), key=str) == sorted([int, PolicyConflict], key=str)
    assert [r.version for r in await store.history()] == [2, 1]


@pytest.mark.asyncio
async def test_racing_applies_never_lose_or_duplicate_a_version(store: PolicyStore) -> None:
    await store.apply(seed(), "base", "a")
    results = await asyncio.gather(*(store.apply(threshold(300 + i), f"f{i}", "w")
                                     for i in range(8)), return_exceptions=True)
    winners = sorted(r for r in results if isinstance(r, int))
    losers = [r for r in results if not isinstance(r, int)]
    assert all(isinstance(r, PolicyConflict) for r in losers), losers
    assert winners == list(range(2, 2 + len(winners)))  # each winner got its own version
    history = await store.history()
    assert [r.version for r in history] == list(range(1 + len(winners), 0, -1))
    assert len({r.source for r in history}) == len(history)


@pytest.mark.asyncio
async def test_watcher_follows_and_keeps_previous_on_failure(store: PolicyStore) -> None:
    applied: list[tuple[int, int]] = []
    statuses: list[tuple[int, bool, str]] = []

    def apply_fn(policy, version: int) -> None:
        if policy.split_policy.prompt_length_threshold == 999:
            raise ValueError("threshold beyond this worker's context")
        applied.append((version, policy.split_policy.prompt_length_threshold))

    await store.apply(threshold(256), "a", "a")
    watcher = PolicyWatcher(store, apply_fn, lambda *s: statuses.append(s),
                            component="DecodeWorker", instance="w0")
    await watcher.start()
    try:
        assert applied == [(1, 256)]  # loaded at start
        await store.apply(threshold(512), "b", "b")
        assert await eventually(lambda: len(applied) == 2, 2.0) < 1.0
        assert applied[-1] == (2, 512)

        await store.apply(threshold(999), "c", "c")
        await eventually(lambda: len(statuses) == 3, 2.0)
        assert statuses[-1][:2] == (3, False) and "context" in statuses[-1][2]
        assert watcher.state.running == 2
        assert watcher.policy.split_policy.prompt_length_threshold == 512
        [published] = await store.statuses()
        assert (published.component, published.instance) == ("DecodeWorker", "w0")
        assert (published.running_version, published.last_version, published.ok) == (2, 3, False)
        assert "context" in published.reason
    finally:
        await watcher.stop()
    assert await store.statuses() == []  # the entry went with the instance's lease


@pytest.mark.asyncio
async def test_watcher_reconnects_and_catches_up(store: PolicyStore) -> None:
    applied: list[int] = []
    async with TcpProxy(store.endpoints) as proxy:
        via_proxy = PolicyStore(proxy.url, store.keys.namespace,
                                signing_key=store.signing_key)
        watcher = PolicyWatcher(via_proxy, lambda p, v: applied.append(v),
                                component="Router", instance="r0", lease_ttl_s=3)
        await store.apply(seed(), "a", "a")
        await watcher.start()
        try:
            await proxy.cut()  # etcd unreachable for the watcher
            await store.apply(threshold(400), "b", "b")
            await asyncio.sleep(0.5)
            assert applied == [1]
            proxy.resume()
            await eventually(lambda: applied == [1, 2], 8.0)
        finally:
            await watcher.stop()


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``cut()`` drops every connection and stops
    listening, ``resume()`` listens on the same port again."""

    def __init__(self, target_url: str) -> None:
        target = urlparse(target_url)
        self._target = (target.hostname, target.port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        """The proxy's address, in the target's URL form."""
        return f"http://{HOST}:{self.port}"

    async def __aenter__(self) -> Self:
        await self._listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cut()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self._writers.discard(writer)

    async def cut(self) -> None:
        """Close the listener and every forwarded connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()
        await asyncio.sleep(0)

    def resume(self) -> None:
        """Listen again on the same port (scheduled on the running loop)."""
        asyncio.get_running_loop().create_task(self._listen())


def cli(etcd: str, ns: str, *args: str, key_file: Path | None = None
        ) -> subprocess.CompletedProcess:
    """Run `dynamo policy ...` as a separate process, as an operator would."""
    env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "SPLITSERVE_HOME",
                                                            "SPLITSERVE_POLICY_KEY_FILE")}
    if key_file is not None:
        env["SPLITSERVE_POLICY_KEY_FILE"] = str(key_file)
    return subprocess.run([sys.executable, "-m", "splitserve.cli.main", "policy", *args,
                           "--etcd", etcd, "--namespace", ns],
                          check=False, capture_output=True, text=True, timeout=30, env=env)


def cli_in_process(etcd: str, ns: str, *args: str, key_file: Path | None = None):
    """The same command in this process: for the cheap checks of messages and exit codes."""
    env = {"SPLITSERVE_POLICY_KEY_FILE": str(key_file)} if key_file else None
    return CliRunner().invoke(app, ["policy", *args, "--etcd", etcd, "--namespace", ns],
                              env=env)


def test_cli_end_to_end(store: PolicyStore, tmp_path: Path, key_file: Path) -> None:
    url, ns = store.endpoints, store.keys.namespace
    first = cli(url, ns, "apply", str(SEED), "--author", "alice", key_file=key_file)
    assert first.returncode == 0 and "as v1" in first.stdout, first.stderr
    changed = tmp_path / "bigger.json"
    changed.write_text(json.dumps(threshold(1024)))
    applied = cli(url, ns, "apply", str(changed), "--json", key_file=key_file)
    assert json.loads(applied.stdout) == {"version": 2, "changed": True, "namespace": ns}

    shown = json.loads(cli(url, ns, "show", "--json").stdout)
    assert (shown["current"], shown["version"], shown["source"]) == (2, 2, str(changed))
    assert shown["policy"]["split_policy"]["prompt_length_threshold"] == 1024
    assert shown["components"] == []
    assert "-  prompt_length_threshold: 256\n+  prompt_length_threshold: 1024" in \
        cli(url, ns, "diff").stdout

    rolled = cli(url, ns, "rollback", "--json", key_file=key_file)
    assert json.loads(rolled.stdout) == {"version": 3, "restored": 1, "changed": True}
    history = json.loads(cli(url, ns, "history", "--limit", "2", "--json").stdout)
    assert [(h["version"], h["rollback_of"]) for h in history] == [(3, 1), (2, None)]
    assert cli("http://127.0.0.1:1", ns, "history").returncode == 1  # etcd unreachable


def test_cli_messages_and_exit_codes(store: PolicyStore, tmp_path: Path, key_file: Path
                                     ) -> None:
    url, ns = store.endpoints, store.keys.namespace
    k = {"key_file": key_file}
    assert cli_in_process(url, ns, "show").exit_code == 4  # nothing applied yet
    assert cli_in_process(url, ns, "rollback", **k).exit_code == 4
    assert cli_in_process(url, ns, "apply", str(SEED), **k).exit_code == 0
    again = cli_in_process(url, ns, "apply", str(CONFIGS / "policies" / "seed.json"), **k)
    assert again.exit_code == 0 and "unchanged: " in again.output
    stale = cli_in_process(url, ns, "apply", str(SEED), "--force", "--expect-version", "0",
                           **k)
    assert stale.exit_code == 3 and "not the expected v0" in stale.output

    bad = tmp_path / "bad.yaml"
    bad.write_text("split_policy: {prompt_length_threshold: -1}\n")
    refused = cli_in_process(url, ns, "apply", str(bad), **k)
    assert refused.exit_code == 2 and "split_policy.prompt_length_threshold" in refused.output
    preview = cli_in_process(url, ns, "diff", "1", str(SEED))
    assert preview.exit_code == 0 and "no differences" in preview.output

    table = cli_in_process(url, ns, "history")
    assert table.exit_code == 0 and "v1" in table.output and "current" in table.output
    assert "prompt_length_threshold: 256" in cli_in_process(url, ns, "show", "--version",
                                                             "1").output
    assert cli_in_process(url, ns, "show", "--version", "9").exit_code == 4
    assert cli_in_process(url, ns, "rollback", "--to", "9", **k).exit_code == 4


@pytest.mark.asyncio
async def test_cli_show_lists_components_and_exits_5_on_refusal(store: PolicyStore) -> None:
    def apply_fn(policy, version: int) -> None:
        if version == 2:
            raise RuntimeError("no GPU utilisation metric on this node")

    await store.apply(seed(), "a", "a")
    watcher = PolicyWatcher(store, apply_fn, component="Planner", instance="p0")
    await watcher.start()
    try:
        await store.apply(threshold(300), "b", "b")
        await eventually(lambda: watcher.state.refused == 2, 2.0)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "splitserve.cli.main", "policy", "show", "--etcd",
            store.endpoints, "--namespace", store.keys.namespace, "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 5
        [component] = json.loads(stdout)["components"]
        assert (component["component"], component["running_version"], component["ok"]) == \
            ("Planner", 1, False)
        assert "GPU utilisation" in component["reason"]
    finally:
        await watcher.stop()
