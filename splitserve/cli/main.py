"""The `dynamo` command: serve graphs and administer them."""

from __future__ import annotations

import typer

from splitserve import __version__
from splitserve.cli import (
    bench_cmd,
    deploy_cmd,
    infra_cmd,
    lora_cmd,
    qos_cmd,
    route_cmd,
    scale_cmd,
    serve_cmd,
    status_cmd,
)
from splitserve.planner import cli as planner_cli
from splitserve.cli import policy_cmd as policy_cli

app = typer.Typer(
    name="dynamo",
    help="Disaggregated LLM serving on NVIDIA Dynamo's runtime (splitserve).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command(context_settings=serve_cmd.EXTRA)(serve_cmd.serve)
app.command()(status_cmd.status)
app.command()(scale_cmd.scale)
app.add_typer(infra_cmd.app, name="infra")
app.add_typer(route_cmd.app, name="route")
app.add_typer(policy_cli.app, name="policy")
app.add_typer(planner_cli.app, name="planner")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(qos_cmd.app, name="qos")
app.add_typer(lora_cmd.app, name="lora")
app.add_typer(deploy_cmd.app, name="deploy")


@app.command()
def version() -> None:
    """Print the splitserve version."""
    typer.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    app()
