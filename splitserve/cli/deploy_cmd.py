"""`dynamo deploy render GRAPH -f CONFIG`: Kubernetes manifests for a graph.

The graph and config are resolved and checked exactly as `dynamo serve --dry-run` does
(overrides ``--Component.field=value`` included); ``splitserve.deploy.render`` turns the
plan into manifests.  Exit codes: 0 written; 2 invalid graph, config or option.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.console import Console

from splitserve.contracts.config import ConfigError
from splitserve.deploy.render import Target, render, to_yaml
from splitserve.serve.graph import GraphError, load_graph
from splitserve.serve.plan import load_plan

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
app = typer.Typer(help="Deploy a graph to Kubernetes.", no_args_is_help=True)


def _paths(pairs: list[str]) -> dict[str, str]:
    """``LOCAL=POD`` pairs as a mapping; raises ValueError naming a malformed one."""
    out: dict[str, str] = {}
    for pair in pairs:
        local, sep, pod = pair.partition("=")
        if not (sep and local.startswith("/") and pod.startswith("/")):
            raise ValueError(f"--pod-path {pair!r}: give LOCAL=POD, both absolute paths")
        out[local] = pod
    return out


@app.command("render", context_settings=EXTRA)
def render_cmd(
    ctx: typer.Context,
    graph: str = typer.Argument(..., help="Graph as module:Component, e.g. "
                                "graphs.disagg:Frontend."),
    config: Path = typer.Option(..., "-f", "--config", help="The graph's YAML config."),
    out: Path | None = typer.Option(None, "--out", help="Directory to write "
                                    "<config name>.yaml into (default: standard output)."),
    image: str = typer.Option("splitserve:latest", "--image", help="Container image of "
                              "every pod (deploy/docker/Dockerfile.cpu builds one)."),
    namespace: str = typer.Option("splitserve", "--namespace", help="Kubernetes namespace."),
    etcd: str | None = typer.Option(None, "--etcd", help="External etcd URL; with --nats, "
                                    "no etcd or NATS is rendered."),
    nats: str | None = typer.Option(None, "--nats", help="External NATS URL (JetStream)."),
    pod_path: list[str] = typer.Option([], "--pod-path", help="LOCAL=POD: files checked "
                                       "here under LOCAL sit under POD in the pods (a "
                                       "model directory, say); repeatable."),
) -> None:
    """Write the Deployments, Services, ConfigMap, etcd/NATS and RBAC of a graph.

    Extra arguments --Component.field=value override the config file, as for serve.
    """
    err = Console(stderr=True, soft_wrap=True)
    try:
        if bool(etcd) != bool(nats):
            raise ValueError("give both --etcd and --nats, or neither (in-cluster servers)")
        target = Target(namespace=namespace, image=image, etcd=etcd, nats=nats,
                        paths=_paths(pod_path))
        g = load_graph(graph)
        plan = load_plan(g, graph, config, ctx.args, g.defined)
    except (GraphError, ConfigError, ValueError, OSError) as exc:
        err.print("error:", str(exc), markup=False, highlight=False)
        raise typer.Exit(2) from None
    command = shlex.join(["dynamo", "deploy", "render", graph, "-f", str(config),
                          *ctx.args])
    text = to_yaml(render(plan, target), f"Rendered by: {command}\nDo not edit: render "
                   "again from the config.")
    if out is None:
        typer.echo(text, nl=False)
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{config.stem}.yaml"
    path.write_text(text)
    err.print(f"wrote {path}", markup=False, highlight=False)
