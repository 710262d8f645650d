"""The project's NixlConnector around vLLM's: the model thread keeps its cores, and a
handshake listener that cannot bind moves or fails the start instead of hanging it.

vLLM's NIXL worker on CPU pins the thread that creates it to the last core of each NUMA
node; on a small host that is another engine's core, where the thread was starved (see
the connector module).  vLLM's own constructor is replaced here by one that does only
that move, so the check runs without building an engine.  The handshake listener is
vLLM's own, bound to a real loopback port.
"""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from splitserve.components.engines.vllm.config import (
    KEEP_MODEL_CORES,
    PROGRESS_THREAD,
    VllmKvTransfer,
)
from tests.installed import needs_vllm

# vLLM is imported when the first test runs, not at collection (tests/installed.py).
pytestmark = needs_vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_names() -> None:
    global KVTransferConfig, KVConnectorRole, NixlBaseConnectorScheduler, GET_META_MSG
    global nixl_connector
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    from splitserve.components.engines.vllm import nixl_connector


CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to move between")


class _Config:
    def __init__(self, transfer: VllmKvTransfer) -> None:
        self.kv_transfer_config = KVTransferConfig(**transfer.connector_config(
            "decode", "d-1"))


def _build_in_thread(transfer: VllmKvTransfer, monkeypatch) -> tuple[set, bool]:
    """Construct the connector in a fresh thread pinned to the first core, with vLLM's
    constructor replaced by its thread move; returns that thread's cores afterwards and
    whether NIXL's agent config was left with its progress thread."""
    def vllm_init(self, vllm_config, role, kv_cache_config=None):
        os.sched_setaffinity(0, {CORES[-1]})  # what vLLM's NIXL worker does on CPU

    monkeypatch.setattr(nixl_connector._VllmNixlConnector, "__init__", vllm_init)
    monkeypatch.setattr(nixl_connector.base_worker, "nixl_agent_config",
                        lambda **kw: kw)
    out: dict = {}

    def body():
        os.sched_setaffinity(0, {CORES[0]})
        nixl_connector.NixlConnector(_Config(transfer), KVConnectorRole.WORKER)
        out["cores"] = os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    prog = nixl_connector.base_worker.nixl_agent_config().get("enable_prog_thread", True)
    return out["cores"], prog


@two_cores
def test_model_thread_is_put_back_and_progress_thread_switch_applies(monkeypatch):
    cores, prog = _build_in_thread(VllmKvTransfer(progress_thread=False), monkeypatch)
    assert cores == {CORES[0]}
    assert prog is False


@two_cores
def test_progress_thread_kept_when_configured(monkeypatch):
    cores, prog = _build_in_thread(VllmKvTransfer(progress_thread=True), monkeypatch)
    assert cores == {CORES[0]}
    assert prog is True


def test_gpu_transfer_leaves_vllms_placement():
    """On GPUs vLLM does not move the thread: the project's connector (used for its
    listener) leaves the placement and the progress thread to vLLM."""
    extra = VllmKvTransfer(buffer_device="cuda", progress_thread=True).connector_config(
        "decode", "d-1")["kv_connector_extra_config"]
    assert KEEP_MODEL_CORES not in extra and PROGRESS_THREAD not in extra


# ---- the handshake listener: vLLM's own, started as vLLM's scheduler starts it --------

def _start_listener(port: int, repick: bool) -> tuple[SimpleNamespace, object]:
    """A scheduler stand-in holding vLLM's listener and the port, guarded as the
    connector guards it; the listener thread started and awaited as vLLM does (with a
    bound on the wait, which vLLM's own has not)."""
    sched = SimpleNamespace(_nixl_handshake_listener=(
        NixlBaseConnectorScheduler._nixl_handshake_listener), side_channel_port=port)
    guard = nixl_connector._GuardedListener(sched, repick)
    sched._nixl_handshake_listener = guard
    ready, stop = threading.Event(), threading.Event()
    sched.stop = stop
    t = threading.Thread(target=sched._nixl_handshake_listener, daemon=True, args=(
        {(0, 0): b"agent-metadata"}, ready, stop, "127.0.0.1", sched.side_channel_port))
    t.start()
    assert ready.wait(20), "the listener's starter would wait for ever"
    return sched, guard


def _taken_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_picked_side_channel_port_that_is_taken_moves_to_a_free_one():
    with _taken_port() as taken:
        port = taken.getsockname()[1]
        sched, guard = _start_listener(port, repick=True)
        try:
            guard.check()
            assert sched.side_channel_port != port
            # a decode engine's handshake reaches the new port
            ctx = zmq.Context()
            try:
                req = ctx.socket(zmq.REQ)
                req.setsockopt(zmq.RCVTIMEO, 10_000)
                req.connect(f"tcp://127.0.0.1:{sched.side_channel_port}")
                req.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
                assert req.recv_multipart()[0] == b"agent-metadata"
            finally:
                ctx.destroy(linger=0)
        finally:
            sched.stop.set()


def test_a_configured_side_channel_port_that_is_taken_fails_the_start_naming_it():
    with _taken_port() as taken:
        port = taken.getsockname()[1]
        sched, guard = _start_listener(port, repick=False)
        assert sched.side_channel_port == port
        with pytest.raises(RuntimeError, match=f"could not listen on 127.0.0.1:{port}"):
            guard.check()
