"""The process side of a component: config, runtime, readiness and graceful shutdown.

Every component entrypoint is ``python -m <module> --config FILE`` and calls ``run(main)``.
``run`` builds Dynamo's DistributedRuntime (etcd discovery, TCP or NATS request plane,
NATS event plane) from the endpoints the supervisor put in the environment, turns
SIGTERM/SIGINT into ``ctx.stopping``, and shuts the runtime down after ``main`` returns,
which revokes this process's etcd lease so its registrations disappear.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel

from splitserve.contracts.kit.files import write_json_whole
from splitserve.contracts.kit.procs import STACK_DUMP_SIGNAL
from splitserve.contracts import tracing
from splitserve.contracts.kit.waiting import poll_until
from splitserve.contracts.config import LOOPBACK
from splitserve.contracts.config import ComponentRunConfig

log = logging.getLogger("splitserve.component")

C = TypeVar("C", bound=BaseModel)

# After a drain's deadline: how long handlers get to end their streams with a
# ``drained`` chunk before the runtime cancels them.
DRAIN_CUT_GRACE_S = 2.0


def endpoint_path(namespace: str, component: str, endpoint: str) -> str:
    """Dynamo endpoint path of a component's endpoint, e.g. ``dynamo.worker.generate``."""
    return f"{namespace}.{component.lower()}.{endpoint}"


@dataclass
class ComponentContext:
    """What a component's ``main`` gets: its config, the runtime and lifecycle hooks."""

    run: ComponentRunConfig
    runtime: Any
    stopping: asyncio.Event
    started_at: float = field(default_factory=time.time)
    metrics_url: str | None = None
    dependencies: Any = None  # DependencyMonitor of etcd and NATS (None without them)
    drain_cut: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a drain's deadline passed with requests still in flight: the handlers
    end each of them with a ``drained`` chunk so the frontend resumes it elsewhere."""

    def watch_dependencies(self) -> Callable[[], list[str]]:
        """Start probing etcd and NATS; returns a cheap ``down()`` naming those unreachable.

        Called by components that answer readiness (the frontend): a graph whose
        discovery or messaging is gone would not serve a request now.
        """
        if self.dependencies is None:
            return list
        self.dependencies.start()
        return self.dependencies.down

    @property
    def namespace(self) -> str:
        return self.run.common.namespace

    def config(self, model: type[C]) -> C:
        """This component's own section, validated into its config model."""
        return model.model_validate(self.run.config)

    async def follow_policy(self, component: str, instance: str,
                            apply_fn: Callable[[Any, int], Any]) -> Any:
        """Apply every live policy version to this component with ``apply_fn(policy,
        version)``, through the follower the supervisor named (``run.policy_follower``).

        Called once at start by components that follow policy versions (router, decode
        worker).  Returns the watcher (``await watcher.stop()`` at shutdown), or None when
        this process follows no policy store (a component started without a supervisor).
        """
        ref = self.run.policy_follower
        if not ref:
            return None
        module, _, attr = ref.partition(":")
        follow = getattr(importlib.import_module(module), attr)
        return await follow(self.namespace, component, instance, apply_fn)

    def endpoint(self, component: str, name: str):
        """A Dynamo endpoint in this graph's namespace."""
        return self.runtime.endpoint(endpoint_path(self.namespace, component, name))

    def serve_metrics(self, registry) -> str | None:
        """Expose ``registry`` at http://<Common.bind_host>:<port>/metrics; returns the URL.

        The port comes from the section's ``metrics_port`` (0 = free port, None = off);
        the URL is added to every later ``report`` so `dynamo status` can show it.
        """
        port = self.run.config.get("metrics_port", 0)
        if port is None:
            return None
        from prometheus_client import start_http_server

        host = self.run.common.bind_host
        server, _ = start_http_server(port, addr=host, registry=registry)
        shown = f"[{host}]" if ":" in host else host
        self.metrics_url = f"http://{shown}:{server.server_port}/metrics"
        return self.metrics_url

    def report(self, state: str, **extra: Any) -> None:
        """Publish this replica's state to the supervisor (atomic file replace).

        Called with "starting", "loading" (with progress), "ready" (with the endpoint it
        serves) and "stopping"; the supervisor's status table and readiness read it.
        """
        path = Path(self.run.status_file)
        payload = {"state": state, "pid": os.getpid(), "time": time.time(), **extra}
        if self.metrics_url:
            payload.setdefault("metrics", self.metrics_url)
        write_json_whole(path, payload)


