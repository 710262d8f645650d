"""`dynamo scale COMPONENT REPLICAS`: set a component's replicas on a local graph.

Talks to the `dynamo serve` supervisor's control endpoint with the run's bearer token
(read from its run directory, so only the user who started the graph can scale it).
Exit codes: 0 done; 1 no local graph or it did not answer; 2 usage; 4 no such component.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console

from splitserve.cli.paths import state_root
from splitserve.cli.status_cmd import local_supervisors
from splitserve.serve.control import control_request
from splitserve.contracts.kit.credentials import read_secret


def scale(
    component: str = typer.Argument(..., help="Component name, e.g. PrefillWorker."),
    replicas: int = typer.Argument(..., min=0, max=64, help="Replicas to run (0..64)."),
    pid: int | None = typer.Option(None, "--pid", help="The `dynamo serve` to talk to, by "
                                   "pid (default: the only local one)."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help="Root for local state."),
    json_out: bool = typer.Option(False, "--json", help="Print the reply as JSON."),
) -> None:
    """Scale a component of a local `dynamo serve` graph up or down (newest stop first)."""
    err = Console(stderr=True, soft_wrap=True)
    sups = [s for s in local_supervisors(state_root(state_dir)) if pid in (None, s["pid"])]
    if len(sups) != 1:
        what = "no local `dynamo serve` found" if not sups else \
            "several local graphs; choose one with --pid " + ", ".join(str(s["pid"]) for s in sups)
        err.print(f"error: {what}", markup=False, highlight=False)
        raise typer.Exit(1)
    info = sups[0]
    try:
        token = read_secret(info["token_file"])
        code, reply = control_request(info["control"], token, "POST",
                                      f"/v1/components/{component}/replicas",
                                      {"replicas": replicas}, timeout_s=30)
    except (KeyError, OSError, ValueError) as exc:
        err.print(f"error: cannot reach the supervisor (pid {info['pid']}): {exc}",
                  markup=False, highlight=False)
        raise typer.Exit(1) from None
    if code != 200:
        message = reply.get("error") if isinstance(reply, dict) else reply
        err.print(f"error: HTTP {code}: {message}", markup=False, highlight=False)
        raise typer.Exit(4 if code == 404 else 1)
    typer.echo(json.dumps(reply) if json_out else f"{component}: {replicas} replicas")
