"""What a worker does when its engine loop cannot continue: leave, so it is restarted.

A worker whose engine thread died would otherwise stay registered and "ready" while
answering every request with an error.  Leaving with a non-zero exit code hands the
problem to the supervisor, which restarts the replica with a fresh engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable

log = logging.getLogger("splitserve.worker")

ENGINE_FAILED_EXIT = 70
"""Exit code of a worker whose engine failed (EX_SOFTWARE); any non-zero code restarts it."""


async def leave_after_engine_failure(exc: BaseException, report: Callable[..., None],
                                     deregister: Callable[[], Awaitable[object]],
                                     exit: Callable[[int], object] = os._exit,
                                     timeout_s: float = 3.0) -> None:
    """Called once, on the event loop, when the engine loop died with ``exc``.

    Reports the replica "failed" (so it is no longer ready), deregisters its endpoint so
    routers and frontends stop choosing it (bounded by ``timeout_s``: a hung runtime must
    not keep the process alive), then ends the process with ``ENGINE_FAILED_EXIT``.
    ``os._exit`` rather than an exception: the serving loop and the runtime's shutdown
    may wait on the dead engine forever.
    """
    log.error("engine failed (%s: %s); leaving with exit code %d so the replica is "
              "restarted", type(exc).__name__, exc, ENGINE_FAILED_EXIT)
    try:
        report("failed", detail=f"engine failed: {type(exc).__name__}: {exc}")
    except Exception as report_exc:  # noqa: BLE001 - leaving matters more than reporting
        log.warning("could not report the failure: %s", report_exc)
    try:
        await asyncio.wait_for(deregister(), timeout_s)
    except Exception as dereg_exc:  # noqa: BLE001 - the lease expires on its own
        log.warning("deregistration after engine failure failed: %r", dereg_exc)
    sys.stdout.flush()
    sys.stderr.flush()
    exit(ENGINE_FAILED_EXIT)
