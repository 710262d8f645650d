"""`dynamo serve`: infrastructure, supervisor, control endpoint and status display."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from splitserve.infra.embedded import EmbeddedInfra, InfraEndpoints
from splitserve.serve.control import ControlServer, supervisor_handler
from splitserve.contracts.kit.component import SKIP_SGLANG_LOGGING
from splitserve.contracts.kit.files import write_json_whole
from splitserve.contracts.kit.credentials import (
    CONTROL_TOKEN_FILE,
    POLICY_KEY_FILE,
    read_secret,
    write_secret,
)
from splitserve.serve.hosts import host_listener_env
from splitserve.serve.plan import ServePlan
from splitserve.serve.supervisor import Supervisor, bind_http_listeners

STATE_STYLE = {"ready": "green", "starting": "yellow", "loading": "yellow",
               "restarting": "magenta", "failed": "red", "exited": "red", "stopping": "cyan"}


def status_table(rows: list[dict], title: str) -> Table:
    """Rich table of replicas: component, replica, pid, state, endpoint."""
    t = Table(title=title, expand=False)
    for col in ("component", "replica", "pid", "state", "endpoint", "restarts"):
        t.add_column(col)
    for r in rows:
        state = r["state"] + (f" ({r['detail']})" if r.get("detail") else "")
        t.add_row(r["component"], str(r["replica"]), str(r["pid"] or "-"),
                  f"[{STATE_STYLE.get(r['state'], 'white')}]{state}[/]", r["endpoint"] or "-",
                  str(r["restarts"]))
    return t


async def serve(plan: ServePlan, run_dir: Path, external: InfraEndpoints | None,
                control_port: int = 0, live_status: bool | None = None,
                registry_dir: Path | None = None, console: Console | None = None,
                ready_file: Path | None = None, access_env: dict[str, str] | None = None,
                policy_key_file: Path | None = None,
                listeners: dict[str, socket.socket] | None = None) -> int:
    """Run the plan until SIGINT/SIGTERM or a permanent failure; return the exit code.

    ``access_env`` holds the credentials/TLS variables of external etcd and NATS;
    ``policy_key_file`` the operator's policy signing key (default: a new one per run);
    ``listeners`` the frontend's sockets (``bind_http_listeners``; default: bound here).
    """
    console = console or Console()
    live_status = console.is_terminal if live_status is None else live_status
    started = time.monotonic()
    if listeners is None:  # raises ListenerError before anything starts
        listeners = bind_http_listeners(plan)
    token, policy_key_file = _prepare_secrets(run_dir, policy_key_file)
    infra = None
    if external is None:
        infra = EmbeddedInfra(run_dir / "infra")
        endpoints = await asyncio.to_thread(infra.start)
        console.print(f"[bold]infra[/] embedded etcd {endpoints.etcd}, NATS {endpoints.nats} "
                      f"(pids {infra.pids()})")
    else:
        endpoints = external
        console.print(f"[bold]infra[/] external etcd {endpoints.etcd}, NATS {endpoints.nats}")
    if plan.only:
        console.print(f"[bold]this host[/] runs {', '.join(plan.only)} on "
                      f"{plan.common.bind_host}; the rest of the graph runs elsewhere")
    env = {**endpoints.env(), **(access_env or {}), **host_listener_env(plan.common.bind_host),
           "SPLITSERVE_POLICY_KEY_FILE": str(policy_key_file),
           "SPLITSERVE_CONTROL_TOKEN_FILE": str(run_dir / CONTROL_TOKEN_FILE),
           "DYN_LOG": os.environ.get("DYN_LOG", "warn"),
           # Dynamo's processes (a mocker's too) would each leave a logging config for
           # SGLang in the temporary folder; an SGLang engine writes its own.
           SKIP_SGLANG_LOGGING: os.environ.get(SKIP_SGLANG_LOGGING, "1")}

    def printer(prefix: str, line: str) -> None:
        console.out(f"{prefix:>14} | {line}", highlight=False)

    sup = Supervisor(plan, run_dir, env, printer=printer, infra=infra, endpoints=endpoints,
                     listeners=listeners)
    control = ControlServer(supervisor_handler(sup, plan.to_dict()), token, port=control_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.stop_requested.set)
    reg_file = None
    try:
        await control.start()
        sup.env["SPLITSERVE_CONTROL_URL"] = control.url  # the planner's local connector
        info = {"pid": os.getpid(), "control": control.url, "graph": plan.graph_ref,
                "config": plan.source, "namespace": plan.common.namespace,
                "model": plan.common.model, "served_model_name": plan.common.served_model_name,
                "models": {c.served_model_name: {"namespace": c.namespace, "model": c.model}
                           for c in [plan.common, *plan.pools.values()]},
                "etcd": endpoints.etcd, "nats": endpoints.nats, "run_dir": str(run_dir),
                "token_file": str(run_dir / CONTROL_TOKEN_FILE),
                "policy_key_file": str(policy_key_file),
                "bind_host": plan.common.bind_host, "only": plan.only}
        reg_file = _publish_run_info(info, run_dir, registry_dir)
        console.print(f"[bold]control[/] {control.url}  (run dir {run_dir})")
        await sup.start()
        await _watch_until_stop(sup, console, live_status, started, plan, ready_file)
    finally:
        console.print("[bold]shutting down[/] (frontend first, infrastructure last)")
        await sup.shutdown()
        await control.stop()
        if infra is not None:
            await asyncio.to_thread(infra.stop)
        if reg_file:
            reg_file.unlink(missing_ok=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    code = sup.exit_code()
    console.print(f"[bold]stopped[/] exit code {code}")
    if code == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _prepare_secrets(run_dir: Path, policy_key_file: Path | None) -> tuple[str, Path]:
    """Write this run's control token (and its policy key unless one is given); returns
    the token and the policy key's absolute path.  Fails now, not in every replica, when
    the key is unusable."""
    token = write_secret(run_dir / CONTROL_TOKEN_FILE)
    if policy_key_file is None:
        policy_key_file = run_dir / POLICY_KEY_FILE
        write_secret(policy_key_file)
    read_secret(policy_key_file)
    return token, Path(policy_key_file).resolve()


def _write_json(path: Path, data: dict) -> None:
    """Write ``path`` whole: readers (`dynamo status`, whoever waits for the ready file)
    never see a truncated one."""
    write_json_whole(path, data, indent=2)


def _publish_run_info(info: dict, run_dir: Path, registry_dir: Path | None) -> Path | None:
    """Write the run's control info into its run directory and, when given, the local
    registry that `dynamo status` reads; returns the registry file (removed at exit)."""
    _write_json(run_dir / "control.json", info)
    if not registry_dir:
        return None
    registry_dir.mkdir(parents=True, exist_ok=True)
    reg_file = registry_dir / f"{os.getpid()}.json"
    _write_json(reg_file, info)
    return reg_file


async def _watch_until_stop(sup: Supervisor, console: Console, live_status: bool,
                            started: float, plan: ServePlan, ready_file: Path | None) -> None:
    announced = False
    last: dict[str, str] = {}
    title = f"{plan.graph_ref} ({plan.source})"
    live = Live(status_table(sup.snapshot(), title), console=console, refresh_per_second=2,
                transient=False) if live_status else None
    if live:
        live.start()
    try:
        while not sup.stop_requested.is_set():
            rows = sup.snapshot()
            if live:
                live.update(status_table(rows, title))
            else:
                for r in rows:
                    key = f"{r['component']}-{r['replica']}"
                    if last.get(key) != r["state"]:
                        last[key] = r["state"]
                        ep = f" endpoint {r['endpoint']}" if r["endpoint"] else ""
                        console.out(f"{'supervisor':>14} | {key} {r['state']} "
                                    f"(pid {r['pid']}){ep}", highlight=False)
            if not announced and sup.all_ready():
                announced = True
                console.out(f"{'supervisor':>14} | graph ready in "
                            f"{time.monotonic() - started:.1f}s", highlight=False)
                if ready_file:
                    _write_json(ready_file, {"ready": True, "rows": rows})
            try:
                await asyncio.wait_for(sup.stop_requested.wait(), 0.25)
            except TimeoutError:
                pass
    finally:
        if live:
            live.stop()
