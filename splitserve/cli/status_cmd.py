"""`dynamo status`: components and instances registered in etcd, and local supervisors."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import typer
from rich.console import Console
from rich.table import Table

from splitserve.cli.paths import dev_infra_dir, registry_dir, state_root
from splitserve.contracts.kit.connect import split_credentials
from splitserve.contracts.kit.etcd import get_prefix
from splitserve.contracts.kit.health import probe
from splitserve.contracts.kit.procs import pid_alive
from splitserve.serve.control import supervisor_status

INSTANCES = "v1/instances/"


def local_supervisors(root) -> list[dict]:
    """Registry entries of `dynamo serve` processes still alive on this machine."""
    out = []
    for f in sorted(registry_dir(root).glob("*.json")):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(info.get("pid", -1)):
            out.append(info)
        else:
            f.unlink(missing_ok=True)  # stale: its supervisor died without cleaning up
    return out


def fetch_json(url: str, timeout_s: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


async def registered_instances(etcd: str, namespace: str | None) -> list[dict]:
    """Instances under etcd's ``v1/instances/`` (optionally one namespace), parsed."""
    prefix = INSTANCES + (f"{namespace}/" if namespace else "")
    rows = []
    for key, value in await get_prefix(etcd, prefix):
        try:
            data = json.loads(value)
        except ValueError:
            data = {}
        transport = data.get("transport", {})
        addr = next(iter(transport.values()), "") if isinstance(transport, dict) else ""
        rows.append({"namespace": data.get("namespace", ""), "component": data.get("component", ""),
                     "endpoint": data.get("endpoint", ""), "instance_id": data.get("instance_id"),
                     "address": str(addr).split("/")[0], "key": key})
    await _add_adapters(etcd, rows)
    return rows


async def _add_adapters(etcd: str, rows: list[dict]) -> None:
    """Each worker's ``generate`` row gets its LoRA adapters (``loras``: name -> its
    state there), from the statuses the workers keep in etcd (docs/lora.md)."""
    from splitserve.contracts.kit.loras import LoraKeys, LoraView

    for ns in sorted({r["namespace"] for r in rows if r["namespace"]}):
        keys = LoraKeys(ns)
        view = LoraView.from_items(keys, dict(await get_prefix(etcd, keys.statuses)))
        for r in rows:
            if r["namespace"] != ns or r["endpoint"] != "generate":
                continue
            mine = {name: by_worker[r["instance_id"]].state
                    for name, by_worker in view.statuses.items()
                    if r["instance_id"] in by_worker}
            if mine:
                r["loras"] = mine


def dependencies_down(supervisor: dict, reported: list[dict] | None) -> list[str]:
    """etcd / NATS of a local graph that are down: by its supervisor's report or by a probe.

    The probe covers a supervisor whose control endpoint did not answer.
    """
    down = {d["name"] for d in reported or [] if d.get("state") == "down"}
    if supervisor.get("etcd") and supervisor.get("nats"):
        down |= {n for n, ok in probe(supervisor["etcd"], supervisor["nats"]).items() if not ok}
    return sorted(down)


def status(
    etcd: str | None = typer.Option(None, "--etcd", envvar="ETCD_ENDPOINTS",
                                    help="etcd to inspect (default: local graphs' own)."),
    namespace: str | None = typer.Option(None, "--namespace", "-n",
                                         help="Only this Dynamo namespace."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help="Root for local state."),
) -> None:
    """Show registered component instances and local `dynamo serve` replicas.

    Exit codes: 0 all healthy; 1 nothing found or etcd unreachable; 3 some replica is
    not ready (starting, restarting, failed) or a local graph's etcd or NATS is down.
    """
    root = state_root(state_dir)
    sups = local_supervisors(root)
    etcds = [etcd] if etcd else sorted({s["etcd"] for s in sups})
    if not etcds:
        dev = dev_infra_dir(root) / "infra.json"
        if dev.exists():
            etcds = [json.loads(dev.read_text())["endpoints"]["etcd"]]
    report: dict = {"etcd": {}, "supervisors": []}
    unreachable = []
    for ep in etcds:
        shown = split_credentials(ep)[0]  # never print a password given in the URL
        try:
            report["etcd"][shown] = asyncio.run(registered_instances(ep, namespace))
        except Exception as exc:  # noqa: BLE001 - any client error means unreachable
            unreachable.append(f"{shown}: {exc.__class__.__name__}")
    for s in sups:
        st = supervisor_status(s)
        report["supervisors"].append({**s, "replicas": st["replicas"] if st else None,
                                      "dependencies_down": dependencies_down(
                                          s, st.get("dependencies") if st else None)})
    deps_down = sorted({d for s in report["supervisors"] for d in s["dependencies_down"]})
    degraded = any(r["state"] != "ready" for s in report["supervisors"]
                   for r in (s["replicas"] or []))
    found = any(report["etcd"].values()) or report["supervisors"]
    if json_out:
        typer.echo(json.dumps({**report, "unreachable": unreachable}, indent=2))
    else:
        _print(report, unreachable)
    if deps_down:
        raise typer.Exit(3)
    if unreachable or not found:
        raise typer.Exit(1)
    if degraded:
        raise typer.Exit(3)


def _print(report: dict, unreachable: list[str]) -> None:
    console = Console()
    for s in report["supervisors"]:
        t = Table(title=f"dynamo serve {s['graph']} (pid {s['pid']}, control {s['control']})")
        for col in ("component", "replica", "model", "pid", "state", "endpoint", "restarts"):
            t.add_column(col)
        for r in s["replicas"] or []:
            t.add_row(r["component"], str(r["replica"]), r.get("model") or "-", str(r["pid"]),
                      r["state"], r["endpoint"] or "-", str(r["restarts"]))
        console.print(t)
    for ep, rows in report["etcd"].items():
        t = Table(title=f"instances registered in etcd {ep}")
        adapters = any(r.get("loras") for r in rows)
        for col in ("namespace", "component", "endpoint", "instance", "address",
                    *(("LoRA adapters",) if adapters else ())):
            t.add_column(col)
        for r in rows:
            iid = r["instance_id"]
            shown = ", ".join(n if s == "loaded" else f"{n} ({s})"
                              for n, s in sorted(r.get("loras", {}).items()))
            t.add_row(r["namespace"], r["component"], r["endpoint"],
                      f"{iid:x}" if isinstance(iid, int) else str(iid), r["address"],
                      *((shown or "-",) if adapters else ()))
        console.print(t)
    for s in report["supervisors"]:
        for dep in s["dependencies_down"]:
            console.print(f"[red]dependency down[/] {dep} ({s.get(dep, '?')}) of dynamo serve "
                          f"pid {s['pid']}: requests are refused until it is back")
    for u in unreachable:
        console.print(f"[red]unreachable[/] etcd {u}")
    if not report["supervisors"] and not any(report["etcd"].values()) and not unreachable:
        console.print("nothing is running (no local `dynamo serve`, no registered instances)")