SKIP_SGLANG_LOGGING = "DYN_SKIP_SGLANG_LOG_FORMATTING"
SELF_HOST_METADATA = "DYN_SELF_HOST_METADATA"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATEFMT = "%H:%M:%S"
ENGINE_LOGGERS = ("vllm", "gpu_memory_service")
"""Loggers Dynamo's logging setup gives a stderr handler of their own (vLLM's level is
``VLLM_LOGGING_LEVEL``'s, apart from ``DYN_LOG``)."""


def configure_logging(component: str, replica: int, level: str) -> None:
    """Plain one-line logs; the supervisor prefixes each line with the replica name.

    Dynamo's Rust side applies its DYN_LOG filter only once its logging is configured;
    without that call every request logs span events at INFO whatever DYN_LOG says, which
    costs real CPU on a busy 2-core box.  Python logging is then set up for our format.
    """
    os.environ.setdefault("DYN_LOG", "warn")
    # Dynamo would also write SGLang's logging config to a temporary file in every
    # process it configures, and never remove it (one file per replica start); only an
    # SGLang engine reads it, and that engine writes its own for its start
    # (components/engines/sglang/process.py, ``sglang_logging_config``).
    os.environ.setdefault(SKIP_SGLANG_LOGGING, "1")
    # Dynamo's runtime would serve each registered model's metadata from the process's
    # system port, which these processes do not open, and warns at every registration
    # that it keeps the metadata in etcd instead: what this project does anyway.
    os.environ.setdefault(SELF_HOST_METADATA, "0")
    from dynamo.runtime.logging import configure_dynamo_logging

    configure_dynamo_logging()
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt=LOG_DATEFMT,
                        force=True)
    # Dynamo formats vLLM's records with ANSI colours and its own timestamps, also into
    # the replica's log file and through the supervisor's pipe: the same one-line
    # format as every other line instead (the handler and its level are kept).
    plain = logging.Formatter(LOG_FORMAT, datefmt=LOG_DATEFMT)
    for name in ENGINE_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            handler.setFormatter(plain)


def load_run_config(argv: list[str] | None = None) -> ComponentRunConfig:
    """Parse ``--config FILE`` and validate it; exits with a message on a bad file."""
    parser = argparse.ArgumentParser(description="splitserve component process")
    parser.add_argument("--config", required=True, help="resolved component config (JSON)")
    parser.add_argument("--bind-host", help="override Common.bind_host (e.g. a pod's IP, "
                        "known only when the pod starts)")
    parser.add_argument("--advertise-host", help="override Common.advertise_host")
    args = parser.parse_args(argv)
    text = Path(args.config).read_text()
    run_cfg = ComponentRunConfig.model_validate_json(text)
    hosts = {k: v for k, v in (("bind_host", args.bind_host),
                               ("advertise_host", args.advertise_host)) if v}
    if hosts:
        common = type(run_cfg.common).model_validate(
            {**run_cfg.common.model_dump(mode="json"), **hosts})
        run_cfg = run_cfg.model_copy(update={"common": common})
    return run_cfg


