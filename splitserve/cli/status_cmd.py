"""`dynamo status`: components and instances registered in etcd, and local supervisors."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request

import typer
from rich import box
from rich.table import Table

from splitserve.cli.console import cli_console
from splitserve.cli.paths import dev_infra_dir, registry_dir, state_root
from splitserve.components.worker.latency_metrics import COMPUTE, ITL, QUEUE_WAIT, TRANSFER, TTFT
from splitserve.contracts import prometheus
from splitserve.contracts.kit.connect import split_credentials
from splitserve.contracts.kit.etcd import get_prefix
from splitserve.contracts.kit.health import probe
from splitserve.contracts.kit.procs import pid_alive
from splitserve.contracts.metrics import PREFIX, latency_buckets
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
    latency: bool = typer.Option(False, "--latency", help="Show latency by pool instead: "
                                 "p50/p95/p99 of TTFT, ITL and the prefill stages per pool "
                                 "and model, and the frontends' TTFT and ITL per model, "
                                 "from every local graph's /metrics."),
    metrics: list[str] = typer.Option(None, "--metrics", help="With --latency: a /metrics "
                                      "URL to read instead of the local graphs' "
                                      "(repeatable; implies --latency)."),
) -> None:
    """Show registered component instances and local `dynamo serve` replicas.

    Exit codes: 0 all healthy; 1 nothing found or etcd unreachable; 3 some replica is
    not ready (starting, restarting, failed) or a local graph's etcd or NATS is down.
    With ``--latency``: 0 when some /metrics was read, 1 when none could be.
    """
    root = state_root(state_dir)
    if latency or metrics:
        show_latency(list(metrics or []), root, json_out)
        return
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
    console = cli_console()
    for s in report["supervisors"]:
        t = Table(title=f"dynamo serve {s['graph']} (pid {s['pid']}, control {s['control']})")
        for col in ("component", "replica", "model", "pid", "state", "endpoint", "restarts"):
            t.add_column(col, overflow="fold")  # a narrow console wraps a value, never cuts it
        for r in s["replicas"] or []:
            t.add_row(r["component"], str(r["replica"]), r.get("model") or "-", str(r["pid"]),
                      r["state"], r["endpoint"] or "-", str(r["restarts"]))
        console.print(t)
    for ep, rows in report["etcd"].items():
        t = Table(title=f"instances registered in etcd {ep}")
        adapters = any(r.get("loras") for r in rows)
        for col in ("namespace", "component", "endpoint", "instance", "address",
                    *(("LoRA adapters",) if adapters else ())):
            t.add_column(col, overflow="fold")
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


# ---- latency by pool (--latency) ------------------------------------------------------
POOL_STAGES = {"ttft": TTFT, "itl": ITL, "prefill_queue_wait": QUEUE_WAIT,
               "prefill_compute": COMPUTE, "kv_transfer": TRANSFER}
"""Column -> the workers' histogram, labelled by ``pool`` and ``model``."""
FRONTEND_STAGES = {"ttft": f"{PREFIX}_frontend_ttft_seconds",
                   "itl": f"{PREFIX}_frontend_itl_seconds"}
"""Column -> the frontend's histogram, labelled by ``model``."""
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
QUANTILE_NOTE = ("each quantile is the upper bound of the histogram bucket it falls in "
                 "(seconds; +Inf beyond the last bucket)")


def fetch_text(url: str, timeout_s: float = 3.0) -> str | None:
    """The body of ``url``; None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None


def replica_metrics_url(replica: dict) -> str | None:
    """Where one replica of a supervisor's status serves /metrics: its reported
    ``metrics`` URL, or a frontend's HTTP endpoint; None when it serves none."""
    endpoint = str(replica.get("endpoint") or "")
    if replica.get("metrics"):
        return replica["metrics"]
    return endpoint.rstrip("/") + "/metrics" if endpoint.startswith("http") else None


def graph_metrics_urls(supervisors: list[dict]) -> list[str]:
    """/metrics of every replica of the local graphs (their supervisors' status)."""
    urls = []
    for info in supervisors:
        for rep in (supervisor_status(info) or {}).get("replicas") or []:
            if (url := replica_metrics_url(rep)) and url not in urls:
                urls.append(url)
    return urls


