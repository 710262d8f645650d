"""The `dynamo serve` supervisor: runs a ServePlan as OS processes.

It starts each replica as its own process, streams its output with a prefix, tracks the
state each replica reports, restarts a replica that dies with a bounded, doubling
backoff, scales components on request (the control endpoint), and shuts down in order
(lowest ``shutdown_rank`` first: frontend, router, workers) with one deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from splitserve.contracts.kit.health import DependencyTracker, Prober
from splitserve.contracts.kit.procs import STACK_DUMP_SIGNAL, with_parent_death
from splitserve.contracts.kit.shared_listener import (
    LISTEN_EARLY_VAR,
    LISTEN_FD_VAR,
    bind_listener,
    stop_accepting_new,
)
from splitserve.serve.plan import ComponentPlan, ServePlan

log = logging.getLogger("splitserve.supervisor")

CLEAN_EXIT = {0, -signal.SIGTERM, -signal.SIGINT}

# Dynamo 1.6.1 logs a "route request completed" span event at INFO for every request a
# client makes, whatever DYN_LOG says.  At 100 req/s that is hundreds of lines a second;
# they still go to the replica's log file but not to the console.
_CONSOLE_NOISE = (b"request_span", b"route request completed")

# Dynamo 1.6.1's runtime logs this ERROR when it gave up reconnecting to etcd (about 20 s
# into an outage) and its lease is gone: its registrations are deleted, its handlers
# stop, and it never registers again, though the process keeps running.
LEASE_LOST = b"Unable to maintain lease"

# Beyond a replica's own drain: deregistration, its engine's stop and its runtime's exit.
DRAIN_MARGIN_S = 10.0

# Lines a log pump copies before it lets the event loop run other tasks.
_YIELD_EVERY = 64
LEASE_LOST_GRACE_S = 3.0


# What Dynamo 1.6.1's runtime logs while a process it runs in stops: its clients' etcd
# watches end before the runtime's last task (WARN, and in some processes one ERROR) and
# a served endpoint's loop returns (WARN).  Expected then, so kept off the console of a
# replica being stopped (its log file keeps them); at any other time they are shown.
_STOP_NOISE = (b"Instance removal watcher stream ended",
               b"Failed to start instance removal watcher",
               b"Endpoint service completed unexpectedly",
               b"KeyValueStoreManager.watch receiver closed")


def console_worthy(raw: bytes, verbose: bool, stopping: bool = False) -> bool:
    """Whether a child's log line is shown on the console (all are kept in its log file);
    ``stopping``: the replica is being stopped (the graph's stop or a scale-down)."""
    if verbose:
        return True
    if stopping and any(marker in raw for marker in _STOP_NOISE):
        return False
    return not all(marker in raw for marker in _CONSOLE_NOISE)


STACK_DUMP_WAIT_S = 1.0


async def kill_with_stacks(procs: list) -> None:
    """SIGKILL the process groups of ``procs`` (replicas that overran a stop deadline),
    first asking each for its threads' stacks (``STACK_DUMP_SIGNAL``) and giving the
    dump ``STACK_DUMP_WAIT_S`` to reach the log: a hang at shutdown names where it hung."""
    procs = [p for p in procs if p.returncode is None]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, STACK_DUMP_SIGNAL)
    if procs:
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs],
                           timeout=STACK_DUMP_WAIT_S)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


@dataclass
class Replica:
    """One running (or restarting) process of a component."""

    component: str
    index: int
    status_file: Path
    config_file: Path
    proc: asyncio.subprocess.Process | None = None
    state: str = "pending"
    endpoint: str = ""
    detail: str = ""
    metrics: str = ""
    restarts: deque = field(default_factory=deque)
    retiring: bool = False
    recycling: bool = False  # stopped on purpose to register again: respawn at once
    lease_lost: bool = False  # its Dynamo runtime lost the etcd lease (seen in its log)
    killed: bool = False
    exit_code: int | None = None
    log_task: asyncio.Task | None = None
    model: str = ""
    """The served model name(s) of its pool (the frontend's: every model it serves)."""

    @property
    def name(self) -> str:
        return f"{self.component}-{self.index}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def as_dict(self) -> dict:
        return {"component": self.component, "replica": self.index, "pid": self.pid,
                "state": self.state, "endpoint": self.endpoint, "detail": self.detail,
                "metrics": self.metrics, "model": self.model,
                "restarts": len(self.restarts), "exit_code": self.exit_code}


