"""`dynamo infra up|down|status`: embedded etcd + NATS for development."""

from __future__ import annotations

import json
import shutil

import typer
from rich.console import Console
from rich.table import Table

from splitserve.cli.console import cli_console
from splitserve.cli.paths import dev_infra_dir, state_root
from splitserve.infra.embedded import EmbeddedInfra, InfraEndpoints, InfraStartError, check_health
from splitserve.contracts.kit.procs import kill_pid, pid_alive

app = typer.Typer(help="Embedded etcd and NATS (JetStream) on 127.0.0.1 for development.",
                  no_args_is_help=True)

STATE_DIR = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                         help="Root for local state (default: a per-user temp dir).")


def _load(state_dir: str | None) -> dict | None:
    path = dev_infra_dir(state_root(state_dir)) / "infra.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _health(state: dict) -> dict[str, bool]:
    ep = InfraEndpoints(**state["endpoints"])
    alive = {name: pid_alive(pid) for name, pid in state["pids"].items()}
    probe = check_health(ep)
    return {name: alive.get(name, False) and probe.get(name, False) for name in ("etcd", "nats")}


@app.command()
def up(state_dir: str | None = STATE_DIR,
       json_out: bool = typer.Option(False, "--json", help="Print endpoints as JSON.")) -> None:
    """Start etcd and nats-server in the background and print their endpoints.

    Export the printed variables so `dynamo serve` and `dynamo status` use these servers.
    """
    state = _load(state_dir)
    if state and all(_health(state).values()):
        ep = InfraEndpoints(**state["endpoints"])
    else:
        if state:
            _stop(state)
        root = dev_infra_dir(state_root(state_dir))
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        infra = EmbeddedInfra(root, detached=True)
        try:
            ep = infra.start()
        except (InfraStartError, FileNotFoundError) as exc:
            Console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
            raise typer.Exit(1) from None
    if json_out:
        typer.echo(json.dumps({"etcd": ep.etcd, "nats": ep.nats}))
    else:
        typer.echo(f"export ETCD_ENDPOINTS={ep.etcd}\nexport NATS_SERVER={ep.nats}")


def _stop(state: dict) -> None:
    for name in ("nats", "etcd"):
        pid = state["pids"].get(name)
        if pid:
            kill_pid(pid, grace_s=5)


@app.command()
def down(state_dir: str | None = STATE_DIR) -> None:
    """Stop the servers started by `dynamo infra up` and delete their data."""
    state = _load(state_dir)
    if not state:
        typer.echo("no development infrastructure is running")
        return
    _stop(state)
    shutil.rmtree(dev_infra_dir(state_root(state_dir)), ignore_errors=True)
    typer.echo("stopped etcd and NATS")


@app.command()
def status(state_dir: str | None = STATE_DIR,
           json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")
           ) -> None:
    """Show whether the development servers run; exit 1 if not both are healthy."""
    state = _load(state_dir)
    health = _health(state) if state else {"etcd": False, "nats": False}
    if json_out:
        typer.echo(json.dumps({"running": state is not None, "healthy": health,
                               "endpoints": state["endpoints"] if state else None,
                               "pids": state["pids"] if state else None}))
    else:
        t = Table(title="development infrastructure")
        for col in ("server", "pid", "endpoint", "healthy"):
            t.add_column(col)
        for name in ("etcd", "nats"):
            pid = state["pids"].get(name) if state else None
            ep = state["endpoints"][name] if state else "-"
            t.add_row(name, str(pid or "-"), ep, "yes" if health[name] else "no")
        cli_console().print(t)
    if not all(health.values()):
        raise typer.Exit(1)
