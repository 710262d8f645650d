"""The mocker Worker component with real etcd, NATS and processes.

Starts the component as the supervisor would (``python -m ... --config FILE``), sends
PreprocessedRequest-shaped dicts straight to its instance, checks that its KV events
reach indexers in this process, and that SIGTERM leaves no process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.contracts.kit.etcd import get_prefix
from splitserve.contracts.kv_events import (
    KV_EVENTS,
    apply_kv_events,
    decode_envelope,
    event_subject,
)
from splitserve.infra.embedded import EmbeddedInfra
from splitserve.contracts.kit.procs import kill_pid, pid_alive
from splitserve.contracts.config import CommonConfig
from splitserve.contracts.config import ComponentRunConfig

pytestmark = pytest.mark.integration

NS = "mocktest"
BLOCK = 16


class Launched:
    """A mocker Worker replica started from a run-config file, tracked by pid."""

    def __init__(self, tmp: Path, env: dict[str, str], **engine_args) -> None:
        self.status = tmp / "status.json"
        section = {"engine": "mocker", "engine_args": engine_args}
        cfg = ComponentRunConfig(component="Worker", replica=0,
                                 common=CommonConfig(namespace=NS), config=section,
                                 links=[], status_file=str(self.status))
        cfg_file = tmp / "worker.json"
        cfg_file.write_text(cfg.model_dump_json())
        self.log = open(tmp / "worker.log", "wb")  # noqa: SIM115 - closed in kill_all
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.components.worker.main",
             "--config", str(cfg_file)], env=env, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.pids = {self.proc.pid}

    def state(self) -> dict:
        try:
            data = json.loads(self.status.read_text())
        except (OSError, ValueError):
            return {}
        if data.get("engine_pid"):
            self.pids.add(data["engine_pid"])
        return data

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.state()
            if st.get("state") == "ready":
                return st
            assert self.proc.poll() is None, f"worker exited {self.proc.returncode}:\n" \
                + Path(self.log.name).read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        raise AssertionError("worker not ready in time:\n"
                             + Path(self.log.name).read_text(errors="replace")[-3000:])

    def kill_all(self) -> None:
        for pid in self.pids:
            kill_pid(pid, 2.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.log.close()


def data_of(item) -> dict:
    return item.data() if callable(item.data) else item.data


async def exercise(ep, instance_id: int) -> None:
    import nats
    from dynamo.llm import KvRouter, KvRouterConfig, RadixTree, compute_block_hash_for_seq
    from dynamo.runtime import DistributedRuntime

    tree = RadixTree()
    nc = await nats.connect(ep.nats)

    errors: list[BaseException] = []

    async def on_kv(msg) -> None:
        try:
            topic, payload = decode_envelope(msg.data)
            assert topic == KV_EVENTS
            apply_kv_events(tree, payload)
        except Exception as exc:  # noqa: BLE001 - nats-py would swallow it; report below
            errors.append(exc)

    got: list[int] = []

    async def counted(msg) -> None:
        got.append(len(msg.data))
        await on_kv(msg)

    await nc.subscribe(event_subject(NS, "worker", KV_EVENTS), cb=counted)
    # The server must hold the subscription before the request below makes events: a
    # round trip (PING/PONG) after SUB guarantees it.
    await nc.flush(timeout=10)
    rt = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp", event_plane="nats")
    try:
        endpoint = rt.endpoint(f"{NS}.worker.generate")
        router = KvRouter(endpoint, BLOCK, KvRouterConfig())
        client = await endpoint.client()
        await asyncio.wait_for(client.wait_for_instances(), 10)
        assert instance_id in client.instance_ids()

        prompt = list(range(1000, 1000 + 10 * BLOCK + 3))  # 10 full blocks and a partial
        request = {"model": "SmolLM2-135M-Instruct", "token_ids": prompt,
                   "stop_conditions": {"max_tokens": 7, "ignore_eos": False},
                   "sampling_options": {"temperature": 0.0}, "output_options": {},
                   "eos_token_ids": [2]}
        stream = await client.direct(request, instance_id)
        chunks = [data_of(item) async for item in stream]
        tokens = [t for c in chunks for t in c["token_ids"]]
        assert len(tokens) == 7, chunks
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["token_ids"] == []
        assert all(c["finish_reason"] is None for c in chunks[:-1])

        # Events arrive asynchronously after completion: poll both indexers.  Alone this
        # takes well under a second; with the suite's three workers on two cores the
        # subscriber in this process once had nothing after 5 s while the router's
        # indexer had all ten blocks, so the wait is bounded at 20 s.
        hashes = compute_block_hash_for_seq(prompt, BLOCK)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            overlap = await router.get_overlap_scores(prompt)
            device = {w["worker_id"]: w["device_blocks"] for w in overlap["workers"]}
            raw = tree.find_matches(hashes).scores
            if device.get(instance_id) == 10 and raw.get((instance_id, 0)) == 10:
                break
            await asyncio.sleep(0.1)
        assert device.get(instance_id) == 10, overlap
        assert not errors, errors
        assert raw.get((instance_id, 0)) == 10, (raw, f"{len(got)} messages seen", got)
        other = await router.get_overlap_scores(list(range(50_000, 50_000 + 4 * BLOCK)))
        assert all(w["device_blocks"] == 0 for w in other["workers"])
    finally:
        await nc.close()
        rt.shutdown()


def test_mocker_worker_serves_publishes_kv_events_and_stops_clean(tmp_path, monkeypatch):
    with EmbeddedInfra(tmp_path / "infra") as ep:
        for key, value in ep.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("DYN_TCP_RPC_HOST", "127.0.0.1")
        worker = Launched(tmp_path, {**os.environ, "DYN_LOG": "warn"}, engine_type="sglang",
                          block_size=BLOCK, speedup_ratio=1000.0)
        try:
            ready = worker.wait_ready(60)
            assert ready["endpoint"] == f"{NS}.worker.generate"
            asyncio.run(exercise(ep, ready["instance_id"]))

            worker.proc.send_signal(signal.SIGTERM)
            assert worker.proc.wait(15) == 0
            assert worker.state()["state"] == "stopped"
            keys = asyncio.run(get_prefix(ep.etcd, f"v1/instances/{NS}/"))
            assert keys == [], keys
        finally:
            worker.kill_all()
        leftovers = [p for p in worker.pids if pid_alive(p)]
        assert leftovers == [], f"left running: {leftovers}"
        assert len(worker.pids) == 2  # the component and its engine were both seen


async def one_request_each(instance_ids: list[int]) -> list[list[dict]]:
    from dynamo.runtime import DistributedRuntime

    rt = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp", event_plane="nats")
    try:
        client = await rt.endpoint(f"{NS}.worker.generate").client()
        await asyncio.wait_for(client.wait_for_instances(), 10)
        request = {"model": "SmolLM2-135M-Instruct", "token_ids": list(range(1, 70)),
                   "stop_conditions": {"max_tokens": 3}, "eos_token_ids": [2]}
        return [[data_of(i) async for i in await client.direct(request, iid)]
                for iid in instance_ids]
    finally:
        rt.shutdown()


def test_trtllm_mocker_with_two_engines_in_one_process(tmp_path, monkeypatch):
    with EmbeddedInfra(tmp_path / "infra") as ep:
        for key, value in ep.env().items():
            monkeypatch.setenv(key, value)
        worker = Launched(tmp_path, {**os.environ, "DYN_LOG": "warn"}, engine_type="trtllm",
                          block_size=32, speedup_ratio=1000.0, workers_per_process=2)
        try:
            ready = worker.wait_ready(60)
            assert len(ready["instance_ids"]) == 2
            for chunks in asyncio.run(one_request_each(ready["instance_ids"])):
                assert [len(c["token_ids"]) for c in chunks] == [1, 1, 1, 0]
                assert chunks[-1]["finish_reason"] == "length"
                # TRT-LLM's mocker reports usage on every chunk; SGLang's does not.
                assert chunks[-1]["completion_usage"]["prompt_tokens"] == 69
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.proc.wait(15) == 0
        finally:
            worker.kill_all()
        assert [p for p in worker.pids if pid_alive(p)] == []
