"""vLLM's NixlConnector with two corrections for the CPU build.

1. The model thread stays on its own cores.  On CPU, vLLM's NIXL worker moves the thread
   that creates it (the worker process's main thread, which also runs the model and
   reads the engine core's step queue) to the last core of each NUMA node, "for KV
   transfer".  On a host with fewer cores than engines that core is another engine's:
   on 2 cores both engines' model threads ended up on core 1 beside the prefill engine's
   spinning UCX progress thread, while the decode engine's own core sat idle.  Linux's
   EEVDF scheduler then starved the decode engine's main thread, which spins on the step
   queue with ``sched_yield`` (each yield pushes its deadline back): it stayed runnable
   but got no CPU for tens of seconds at a time, so the engine core waited for its step
   ("No available shared memory broadcast block found in 60 seconds") and remote reads
   looked stalled until the prefill engine's KV lease expired.  This class puts the
   thread back on the cores it had before vLLM moved it (the engine's ``cpu_cores``);
   threads NIXL starts meanwhile keep the reserved core.

2. NIXL's UCX progress thread can be turned off.  vLLM creates its NIXL agent with
   NIXL's default config, whose progress thread spins on a whole core even while
   nothing moves.  Without it UCX progresses only when vLLM polls its transfers and
   notifications, once per engine step: a decode engine steps while it waits for KV and
   a prefill engine while it holds KV for a reader, and the reads are one-sided, so the
   CPU config turns it off in both.  Hence ``VllmKvTransfer.progress_thread``.

3. The handshake listener fails loudly.  vLLM's engine core starts the NIXL side-channel
   listener in a thread and waits for it to bind; when the port is taken the thread dies
   with "Address already in use" and the wait never ends, so the engine hangs in its
   start.  Here a listener that cannot bind ends the wait and the start raises, naming
   the address; when this project picked the port (no ``side_channel_port`` configured)
   it moves to another free port instead (the port another process took between the
   pick and the bind), and the ``kv_transfer_params`` vLLM hands out carry the new one.

vLLM loads this module in its own worker process (``kv_connector_module_path``) and
looks the class up by the ``kv_connector`` name, so it keeps the name ``NixlConnector``
(vLLM's own checks for NIXL go by that name too).  Its switches travel in
``kv_connector_extra_config`` under the keys ``config.py`` defines.  Nothing happens at
import time.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

from splitserve.contracts.kit.procs import free_port

from .config import KEEP_MODEL_CORES, PROGRESS_THREAD, REPICK_SIDE_CHANNEL_PORT

# Ports tried when the picked side-channel port turns out taken.
BIND_TRIES = 5


def _without_progress_thread() -> None:
    """Make vLLM's NIXL worker build its agent config with ``enable_prog_thread=False``
    (vLLM exposes no setting for it).  Called in the worker process, before the agent
    exists; idempotent."""
    make = base_worker.nixl_agent_config
    if make is None or isinstance(make, functools.partial):
        return  # NIXL unavailable (vLLM reports it) or already done
    base_worker.nixl_agent_config = functools.partial(make, enable_prog_thread=False)


class _GuardedListener:
    """Wraps a NIXL scheduler's handshake listener (a thread target): an exception before
    the socket is bound is kept and the starter's wait released, instead of the thread
    dying with the starter waiting for ever."""

    def __init__(self, sched, repick: bool) -> None:
        self.sched = sched
        self.repick = repick
        self.listen = sched._nixl_handshake_listener
        self.error: BaseException | None = None
        self.address = ""

    def __call__(self, encoded, ready: threading.Event, stop: threading.Event, host: str,
                 port: int) -> None:
        for attempt in range(BIND_TRIES):
            self.address = f"{host}:{port}"
            try:
                self.listen(encoded, ready, stop, host, port)
                return
            except Exception as exc:  # noqa: BLE001 - kept and raised by the starter
                if ready.is_set():
                    raise  # it failed while serving; vLLM's thread reports that itself
                self.error = exc
                if not self.repick or attempt == BIND_TRIES - 1:
                    break
                taken, port = port, free_port(host)
                self.sched.side_channel_port = port
                print(f"splitserve: NIXL side-channel port {taken} could not be bound "
                      f"({exc}); listening on {port}", file=sys.stderr, flush=True)
                self.error = None
        ready.set()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"vLLM's NIXL handshake listener could not listen on "
                               f"{self.address}: {self.error}") from self.error


class NixlConnector(_VllmNixlConnector):
    """vLLM's pull-mode NixlConnector; only the thread placement and the agent's progress
    thread differ, as the switches in ``kv_connector_extra_config`` say."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        extra = vllm_config.kv_transfer_config
        keep = None
        if role == KVConnectorRole.WORKER:
            if not extra.get_from_extra_config(PROGRESS_THREAD, True):
                _without_progress_thread()
            if extra.get_from_extra_config(KEEP_MODEL_CORES, False):
                keep = os.sched_getaffinity(0)
        super().__init__(vllm_config, role, kv_cache_config)
        self._listener: _GuardedListener | None = None
        if role == KVConnectorRole.SCHEDULER and self.connector_scheduler is not None:
            self._listener = _GuardedListener(
                self.connector_scheduler,
                bool(extra.get_from_extra_config(REPICK_SIDE_CHANNEL_PORT, False)))
            self.connector_scheduler._nixl_handshake_listener = self._listener
        if keep is not None:
            moved = os.sched_getaffinity(0)
            if moved != keep:
                os.sched_setaffinity(0, keep)
                # stderr reaches the replica's log whatever vLLM's logging config is
                print(f"splitserve: vLLM's NIXL worker moved the model thread to cores "
                      f"{sorted(moved)}; put back on {sorted(keep)}", file=sys.stderr,
                      flush=True)

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        """vLLM's, which starts the handshake listener; raises when it could not bind."""
        super().set_xfer_handshake_metadata_pp_aware(metadata)
        if self._listener is not None:
            self._listener.check()