def make_runtime(loop: asyncio.AbstractEventLoop, request_plane: str,
                 bind_host: str = LOOPBACK):
    """Create Dynamo's DistributedRuntime from ETCD_ENDPOINTS / NATS_SERVER in the env.

    Its listeners (request plane, response streams, ...) and UCX follow ``bind_host``
    (``Common.bind_host``; a pod passes its IP with ``--bind-host``) unless the
    environment already names them.  Returns the runtime."""
    from dynamo.runtime import DistributedRuntime

    from splitserve.contracts.kit.listeners import missing_listener_env

    env = missing_listener_env(bind_host, os.environ)
    if env:
        log.info("listeners: %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    os.environ.update(env)
    return DistributedRuntime(loop, "etcd", request_plane, event_plane="nats")


def dependency_monitor(run_cfg: ComponentRunConfig, environ) -> Any:
    """A monitor of the etcd and NATS this process uses, from the supervisor's variables.

    The supervisor hands every replica ETCD_ENDPOINTS and NATS_SERVER (Dynamo's runtime
    reads the same two); returns None when either is missing.
    """
    from splitserve.contracts.kit.health import DependencyMonitor

    etcd, nats = environ.get("ETCD_ENDPOINTS"), environ.get("NATS_SERVER")
    if not (etcd and nats):
        return None
    return DependencyMonitor(etcd, nats, interval_s=run_cfg.common.infra.probe_interval_s)


async def _amain(main: Callable[[ComponentContext], Awaitable[None]],
                 run_cfg: ComponentRunConfig) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    runtime = make_runtime(loop, run_cfg.common.request_plane, run_cfg.common.bind_host)
    ctx = ComponentContext(run=run_cfg, runtime=runtime, stopping=stopping,
                           dependencies=dependency_monitor(run_cfg, os.environ))
    ctx.report("starting")
    try:
        await main(ctx)
    finally:
        if ctx.dependencies is not None:
            await ctx.dependencies.stop()
        ctx.report("stopped")
        runtime.shutdown()
        # Give the runtime a moment to revoke its lease (deregistration) before exit.
        await asyncio.sleep(0.1)


def run(main: Callable[[ComponentContext], Awaitable[None]], argv: list[str] | None = None,
        runtime_env: Callable[[ComponentRunConfig], Mapping[str, str]] | None = None) -> None:
    """Entry point of a component process.

    ``runtime_env``: variables the component wants before Dynamo's runtime starts (from
    its own section), each set only where the environment does not name it already.

    Called from a process's ``__main__`` (``argv`` None: the command line), it does not
    return: once the component has stopped (drained, deregistered, its runtime shut
    down) the process leaves at once with ``os._exit``, its logs flushed.  Interpreter
    teardown adds nothing a stopped replica needs and, on a busy machine, costs seconds
    (collecting a model's tensors, torch's library finalisers) that the graph's shutdown
    deadline would otherwise have to absorb: replicas killed there were seen stuck in
    exactly that.  With ``argv`` given (tests), it returns.
    """
    exit_process = argv is None
    run_cfg = load_run_config(argv)
    for key, value in (runtime_env(run_cfg) if runtime_env else {}).items():
        os.environ.setdefault(key, value)
    configure_logging(run_cfg.component, run_cfg.replica, run_cfg.common.log_level)
    tracing.setup(run_cfg.component)  # off unless the OTEL_* variables ask for it
    # A replica that overruns its stop deadline gets this signal before SIGKILL: the
    # stacks of all its threads go to the log, so a hang names where it hung.
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    code = 0
    try:
        try:
            import uvloop

            uvloop.run(_amain(main, run_cfg))
        except ImportError:  # pragma: no cover - uvloop is a dependency
            asyncio.run(_amain(main, run_cfg))
    except SystemExit as exc:
        if not exit_process:
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        if not exit_process:
            raise
        traceback.print_exc()
        code = 1
    if exit_process:
        leave(code)
    tracing.shutdown()


def leave(code: int) -> NoReturn:
    """Flush the logs and standard streams, then end the process without interpreter
    teardown (``os._exit``).  What teardown would still have done that matters is done
    first: child processes started with ``multiprocessing`` (an engine's own, where its
    shutdown left any) are terminated, as multiprocessing's exit hook would."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(Exception):
            child.terminate()
    for child in children:
        with contextlib.suppress(Exception):
            child.join(2.0)
    tracing.shutdown()  # export the spans still buffered
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


async def serve_until_stopped(ctx: ComponentContext, endpoint, handler,
                              drain_timeout_s: float = 10.0, inflight: Callable[[], int] = lambda: 0
                              ) -> None:
    """Serve ``handler`` on ``endpoint`` until SIGTERM, then drain.

    On stop: deregister the instance first (routers stop sending new work), wait until
    ``inflight()`` reaches zero or ``drain_timeout_s`` passes; then set
    ``ctx.drain_cut`` (handlers end what is left with a ``drained`` chunk, which the
    frontend resumes on another worker) and give them ``DRAIN_CUT_GRACE_S`` to send it,
    then return so ``run`` shuts the runtime down.
    """
    task = asyncio.ensure_future(endpoint.serve_endpoint(handler, graceful_shutdown=True))
    stop_wait = asyncio.create_task(ctx.stopping.wait())
    done, _ = await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        stop_wait.cancel()
        task.result()  # serving ended on its own: surface the error
        return
    ctx.report("stopping")
    began = time.monotonic()
    log.info("stopping: deregistering, then draining %d requests in flight", inflight())
    try:
        await endpoint.unregister_endpoint_instance()
    except Exception as exc:  # noqa: BLE001 - deregistration is best effort at shutdown
        log.warning("deregistration failed: %s", exc)
    await poll_until(lambda: inflight() <= 0, drain_timeout_s)
    if inflight() > 0:
        log.info("drain deadline passed with %d requests in flight: handing them back",
                 inflight())
        ctx.drain_cut.set()
        await poll_until(lambda: inflight() <= 0, DRAIN_CUT_GRACE_S)
    log.info("stopping: drained in %.1fs", time.monotonic() - began)
    task.cancel()
