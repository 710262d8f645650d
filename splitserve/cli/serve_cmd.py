"""`dynamo serve GRAPH -f CONFIG [--Component.field=value ...]`."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import typer
from rich.console import Console

from splitserve.cli.paths import new_run_dir, registry_dir, state_root
from splitserve.contracts.kit.connect import EtcdAccess, NatsAccess
from splitserve.infra.embedded import resolve_endpoints
from splitserve.contracts.config import ConfigError
from splitserve.contracts.kit.credentials import read_secret
from splitserve.serve.graph import GraphError, load_graph
from splitserve.serve.hosts import host_checks, select_components
from splitserve.serve.plan import ServePlan, load_plan

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def print_plan(plan: ServePlan, console: Console) -> None:
    """Human-readable process plan for --dry-run."""
    console.print(f"[bold]graph[/] {plan.graph_ref}   [bold]config[/] {plan.source}")
    c = plan.common
    console.print(f"[bold]common[/] namespace={c.namespace} model={c.model} "
                  f"request_plane={c.request_plane} shutdown_timeout={c.shutdown_timeout_s}s")
    for pool, pc in plan.pools.items():
        console.print(f"[bold]model pool[/] {pool}: serves {pc.served_model_name} "
                      f"(model={pc.model}) in namespace {pc.namespace}")
    for comp in plan.components:
        links = ", ".join(comp.links) or "-"
        pruned = f"  (pruned: {', '.join(comp.pruned)})" if comp.pruned else ""
        console.print(f"  [bold cyan]{comp.name}[/] x{comp.replicas}  python -m {comp.entrypoint}"
                      f"  links: {links}{pruned}  shutdown rank {comp.shutdown_rank}")
        cfg = comp.config.model_dump(mode="json", exclude={"replicas"})
        console.print(f"      {json.dumps(cfg, sort_keys=True)}", highlight=False, markup=False)
        for rep in plan.placement(comp):
            parts = [f"{k}={v}" for k, v in {**rep["env"], **rep}.items()
                     if k not in ("env", "replica")]
            if parts:
                console.print(f"      replica {rep['replica']}: {' '.join(parts)}",
                              highlight=False, markup=False)
    if plan.only:
        console.print(f"[bold]this host runs[/] {', '.join(plan.only)} (the rest of the graph "
                      "runs on other hosts)")
    for name in plan.ignored_sections:
        console.print(f"  [dim]{name}: section present but not in this graph; not started[/]")


AUTH_VARIABLES = ("ETCD_AUTH_USERNAME", "ETCD_AUTH_PASSWORD", "ETCD_AUTH_CA",
                  "ETCD_AUTH_CLIENT_CERT", "ETCD_AUTH_CLIENT_KEY", "NATS_AUTH_USERNAME",
                  "NATS_AUTH_PASSWORD", "NATS_AUTH_TOKEN", "NATS_AUTH_NKEY",
                  "NATS_AUTH_CREDENTIALS_FILE", "NATS_TLS_CA_CERT_PATH",
                  "NATS_TLS_CLIENT_CERT_PATH", "NATS_TLS_CLIENT_KEY_PATH")


def external_access(etcd: str | None, nats: str | None
                    ) -> tuple[EtcdAccess, NatsAccess] | None:
    """Credentials and TLS of external etcd and NATS, from their URLs and the ETCD_AUTH_*,
    NATS_AUTH_* and NATS_TLS_* variables; None unless both servers are given.  Raises
    ValueError (AccessError) for inconsistent settings, never drops a credential."""
    if not (etcd and nats):
        stray = sorted(k for k in AUTH_VARIABLES if os.environ.get(k))
        if stray and not (etcd or nats):
            # The embedded servers take no credentials; the replicas would inherit these
            # and fail to authenticate against them.
            raise ValueError(f"{', '.join(stray)} set, but no external etcd/NATS given "
                             "(--etcd and --nats); unset them to use the embedded servers")
        return None
    return EtcdAccess.from_env(os.environ, etcd), NatsAccess.from_env(os.environ, nats)


def serve(
    ctx: typer.Context,
    graph: str = typer.Argument(..., help="Graph to serve as module:Component, e.g. "
                                "graphs.agg:Frontend; only components reachable from "
                                "Component are started."),
    config: Path | None = typer.Option(None, "-f", "--config", help="YAML config: a Common "
                                       "section and one section per component."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate, print the resolved "
                                 "process plan and exit without starting anything."),
    json_out: bool = typer.Option(False, "--json", help="With --dry-run: print the plan as JSON."),
    etcd: str | None = typer.Option(None, "--etcd", envvar="ETCD_ENDPOINTS",
                                    help="External etcd endpoints; with --nats, nothing is "
                                    "started. Neither set: embedded etcd and NATS."),
    nats: str | None = typer.Option(None, "--nats", envvar="NATS_SERVER",
                                    help="External NATS server URL (JetStream enabled)."),
    control_port: int = typer.Option(0, "--control-port", help="Port of the supervisor's "
                                     "control endpoint on 127.0.0.1 (0 = a free port)."),
    status: bool | None = typer.Option(None, "--status/--no-status", help="Live status "
                                       "table (default: on when stdout is a terminal)."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help="Root for run directories and the registry."),
    ready_file: Path | None = typer.Option(None, "--ready-file", help="Write this file once "
                                           "every replica reports ready (for scripts)."),
    only: str | None = typer.Option(
        None, "--only", help="Start only these components of the graph (comma-separated, "
        "as the status table names them, e.g. DecodeWorker or Frontend,Router), for a "
        "graph spread over hosts; needs --etcd and --nats, and Common.bind_host set to "
        "this host's address (docs/deploy.md, Several hosts)."),
    policy_key_file: Path | None = typer.Option(
        None, "--policy-key-file", envvar="SPLITSERVE_POLICY_KEY_FILE",
        help="Secret that signs policy versions (keep it 0600); default: a new key per run, "
             "in the run directory."),
) -> None:
    """Bring a graph up: validate the config, start infrastructure and every component.

    Extra arguments of the form --Component.field=value override the config file, e.g.
    --Worker.replicas=2 or --Common.namespace=test. Stop with Ctrl-C or SIGTERM: the
    frontend stops first, infrastructure last.
    """
    console = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    try:
        g = load_graph(graph)
        plan = load_plan(g, graph, config, ctx.args, g.defined)
        if only is not None:
            plan = select_components(plan, only.split(","))
            problems = host_checks(plan.common, etcd, nats)
            if problems:
                raise ConfigError(plan.source, problems)
        access = external_access(etcd, nats)
        if access:  # the credential-free URLs: they are logged and shown by status
            external = resolve_endpoints(access[0].endpoints, access[1].server)
        else:
            external = resolve_endpoints(etcd, nats)
        if policy_key_file is not None:
            read_secret(policy_key_file)  # exists, private, not empty
    except (GraphError, ConfigError, ValueError, OSError) as exc:
        # Printed without markup: messages quote patterns and paths with [brackets].
        err.print("[red]error:[/] ", end="")
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(2) from None
    if dry_run:
        if json_out:
            typer.echo(json.dumps(plan.to_dict(), indent=2))
        else:
            print_plan(plan, console)
            infra = (f"external etcd {external.etcd}, NATS {external.nats}" if external
                     else "embedded etcd + NATS on 127.0.0.1, free ports")
            console.print(f"[bold]infrastructure[/] {infra}")
        raise typer.Exit(0)
    from splitserve.serve.runner import serve as run_serve
    from splitserve.serve.supervisor import bind_http_listeners

    try:  # the API's address first: a busy port is reported before anything starts
        listeners = bind_http_listeners(plan)
    except OSError as exc:
        err.print("[red]error:[/] ", end="")
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(2) from None
    root = state_root(state_dir)
    run_dir = new_run_dir(root)
    access_env = {**access[0].env(), **access[1].env()} if access else {}
    code = asyncio.run(run_serve(plan, run_dir, external, control_port=control_port,
                                 live_status=status, registry_dir=registry_dir(root),
                                 console=console, ready_file=ready_file,
                                 access_env=access_env, policy_key_file=policy_key_file,
                                 listeners=listeners))
    raise typer.Exit(code)