class LatencyByPool:
    """Latency histograms summed over scraped processes: the workers' by (pool, model),
    the frontends' by model.  Fed by ``add`` once per /metrics text; ``summary``
    gives the quantiles."""

    def __init__(self) -> None:
        # (pool, model) or model -> column -> upper bound -> cumulative count
        self.pools: dict[tuple[str, str], dict[str, dict[float, float]]] = {}
        self.frontend: dict[str, dict[str, dict[float, float]]] = {}

    def add(self, text: str) -> None:
        """Add one process's /metrics text; raises ValueError when it is not
        Prometheus exposition."""
        samples = prometheus.parse(text)
        for column, name in POOL_STAGES.items():
            for key in samples.get(f"{name}_count", {}):
                labels = dict(key)
                pool, model = labels.get("pool", ""), labels.get("model", "")
                hist = prometheus.histogram(samples, name, pool=pool, model=model)
                _merge(self.pools.setdefault((pool, model), {}), column, hist)
        for column, name in FRONTEND_STAGES.items():
            for model in prometheus.by_label(samples, f"{name}_count", "model"):
                hist = prometheus.histogram(samples, name, model=model)
                _merge(self.frontend.setdefault(model, {}), column, hist)

    def summary(self) -> dict:
        """Per pool and model, and per frontend model: each column's observation count
        and bucket quantiles (None without observations)."""
        return {
            "quantiles": QUANTILE_NOTE,
            "pools": [{"pool": pool, "model": model,
                       **{c: _quantiles(cols.get(c, {})) for c in POOL_STAGES}}
                      for (pool, model), cols in sorted(self.pools.items())],
            "frontend": [{"model": model,
                          **{c: _quantiles(cols.get(c, {})) for c in FRONTEND_STAGES}}
                         for model, cols in sorted(self.frontend.items())],
        }


def _merge(columns: dict[str, dict[float, float]], column: str,
           hist: prometheus.Histogram) -> None:
    into = columns.setdefault(column, {})
    for le, n in hist.buckets.items():
        into[le] = into.get(le, 0.0) + n


def _quantiles(buckets: dict[float, float]) -> dict:
    count = max(buckets.values(), default=0.0)
    return {"count": count, **{name: _bound(prometheus.bucket_quantile(buckets, q))
                               for name, q in QUANTILES.items()}}


def _bound(x: float | None) -> float | str | None:
    return "+Inf" if x == math.inf else x  # JSON has no infinity


def show_latency(urls: list[str], root, json_out: bool) -> None:
    """`dynamo status --latency`: read ``urls`` (default: every local graph's replicas),
    print the quantiles; exits 1 when nothing could be read."""
    urls = urls or graph_metrics_urls(local_supervisors(root))
    if not urls:
        typer.echo("no running graph found; pass --metrics URL", err=True)
        raise typer.Exit(1)
    table, unreadable = LatencyByPool(), []
    for url in urls:
        text = fetch_text(url)
        try:
            if text is None:
                raise ValueError("unreachable")
            table.add(text)
        except ValueError as exc:
            why = (str(exc).splitlines() or ["not Prometheus text"])[0]
            unreadable.append({"url": url, "error": why})
    if len(unreadable) == len(urls):
        typer.echo("could not read any /metrics: " + "; ".join(
            f"{u['url']} ({u['error']})" for u in unreadable), err=True)
        raise typer.Exit(1)
    out = {**table.summary(), "sources": urls, "unreadable": unreadable}
    if json_out:
        typer.echo(json.dumps(out, indent=2))
        return
    _print_latency(out)


def _fmt_s(x: float | str | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return f">{latency_buckets()[-1]:g}s"
    return f"{x * 1000:g}ms" if x < 1 else f"{x:g}s"


STAGE_NAMES = {"ttft": "TTFT", "itl": "ITL", "prefill_queue_wait": "prefill queue wait",
               "prefill_compute": "prefill compute", "kv_transfer": "KV transfer"}


def _stage_table(title: str, heads: tuple[str, ...], groups: list[tuple[tuple[str, ...], dict]],
                 stages: dict[str, str]) -> Table:
    """One row per group (pool and model, or model) and stage with observations: its
    count and quantiles; the group's names on its first row only, and on a row of
    dashes when it has observed nothing yet."""
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False)
    for col in heads:
        table.add_column(col, overflow="fold")
    table.add_column("stage", no_wrap=True)
    for col in ("n", *QUANTILES):
        table.add_column(col, justify="right", no_wrap=True)
    for names, row in groups:
        lead = [n or "-" for n in names]
        observed = [c for c in stages if row[c]["count"]]
        for c in observed:
            q = row[c]
            table.add_row(*lead, STAGE_NAMES[c], f"{q['count']:.0f}",
                          *(_fmt_s(q[p]) for p in QUANTILES))
            lead = [""] * len(heads)
        if not observed:
            table.add_row(*lead, "-", "0", *("-" for _ in QUANTILES))
    return table


def _print_latency(out: dict) -> None:
    console = cli_console()
    if out["pools"]:
        console.print(_stage_table("latency by pool", ("pool", "model"), [
            ((r["pool"], r["model"]), r) for r in out["pools"]], POOL_STAGES))
    else:
        console.print("no worker reports latency by pool yet")
    if out["frontend"]:
        console.print(_stage_table("frontend, by model", ("model",), [
            ((r["model"],), r) for r in out["frontend"]], FRONTEND_STAGES))
    console.print("p50 / p95 / p99: the upper bound of the histogram bucket each falls in "
                  f"(>{latency_buckets()[-1]:g}s: beyond the last bucket)")
    for u in out["unreadable"]:
        console.print(f"[red]unreadable[/] {u['url']}: {u['error']}")
