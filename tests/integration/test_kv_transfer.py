"""KV transfer between two real processes: NIXL (UCX over DRAM), etcd for discovery.

The receiving (decode) side runs in a child process, ``splitserve.components.engines.torch_cpu.kv_transfer.peer``,
driven by JSON lines; its pool is random from a seed, so this process can rebuild what
the pool must hold afterwards.  The sending (prefill) side is this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splitserve.components.engines.torch_cpu.kv_transfer import (
    AgentDirectory,
    KvTransferAgent,
    KvTransferConfig,
    PeerNotFound,
    TransferError,
)
from splitserve.components.engines.torch_cpu.kv_transfer.peer import seeded_pool
from splitserve.infra.embedded import EmbeddedInfra
from splitserve.kernels.kv_fp8 import compress, error_bound
from splitserve.kernels.kv_pack import kv_pack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(90)]

NS = "kvtest"
SRC_SHAPE = (16, 2, 2, 4, 3, 8)          # [N, L, 2, B, H, D], 1536 B per block


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> str:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep.etcd


class Peer:
    """A receiving agent in a child process; stopped by pid, whatever happens."""

    def __init__(self, etcd: str, name: str, shape, seed: int, log: Path, *extra: str):
        env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "UCX_NET_DEVICES": "lo"}
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.components.engines.torch_cpu.kv_transfer.peer",
                 "--name", name, "--etcd", etcd, "--namespace", NS, "--seed", str(seed),
                 "--shape", ",".join(map(str, shape)), *extra],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert "ready" in self._line(30), log.read_text()[-2000:]

    def _line(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"peer silent for {timeout}s: {self.log.read_text()[-2000:]}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited: {self.log.read_text()[-2000:]}")
        return json.loads(line)

    def cmd(self, read_timeout: float = 15, **kw) -> dict:
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        return self._line(read_timeout)

    def pool(self, path: Path) -> torch.Tensor:
        assert self.cmd(cmd="dump", path=str(path)) == {"dumped": str(path)}
        return torch.load(path)

    def exit(self) -> int:
        """Clean exit: the agent closes and removes its etcd record."""
        self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        self.proc.stdin.flush()
        return self.proc.wait(15)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, 9)
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except BrokenPipeError:
                pass


@pytest.fixture
def peers(tmp_path):
    started: list[Peer] = []

    def start(etcd, name, shape, seed, *extra):
        peer = Peer(etcd, name, shape, seed, tmp_path / f"{name}.log", *extra)
        started.append(peer)
        return peer
    yield start
    for peer in started:
        peer.kill()


def _sender(etcd: str, name: str, pool: torch.Tensor, **cfg) -> KvTransferAgent:
    config = KvTransferConfig(namespace=NS, timeout_s=5, grant_timeout_s=5, **cfg)
    return KvTransferAgent(name, pool, etcd_endpoints=etcd, config=config)


@pytest.mark.asyncio
async def test_direct_write_into_remote_blocks(etcd, peers, tmp_path):
    dst = peers(etcd, "decode-direct", SRC_SHAPE, 7)
    src_pool = seeded_pool(SRC_SHAPE, 1, torch.float32)
    async with _sender(etcd, "prefill-direct", src_pool) as agent:
        rec = await AgentDirectory(etcd, NS).fetch("decode-direct")
        assert rec.layout == agent.layout and rec.num_blocks == 16
        res = await agent.write_blocks("decode-direct", [3, 4, 5, 9], [10, 11, 12, 2],
                                       b"first-token:42", request_id="req-1")
        assert (res.path, res.descriptors, res.nbytes) == ("direct", 2, 4 * 1536)
        got = await asyncio.to_thread(dst.cmd, cmd="wait", request_id="req-1")
        assert got == {"arrived": "req-1", "peer": "prefill-direct",
                       "payload": b"first-token:42".hex()}
        pool = dst.pool(tmp_path / "pool.pt")
        want = seeded_pool(SRC_SHAPE, 7, torch.float32)
        want[[10, 11, 12, 2]] = src_pool[[3, 4, 5, 9]]
        assert torch.equal(pool, want)         # moved blocks exact, the others unchanged
        assert not torch.equal(pool[2], seeded_pool(SRC_SHAPE, 7, torch.float32)[2])
    assert dst.exit() == 0
    with pytest.raises(PeerNotFound):          # a clean close removes the record
        await AgentDirectory(etcd, NS).fetch("decode-direct")


@pytest.mark.asyncio
@pytest.mark.parametrize("fp8", [False, True])
async def test_staged_head_reshard_and_rechunk(etcd, peers, tmp_path, fp8):
    # receiver: tp=3, rank 1 holds head 1 only, 8-token blocks; sender: tp=1, 4-token blocks
    dst_shape = (16, 2, 2, 8, 1, 8)
    dst = peers(etcd, f"decode-tp-{fp8}", dst_shape, 7, "--tp-size", "3", "--tp-rank", "1",
                "--total-heads", "3")
    src_pool = seeded_pool(SRC_SHAPE, 1, torch.float32)
    src_ids, dst_ids, num_tokens = [3, 4, 5, 9], [10, 2], 14
    async with _sender(etcd, f"prefill-tp-{fp8}", src_pool, fp8=fp8) as agent:
        res = await agent.write_blocks(f"decode-tp-{fp8}", src_ids, dst_ids, b"tok",
                                       request_id="req-s", num_tokens=num_tokens)
        assert res.path == "staged"
        got = await asyncio.to_thread(dst.cmd, cmd="wait", request_id="req-s")
        assert got["arrived"] == "req-s" and got["payload"] == b"tok".hex()
        pool = dst.pool(tmp_path / "pool.pt")
    before = seeded_pool(dst_shape, 7, torch.float32)
    # request tokens of head 1, re-cut into 8-token blocks; slots past token 14 are zero
    sent = src_pool[src_ids][..., 1:2, :]                            # [4, L, 2, 4, 1, D]
    tokens = sent.permute(1, 2, 0, 3, 4, 5).reshape(2, 2, 16, 1, 8)
    got_tokens = pool[dst_ids].permute(1, 2, 0, 3, 4, 5).reshape(2, 2, 16, 1, 8)
    assert torch.count_nonzero(got_tokens[:, :, num_tokens:]) == 0
    if fp8:
        bound = error_bound(compress(kv_pack(src_pool, src_ids)).scales).max()
        err = (got_tokens[:, :, :num_tokens] - tokens[:, :, :num_tokens]).abs().max()
        assert 0 < err <= bound
    else:
        assert torch.equal(got_tokens[:, :, :num_tokens], tokens[:, :, :num_tokens])
    others = [i for i in range(16) if i not in dst_ids]
    assert torch.equal(pool[others], before[others])


@pytest.mark.asyncio
async def test_timeouts_dead_and_restarted_peers(etcd, peers):
    src_pool = seeded_pool(SRC_SHAPE, 1, torch.float32)
    dst = peers(etcd, "decode-flaky", SRC_SHAPE, 7)
    async with _sender(etcd, "prefill-flaky", src_pool) as agent:
        # the decode side waits for KV that never comes: a timeout, not a hang
        t0 = time.monotonic()
        got = await asyncio.to_thread(dst.cmd, cmd="wait", request_id="never", timeout=0.5)
        assert got == {"timeout": "never"} and time.monotonic() - t0 < 5
        with pytest.raises(PeerNotFound):
            await agent.write_blocks("no-such-agent", [0], [0], request_id="x")
        await agent.write_blocks("decode-flaky", [0], [1], request_id="warm")
        # the peer dies without closing (its etcd record stays): a clear error, quickly
        dst.kill()
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            await agent.write_blocks("decode-flaky", [1, 2], [3, 4], request_id="dead")
        assert time.monotonic() - t0 < agent.config.timeout_s + 2
        # it comes back under the same name: the stale metadata is re-fetched, write works
        dst2 = peers(etcd, "decode-flaky", SRC_SHAPE, 8)
        res = await agent.write_blocks("decode-flaky", [1, 2], [3, 4], b"again",
                                       request_id="back")
        assert res.path == "direct"
        got = await asyncio.to_thread(dst2.cmd, cmd="wait", request_id="back")
        assert got["payload"] == b"again".hex()


@pytest.mark.asyncio
async def test_an_idle_receiver_polls_slowly_until_a_transfer_is_expected(etcd):
    """The receiving poller drains NIXL every notif_poll_s only while a transfer is
    expected (and notif_busy_s after); idle, every notif_idle_poll_s, so an idle decode
    worker's event loop is not woken a thousand times a second."""
    pool = seeded_pool(SRC_SHAPE, 3, torch.float32)
    async with _sender(etcd, "decode-idle", pool, notif_busy_s=1.0,
                       notif_idle_poll_s=0.1) as agent:
        drains = 0
        drain = agent._port.drain

        def counted():
            nonlocal drains
            drains += 1
            return drain()

        agent._port.drain = counted
        agent.start_poller()
        await asyncio.sleep(1.5)  # past notif_busy_s: idle
        drains = 0
        await asyncio.sleep(1.0)
        idle = drains
        assert idle <= 12, idle  # ~10 at notif_idle_poll_s=0.1 (1000 at notif_poll_s)
        agent.expect()           # blocks were reserved for a remote prefill
        drains = 0
        await asyncio.sleep(0.5)
        assert drains >= 5 * idle + 20, (drains, idle)
