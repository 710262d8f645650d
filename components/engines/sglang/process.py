"""What one ``sglang.Engine`` does to the process it runs in, and the guards around it.

- Signals: on its first request SGLang's ``TokenizerManager.auto_create_handle_loop``
  registers its own SIGTERM handler with ``loop.add_signal_handler``, which replaces the
  worker's: a SIGTERM would then end the process without deregistering, draining or
  settling prefill jobs.  ``keep_worker_signal_handlers`` makes later registrations for
  SIGTERM/SIGINT on the loop no-ops (logged); the worker's handler stays, and the
  worker's shutdown stops SGLang itself.  Dynamo's SGLang worker guards the same way.
- One engine per process: SGLang keeps one live server config per process (the last
  engine built wins) and ``Engine.shutdown`` kills the process's whole child tree,
  siblings included.  ``claim_process`` refuses a second live engine.
- Disaggregation timeouts: SGLang reads its bootstrap and waiting timeouts from the
  environment of the engine's processes; ``disagg_timeout_env`` gives the variables for
  the configured values.
- KV manager host: SGLang's KV manager binds and advertises the one address in
  ``SGLANG_HOST_IP``; ``check_kv_host`` refuses one this machine cannot bind before
  SGLang fails on it deep in a scheduler process.
- Logging config: SGLang's processes read a logging config file named by
  ``SGLANG_LOGGING_CONFIG_PATH`` as they start; ``sglang_logging_config`` writes Dynamo's
  (SGLang's loggers into Dynamo's log handler) for the engine's start and removes it after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from splitserve.contracts.kit.procs import free_port

log = logging.getLogger("splitserve.sglang")

GUARDED = (signal.SIGTERM, signal.SIGINT)

KV_HOST_VARIABLE = "SGLANG_HOST_IP"
"""Read by SGLang's ``get_local_ip_auto``: the address its KV manager binds and names to
its peers."""

_live_engine: list[str] = []


def keep_worker_signal_handlers(loop: asyncio.AbstractEventLoop) -> None:
    """Called once before the engine starts, on the loop the worker registered its
    SIGTERM/SIGINT handlers on; later registrations for those signals are dropped."""
    if getattr(loop, "_splitserve_signal_guard", False):
        return
    original = loop.add_signal_handler

    def add_signal_handler(sig: int, callback: Any, *args: Any) -> None:
        if sig in GUARDED:
            log.info("kept the worker's handler for signal %s (SGLang asked for %r)",
                     sig, getattr(callback, "__qualname__", callback))
            return None
        return original(sig, callback, *args)

    loop.add_signal_handler = add_signal_handler  # type: ignore[method-assign]
    loop._splitserve_signal_guard = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def keep_worker_logging():
    """Keep the worker's own logging across SGLang's start.  ``sglang.Engine`` calls its
    ``configure_logger``, which runs ``logging.basicConfig(force=True)`` at the engine's
    ``log_level``: the worker's root handlers are removed and its INFO lines (requests
    refused, the adapters loaded, the drain) go unseen.  The root logger's handlers and
    level are put back as they were; SGLang's own loggers keep their levels."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)


LOGGING_CONFIG_VARIABLE = "SGLANG_LOGGING_CONFIG_PATH"


@contextlib.contextmanager
def sglang_logging_config():
    """Dynamo's logging config for SGLang, in a file that lives only while the engine
    starts (its scheduler and detokenizer processes read it as they start).  Dynamo's
    own logging setup writes this file in every process and never removes it, so
    components skip that (``DYN_SKIP_SGLANG_LOG_FORMATTING``) and this engine writes its
    own.  A path the environment names already is used as it is and left alone."""
    if os.environ.get(LOGGING_CONFIG_VARIABLE):
        yield
        return
    from dynamo.runtime.logging import configure_sglang_logging, log_level_mapping

    configure_sglang_logging(log_level_mapping(os.environ.get("DYN_LOG", "info")))
    path = os.environ.get(LOGGING_CONFIG_VARIABLE)
    try:
        yield
    finally:
        os.environ.pop(LOGGING_CONFIG_VARIABLE, None)
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)


def claim_process(label: str) -> None:
    """Called before an ``sglang.Engine`` is built; raises if one is live here."""
    if _live_engine:
        raise RuntimeError(
            f"an SGLang engine ({_live_engine[0]}) already runs in this process; SGLang "
            f"keeps one live config per process and its shutdown kills every child of "
            f"the process, so {label} must run in a process of its own")
    _live_engine.append(label)


def release_process() -> None:
    """Called after the engine has shut down."""
    _live_engine.clear()


def disagg_timeout_env(bootstrap_timeout_s: int, waiting_timeout_s: int) -> dict[str, str]:
    """SGLang's environment variables for its disaggregation timeouts (seconds)."""
    return {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(bootstrap_timeout_s),
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(waiting_timeout_s)}


def check_kv_host(host: str) -> None:
    """Called before a disaggregated engine starts: raises unless ``host`` (the
    advertise host, which SGLang's KV manager also binds) is an address of this
    machine."""
    try:
        free_port(host)
    except OSError as exc:
        raise RuntimeError(
            f"SGLang's KV manager binds and advertises one address ({KV_HOST_VARIABLE}"
            f" = the advertise host {host!r}), and this machine cannot bind it ({exc}): "
            "give an address of this machine that the other engines reach") from None