def removal_order(live: list[Replica]) -> list[Replica]:
    """Which replicas a scale-down removes first: those not ready (starting, loading,
    restarting hold no requests; removing a ready one cuts its streams), then the
    newest."""
    return sorted(live, key=lambda r: (r.state == "ready", -r.index))


class ListenerError(OSError):
    """A component's HTTP address cannot be listened on; the message names the field."""


# When the graph stops: how long the frontend's replicas get to accept what waits in
# the shared socket's accept queue once new connections are dropped.
LISTENER_DRAIN_S = 1.0


def bind_http_listeners(plan: ServePlan) -> dict[str, socket.socket]:
    """One listening socket per component of ``plan`` that serves an HTTP API (the
    frontend), bound before anything starts and shared by all its replicas; raises
    ListenerError naming the section's field (the port is busy, the host not local)."""
    bound: dict[str, socket.socket] = {}
    for comp in plan.components:
        addr = comp.config.http_listener(comp.common or plan.common)
        if addr is None:
            continue
        host, port = addr
        try:
            bound[comp.name] = bind_listener(host, port)
        except OSError as exc:
            for sock in bound.values():
                sock.close()
            field_ = "port" if port and exc.errno == errno.EADDRINUSE else "host"
            raise ListenerError(f"{comp.component}.{field_}: cannot listen on {host}:{port}: "
                                f"{exc.strerror or exc}") from None
    return bound


