"""Components refuse policy versions not signed with the graph's key (real etcd)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from splitserve.cli.main import app
from splitserve.infra.embedded import EmbeddedInfra
from splitserve.components.policy import PolicyKey, PolicyStore, PolicyWatcher
from tests.unit.policy.policy_factories import CONFIGS, edited, seed

pytestmark = [pytest.mark.security, pytest.mark.integration]


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep.etcd


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_unsigned_and_foreign_versions_are_refused_and_reported(etcd_url):
    ns = f"s{uuid.uuid4().hex[:8]}"
    operator = PolicyStore(etcd_url, ns, signing_key=PolicyKey(b"operator-key-" * 3))
    intruder = PolicyStore(etcd_url, ns)  # etcd access, but no key: writes unsigned
    forger = PolicyStore(etcd_url, ns, signing_key=PolicyKey(b"another-key-0" * 3))
    component_side = PolicyStore(etcd_url, ns, signing_key=operator.signing_key)
    applied: list[int] = []
    watcher = PolicyWatcher(component_side, lambda p, v: applied.append(v),
                            component="Router", instance="r0")
    await operator.apply(seed(), "seed", "op")
    await watcher.start()
    try:
        assert applied == [1]
        await intruder.apply(edited(seed(), "split_policy.prompt_length_threshold", 1),
                             "evil", "anyone")
        await until(lambda: watcher.state.refused == 2)
        await forger.apply(edited(seed(), "split_policy.prompt_length_threshold", 2),
                           "evil", "anyone")
        await until(lambda: watcher.state.refused == 3)
        assert applied == [1]
        # the watcher counts a refusal before its status reaches etcd: wait for the
        # report of version 3, not the one of version 2 still there
        deadline = time.monotonic() + 5.0
        while True:
            [status] = await operator.statuses()
            if status.last_version == 3:
                break
            assert time.monotonic() < deadline, f"no status for version 3: {status}"
            await asyncio.sleep(0.02)
        assert (status.running_version, status.ok) == (1, False)
        assert "signature does not verify" in status.reason
        await operator.apply(edited(seed(), "split_policy.prompt_length_threshold", 300),
                             "good", "op")
        await until(lambda: applied == [1, 4])
    finally:
        await watcher.stop()


def test_policy_apply_without_the_key_is_refused_before_writing(etcd_url, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_POLICY_KEY_FILE", raising=False)
    ns = f"s{uuid.uuid4().hex[:8]}"
    res = CliRunner().invoke(app, ["policy", "apply", str(CONFIGS / "policies" / "seed.yaml"),
                                   "--author", "anyone", "--etcd", etcd_url, "--namespace", ns,
                                   "--state-dir", "/nonexistent-state"])
    assert res.exit_code == 2 and "no policy signing key" in res.output
    assert asyncio.run(PolicyStore(etcd_url, ns).current()) is None
