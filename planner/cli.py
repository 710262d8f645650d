"""`dynamo planner`: simulate a policy on a trace, check a policy, export its schema.

The simulator runs the planner core itself (``decide``), so what it prints is what the
live planner would do given the same observations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from splitserve.components.policy.decode import DocumentError, decode_document
from splitserve.components.policy.schema import PolicyError, error_lines

from .config import SCHEMA_FILE, PlannerPolicy, load_planner_policy, planner_schema
from .fleet import FleetModel
from .simulate import render_table, rows, simulate
from .traces import load_trace

app = typer.Typer(help="Autoscaling planner: simulate, check, schema.", no_args_is_help=True)
SCHEMA_DIR = Path("configs/planner")


def _policy(path: Path) -> PlannerPolicy:
    try:
        return load_planner_policy(path)
    except PolicyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def load_fleet(path: Path | None) -> FleetModel:
    """The fleet model from a YAML/JSON file, or the defaults; raises ``PolicyError``."""
    if path is None:
        return FleetModel()
    try:
        data = decode_document(path)
        return FleetModel.model_validate(data)
    except DocumentError as exc:
        raise PolicyError(str(path), [f"(root): {exc}"]) from None
    except ValidationError as exc:
        raise PolicyError(str(path), error_lines(exc)) from None


@app.command("simulate")
def simulate_cmd(
    trace: Annotated[Path, typer.Option("--trace", help="Mooncake .jsonl or Azure .csv trace.")],
    policy: Annotated[Path, typer.Option("--policy", help="Planner file (autoscale + "
                                         "planner) or a whole policy file.")],
    fleet: Annotated[Path | None, typer.Option("--fleet", help="Fleet model YAML (per-replica "
                                               "speeds, start-up time).")] = None,
    interval_s: Annotated[float | None, typer.Option("--interval-s", help="Decision interval "
                                                     "(default: planner.interval_s).")] = None,
    start_s: Annotated[float, typer.Option("--start-s", help="Skip this much of the "
                                           "trace.")] = 0.0,
    duration_s: Annotated[float | None, typer.Option("--duration-s", help="Replay this many "
                                                     "seconds (default: all).")] = None,
    changes_only: Annotated[bool, typer.Option("--changes-only", help="Print only intervals "
                                               "with a scale or a move.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print rows and summary as "
                                           "JSON.")] = False,
) -> None:
    """Replay a trace through the planner against a modelled fleet and print, per
    interval, the observed queues and utilisation and the action taken, with its reason."""
    pol = _policy(policy)
    try:
        model = load_fleet(fleet)
        requests = load_trace(trace, start_s, duration_s)
    except PolicyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if interval_s is not None and interval_s <= 0:
        raise typer.BadParameter("must be > 0", param_hint="--interval-s")
    result = simulate(requests, pol, model, interval_s, duration_s)
    if json_out:
        typer.echo(json.dumps({"rows": rows(result), "summary": result.summary()}))
        return
    typer.echo(f"{len(requests)} requests, {len(result.decisions)} intervals of "
               f"{result.interval_s:g}s")
    typer.echo(render_table(result, changes_only))
    typer.echo(json.dumps(result.summary()))


@app.command()
def check(policy: Annotated[Path, typer.Argument(help="Planner or policy file.")]) -> None:
    """Validate a planner policy and print the effective settings (defaults filled in)."""
    pol = _policy(policy)
    typer.echo(json.dumps(pol.model_dump(mode="json"), indent=2))


def schemas() -> dict[str, str]:
    """The JSON Schema texts of planner files and fleet files, by file name."""
    fleet = FleetModel.model_json_schema()
    fleet["title"] = "splitserve planner simulator fleet"
    docs = {SCHEMA_FILE: planner_schema(), "fleet.schema.json": fleet}
    return {name: json.dumps(doc, indent=2, sort_keys=True) + "\n" for name, doc in docs.items()}


@app.command()
def schema(
    out: Annotated[Path, typer.Option("--out", help="Folder to write the schemas to.")] =
    SCHEMA_DIR,
    verify: Annotated[bool, typer.Option("--check", help="Only check the files are up to "
                                         "date.")] = False,
) -> None:
    """Write (or check) planner.schema.json and fleet.schema.json."""
    stale = []
    for name, text in schemas().items():
        path = out / name
        if verify:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {path}")
    if stale:
        typer.echo(f"out of date: {', '.join(stale)}; run `dynamo planner schema`", err=True)
        raise typer.Exit(1)
    if verify:
        typer.echo("schemas are up to date")


@app.command()
def profile() -> None:
    """Measure per-replica capacity within the SLA targets (not implemented yet).

    Until it is, write the capacities in the planner file under planner.sla.prefill /
    planner.sla.decode ({tokens_per_s: N} or {requests_per_s: N}); docs/planner.md says
    how to measure them.
    """
    typer.echo("dynamo planner profile is not implemented yet: set planner.sla.prefill and "
               "planner.sla.decode capacities in the planner file (see docs/planner.md, "
               "'Measuring capacity', and configs/planner/sla.yaml).", err=True)
    raise typer.Exit(2)