class Supervisor:
    """Executes a plan.  ``run()`` returns the process exit code for `dynamo serve`.

    ``listeners``: the sockets of ``bind_http_listeners``, by component; each replica of
    such a component inherits its socket (the supervisor closes them after the graph
    stopped)."""

    def __init__(self, plan: ServePlan, run_dir: Path, env: dict[str, str],
                 printer: Callable[[str, str], None] | None = None, *,
                 infra=None, endpoints=None,
                 prober: Callable[[str, str, float], dict[str, bool]] | None = None,
                 listeners: dict[str, socket.socket] | None = None) -> None:
        self.plan = plan
        self.listeners = dict(listeners or {})
        self.run_dir = Path(run_dir)
        self.env = env
        self.printer = printer or (lambda prefix, line: print(f"{prefix} | {line}", flush=True))
        self.replicas: dict[str, list[Replica]] = {c.name: [] for c in plan.components}
        self.stop_requested = asyncio.Event()
        self.failed: list[str] = []
        self.shutting_down = False
        self._watchers: set[asyncio.Task] = set()
        self._next_index: dict[str, int] = {c.name: 0 for c in plan.components}
        # Dependencies: ``infra`` is the EmbeddedInfra this supervisor may restart (None
        # for external servers, which are only watched); ``endpoints`` what to probe.
        self.infra = infra
        self.endpoints = endpoints
        self.prober = prober if prober is not None else Prober()
        self.deps = DependencyTracker()
        self.deps_up = asyncio.Event()
        self.deps_up.set()
        if plan.common.infra.etcd_lease_ttl_s is not None:
            self.env["ETCD_LEASE_TTL"] = str(plan.common.infra.etcd_lease_ttl_s)
        (self.run_dir / "status").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "configs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    # ---- starting and watching replicas -------------------------------------------------
    def _model_of(self, comp: ComponentPlan) -> str:
        """What ``dynamo status`` shows in the model column: the pool's served name, or
        for the graph's root (the frontend) every model it serves."""
        if comp.common is not None:
            return comp.common.served_model_name
        if self.plan.pools and comp.name == self.plan.root:
            return ", ".join(self.plan.served_models())
        return self.plan.common.served_model_name

    def _new_replica(self, comp: ComponentPlan) -> Replica:
        idx = self._next_index[comp.name]
        self._next_index[comp.name] += 1
        status = self.run_dir / "status" / f"{comp.name}-{idx}.json"
        cfg_file = self.run_dir / "configs" / f"{comp.name}-{idx}.json"
        cfg = self.plan.run_config(comp, idx, status)
        cfg_file.write_text(cfg.model_dump_json(indent=2))
        rep = Replica(component=comp.name, index=idx, status_file=status, config_file=cfg_file,
                      model=self._model_of(comp))
        self.replicas[comp.name].append(rep)
        return rep

    async def _spawn(self, rep: Replica) -> None:
        comp = self.plan.component(rep.component)
        env = {**os.environ, **self.env, **comp.config.env,
               **self.plan.replica_env(comp, rep.index),  # its GPUs, when assigned
               "PYTHONUNBUFFERED": "1", "SPLITSERVE_REPLICA": rep.name}
        pass_fds: tuple[int, ...] = ()
        listener = self.listeners.get(comp.name)
        if listener is not None:  # the API's socket, shared by every replica
            pass_fds = (listener.fileno(),)
            env[LISTEN_FD_VAR] = str(listener.fileno())
            if comp.config.replicas <= 1:  # the only replica accepts while it loads
                env[LISTEN_EARLY_VAR] = "1"
        rep.status_file.unlink(missing_ok=True)
        rep.proc = await asyncio.create_subprocess_exec(
            *with_parent_death(self.plan.argv(comp, rep.config_file)), env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
        rep.state, rep.exit_code, rep.killed, rep.lease_lost = "starting", None, False, False
        rep.log_task = asyncio.create_task(self._pump_logs(rep, self._log_file(rep)))
        self._track(asyncio.create_task(self._watch(rep, rep.proc)))

    def _track(self, task: asyncio.Task) -> None:
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    def _log_file(self, rep: Replica) -> BinaryIO:
        """The replica's log file, opened for appending (restarts add to it)."""
        return open(self.run_dir / "logs" / f"{rep.name}.log", "ab")

    async def _pump_logs(self, rep: Replica, log_file: BinaryIO) -> None:
        """Copy the replica's output to its log file and the console until it closes.

        Lines already buffered are read without suspending, so a replica (or an engine
        process of its) that logs without pause would keep this loop from giving the
        event loop back: it yields every ``_YIELD_EVERY`` lines, so the control endpoint
        and the other replicas' watchers keep running during a flood.
        """
        assert rep.proc and rep.proc.stdout
        verbose = self.plan.common.log_level == "debug"
        with log_file as f:
            lines = 0
            async for raw in rep.proc.stdout:
                f.write(raw)
                if LEASE_LOST in raw:
                    rep.lease_lost = True
                stopping = (self.stop_requested.is_set() or rep.retiring
                            or rep.state == "stopping")
                if console_worthy(raw, verbose, stopping):
                    self.printer(rep.name, raw.decode(errors="replace").rstrip())
                lines += 1
                if lines % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)

    async def _exit_code(self, proc: asyncio.subprocess.Process, grace_s: float = 2.0) -> int:
        """The replica's exit code.  asyncio's ``wait()`` also waits for the replica's
        output pipe to close, which children that outlive it keep open (an engine's own
        processes after the replica was SIGKILLed): once the replica itself has exited
        and its pipe stays open for ``grace_s``, the rest of its process group (its own
        session) is killed, so the exit is seen and the replica restarted."""
        waiter = asyncio.ensure_future(proc.wait())
        exited_at = None
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.25)
            if waiter.done() or proc.returncode is None:
                continue
            exited_at = exited_at or time.monotonic()
            if time.monotonic() - exited_at >= grace_s:
                self.printer("supervisor", f"pid {proc.pid} exited; stopping the processes "
                             "it left behind")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.wait({waiter}, timeout=5)
                break
        return waiter.result() if waiter.done() else proc.returncode

    async def _watch(self, rep: Replica, proc: asyncio.subprocess.Process) -> None:
        code = await self._exit_code(proc)
        if rep.log_task:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(rep.log_task, 2)
        rep.exit_code = code
        if self.shutting_down or rep.retiring:
            rep.state = "stopped" if code in CLEAN_EXIT and not rep.killed else "killed"
            return
        rep.state = "exited"
        self.printer("supervisor", f"{rep.name} (pid {proc.pid}) exited with code {code}")
        if rep.recycling:
            rep.recycling = False
            await self._spawn(rep)
            return
        if await self._hold_for_dependencies(rep):
            return
        policy = self.plan.common.restart
        now = time.monotonic()
        while rep.restarts and now - rep.restarts[0] > policy.window_s:
            rep.restarts.popleft()
        if len(rep.restarts) >= policy.max_restarts:
            rep.state = "failed"
            self.failed.append(rep.name)
            self.printer("supervisor", f"{rep.name} failed {len(rep.restarts) + 1} times within "
                         f"{policy.window_s:.0f}s; shutting the graph down")
            self.stop_requested.set()
            return
        delay = min(policy.backoff_initial_s * (2 ** len(rep.restarts)), policy.backoff_max_s)
        rep.restarts.append(now)
        rep.state = "restarting"
        rep.detail = f"in {delay:.1f}s"
        self.printer("supervisor", f"restarting {rep.name} in {delay:.1f}s "
                     f"(restart {len(rep.restarts)}/{policy.max_restarts})")
        await asyncio.sleep(delay)
        if not (self.shutting_down or rep.retiring):
            await self._spawn(rep)

    async def _hold_for_dependencies(self, rep: Replica) -> bool:
        """While etcd or NATS is down, restart ``rep`` only once they are back.

        A replica that exits because its dependency went away (Dynamo's runtime ends the
        process when its etcd lease is lost) would otherwise burn its restart budget and
        shut the graph down, or start against a dead server and hang in "starting".  Such
        restarts do not count against the budget.  Returns True when it respawned ``rep``
        (or gave up because the graph is stopping).
        """
        await asyncio.sleep(0)  # let a concurrent probe round record the outage first
        if self.deps_up.is_set():
            return False
        rep.state, rep.detail = "waiting", "for " + ", ".join(self.deps.down())
        self.printer("supervisor", f"{rep.name} waits for {', '.join(self.deps.down())} "
                     "before restarting")
        await self.deps_up.wait()
        if not (self.shutting_down or rep.retiring):
            await self._spawn(rep)
        return True

    def _recycle_lease_lost(self) -> None:
        """Restart the replicas whose runtime lost its etcd lease, once etcd is back.

        Such a process still runs but is invisible to discovery and serves nothing; a
        restart registers it anew.  This includes the frontend: its runtime's clients
        died with the lease.  A SIGTERM drains it for ``LEASE_LOST_GRACE_S`` (requests in
        flight fail fast there, with an error, as its runtime is gone), then it is killed
        rather than left to wait out its full shutdown deadline; the new process listens
        on the configured port again.
        """
        reps = [r for reps in self.replicas.values() for r in reps
                if r.lease_lost and not r.retiring and r.proc and r.proc.returncode is None]
        if not reps:
            return
        self.printer("supervisor", "etcd lease lost by " + ", ".join(r.name for r in reps)
                     + "; restarting them to register again")
        for r in reps:
            r.lease_lost, r.recycling = False, True
            self._track(asyncio.create_task(self._stop_process(r, r.proc, LEASE_LOST_GRACE_S)))

    async def _stop_process(self, rep: Replica, proc, grace_s: float) -> None:
        """SIGTERM one process of ``rep``, SIGKILL its group after ``grace_s``.

        Bound to ``proc``, not to the replica: the replica may have a new process by then.
        """
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            self.printer("supervisor", f"{rep.name} (pid {proc.pid}) did not stop in "
                         f"{grace_s:.1f}s; killing")
            await kill_with_stacks([proc])

    async def watch_dependencies(self, interval_s: float, restart_delay_s: float) -> None:
        """Watch etcd and NATS until shutdown: reap, restart (embedded), report.

        Runs as a task for the life of the graph.  An embedded server that exited is
        reaped at once (no zombie), marked down, and started again on the same ports
        and data directory after ``restart_delay_s``; components reconnect to the same
        address.  External servers are probed only: their outage is reported (status,
        readiness) and replicas waiting for them restart when they answer again.
        """
        if self.endpoints is None:
            return
        down_since: dict[str, float] = {}
        while not self.shutting_down:
            now = time.monotonic()
            exited = self.infra.exited() if self.infra is not None else {}
            for name, code in exited.items():
                if self.deps.mark_down(name, now):
                    self.printer("supervisor", f"embedded {name} exited with code {code}; "
                                 f"restarting it in {restart_delay_s:.1f}s")
                down_since.setdefault(name, now)
            results = await asyncio.to_thread(self.prober, self.endpoints.etcd,
                                              self.endpoints.nats, min(1.0, max(0.2, interval_s)))
            results.update({name: False for name in exited})
            for name in self.deps.update(results):
                up = results[name]
                self.printer("supervisor", f"dependency {name} is {'up again' if up else 'down'}")
                if not up:
                    down_since.setdefault(name, now)
            if self.deps.states["etcd"].up:
                self._recycle_lease_lost()
            for name in list(exited):
                if not self.shutting_down and \
                        time.monotonic() - down_since[name] >= restart_delay_s:
                    await self._restart_embedded(name)
            for name in [n for n in down_since if self.deps.states[n].up]:
                down_since.pop(name)
            if self.deps.down():
                self.deps_up.clear()
            else:
                self.deps_up.set()
            await asyncio.sleep(interval_s)

    async def _restart_embedded(self, name: str) -> None:
        """Start the embedded server ``name`` again; a failure is reported and retried on
        the next round of ``watch_dependencies``."""
        try:
            pid = await asyncio.to_thread(self.infra.restart, name)
        except Exception as exc:  # noqa: BLE001 - report and try again next round
            self.printer("supervisor", f"restarting embedded {name} failed: {exc}")
            return
        self.deps.states[name].restarts += 1
        self.printer("supervisor", f"embedded {name} restarted (pid {pid})")

    def dependency_rows(self) -> list[dict]:
        """Rows of etcd/NATS health for the control endpoint and `dynamo status`."""
        embedded = self.infra is not None
        return [{**row, "embedded": embedded} for row in self.deps.rows()]

    def refresh_states(self) -> None:
        """Read the state files the replicas write (cheap: a few small files)."""
        for reps in self.replicas.values():
            for rep in reps:
                if rep.state not in ("starting", "loading", "ready", "stopping") or not rep.proc:
                    continue
                try:
                    data = json.loads(rep.status_file.read_text())
                except (OSError, ValueError):
                    continue
                if data.get("pid") != rep.pid:
                    continue
                rep.state = data.get("state", rep.state)
                rep.endpoint = data.get("endpoint", rep.endpoint)
                rep.detail = data.get("detail", "")
                rep.metrics = data.get("metrics", rep.metrics)

    def all_ready(self) -> bool:
        return all(r.state == "ready" for reps in self.replicas.values() for r in reps
                   if not r.retiring)

    def snapshot(self) -> list[dict]:
        """Rows of the status table (also served by the control endpoint)."""
        self.refresh_states()
        return [r.as_dict() for reps in self.replicas.values() for r in reps
                if not (r.retiring and r.state in ("stopped", "killed"))]

    # ---- scaling (control endpoint) -----------------------------------------------------
    async def scale(self, component: str, replicas: int) -> dict:
        """Add or remove replicas of ``component``.  Removal takes replicas that are not
        ready first (starting, loading, restarting: they hold no requests), then the
        newest; each removed replica drains."""
        if component not in self.replicas:
            raise KeyError(component)
        if self.shutting_down:
            raise RuntimeError("graph is shutting down")
        live = [r for r in self.replicas[component] if not r.retiring]
        comp = self.plan.component(component)
        comp.config.replicas = replicas  # before spawning: a new replica reads it
        for _ in range(replicas - len(live)):
            await self._spawn(self._new_replica(comp))
        for rep in removal_order(live)[:max(0, len(live) - replicas)]:
            rep.retiring = True
            self._track(asyncio.create_task(self._stop_replicas([rep], self.stop_grace_s(comp))))
        return {"component": component, "replicas": replicas}

    def stop_grace_s(self, comp: ComponentPlan) -> float:
        """How long a replica of ``comp`` removed by a scale-down may take to stop before
        it is killed: the graph's shutdown deadline, or the component's own drain plus
        ``DRAIN_MARGIN_S`` when that is longer, so a drain that would finish is never cut
        (what the drain leaves is resumed elsewhere by the frontend).  A replica with live
        KV moves also gets the time it keeps parked KV for the replicas that read it."""
        drain = getattr(comp.config, "drain_timeout_s", None)
        if drain is not None and getattr(comp.config, "kv_moves", False):
            drain += comp.config.kv_move_hold_s
        base = self.plan.common.shutdown_timeout_s
        return base if drain is None else max(base, drain + DRAIN_MARGIN_S)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start every replica, dependencies first."""
        for comp in self.plan.components:
            for _ in range(comp.replicas):
                await self._spawn(self._new_replica(comp))
        infra_policy = self.plan.common.infra
        self._track(asyncio.create_task(self.watch_dependencies(
            infra_policy.probe_interval_s, infra_policy.restart_delay_s)))

    async def _stop_replicas(self, reps: list[Replica], grace_s: float) -> None:
        live = [r for r in reps if r.proc and r.proc.returncode is None]
        for r in live:
            r.state = "stopping"
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGTERM)
        if not live:
            return
        waits = [asyncio.create_task(r.proc.wait()) for r in live]
        # Earlier shutdown ranks may have used up the overall deadline: these then get a
        # moment, and the message says the deadline passed rather than a negative time.
        wait_s = max(grace_s, 0.1)
        _, pending = await asyncio.wait(waits, timeout=wait_s)
        overran = [r for r in live if r.proc.returncode is None]
        why = (f"did not stop in {wait_s:.1f}s" if grace_s > 0.1 else
               "did not stop before the shutdown deadline (spent by earlier ranks)")
        for r in overran:
            r.killed = True
            self.printer("supervisor", f"{r.name} {why}; killing (its threads' stacks follow)")
        await kill_with_stacks([r.proc for r in overran])
        if pending:
            await asyncio.wait(pending, timeout=5)

    async def shutdown(self) -> None:
        """Stop everything in shutdown_rank order within one overall deadline."""
        self.shutting_down = True
        deadline = time.monotonic() + self.plan.common.shutdown_timeout_s
        await self._drain_listeners()
        ranks = sorted({c.shutdown_rank for c in self.plan.components})
        for rank in ranks:
            reps = [r for c in self.plan.components if c.shutdown_rank == rank
                    for r in self.replicas[c.name]]
            await self._stop_replicas(reps, deadline - time.monotonic())
        for t in list(self._watchers):
            t.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for sock in self.listeners.values():
            sock.close()

    async def _drain_listeners(self) -> None:
        """Drop new connections to the shared API sockets, and give the replicas still
        accepting ``LISTENER_DRAIN_S`` to take what waits in the accept queue (closing a
        listener resets what it still holds)."""
        await stop_accepting_new([sock.fileno() for sock in self.listeners.values()],
                                 LISTENER_DRAIN_S)

    def exit_code(self) -> int:
        """0 when every replica stopped cleanly and none failed, else 1."""
        if self.failed:
            return 1
        bad = [r.name for reps in self.replicas.values() for r in reps
               if r.killed or (r.exit_code is not None and r.exit_code not in CLEAN_EXIT)]
        if bad:
            self.printer("supervisor", "unclean exit: " + ", ".join(bad))
            return 1
        return 0
