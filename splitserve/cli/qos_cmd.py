"""`dynamo qos calibration`: how well admission predicts, read from live /metrics.

Reads the admission metrics of every Router replica (each model pool's ``Router@<pool>``
included) and every frontend that routes in its own process (or the /metrics URLs given)
and prints the confusion table (refused, admitted-and-met, admitted-and-missed; in
shadow mode would-refuse-but-met and would-refuse-and-missed), the refusals by reason,
the holds by outcome, and the calibration of the TTFT and TPOT predictions: quantiles of
log2(measured / predicted) from the histogram's buckets; with ``--by class``, ``--by
worker`` or ``--by model`` the same per class, per worker or per served model; and per
worker, what a prompt token's prefill stalls the answers beside it, charged by admission
against measured from finished answers.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

import typer
from rich.table import Table

from splitserve.cli.console import cli_console
from splitserve.cli.paths import state_root
from splitserve.cli.status_cmd import fetch_text, local_supervisors, replica_metrics_url
from splitserve.contracts import prometheus
from splitserve.contracts.metrics import PREFIX
from splitserve.serve.control import supervisor_status

app = typer.Typer(help="Inspect QoS admission of a running graph.", no_args_is_help=True)

OUTCOMES = ("refused", "admitted-met", "admitted-missed", "would-refuse-met",
            "would-refuse-missed")


@dataclass
class Calibration:
    """Admission's record summed over the scraped processes."""

    confusion: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    refusals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    would_refuse: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    held: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # kind -> upper bound -> cumulative count
    buckets: dict[str, dict[float, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # worker -> 'charged' / 'measured' -> ms per prompt token (a gauge: the last read)
    stall: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    def add(self, text: str, **labels: str) -> None:
        """Add one process's /metrics text (only the samples with ``labels``: one class
        or one worker; refusals by reason and holds are kept whole only)."""
        samples = prometheus.parse(text)
        confusion = f"{PREFIX}_qos_confusion_total"
        admissions = f"{PREFIX}_qos_admissions_total"
        for outcome, n in prometheus.by_label(samples, confusion, "outcome", **labels).items():
            self.confusion[outcome] += n
        self.add_errors(samples, **labels)
        if labels:
            return
        for outcome, n in prometheus.by_label(samples, f"{PREFIX}_qos_held_total",
                                              "outcome").items():
            self.held[outcome] += n
        for reason, n in prometheus.by_label(samples, admissions, "reason",
                                             outcome="rejected").items():
            self.refusals[reason] += n
        for reason, n in prometheus.by_label(samples, admissions, "reason",
                                             outcome="shadow-rejected").items():
            self.would_refuse[reason] += n
        for kind in ("charged", "measured"):
            for worker, ms in prometheus.by_label(samples, f"{PREFIX}_qos_stall_ms_per_token",
                                                  "worker", kind=kind).items():
                self.stall[worker][kind] = ms

    def add_errors(self, samples: prometheus.Samples, **labels: str) -> None:
        error = f"{PREFIX}_qos_prediction_log2_ratio"
        for kind in prometheus.by_label(samples, f"{error}_bucket", "kind", **labels):
            for le, n in prometheus.histogram(samples, error, kind=kind,
                                              **labels).buckets.items():
                self.buckets[kind][le] += n

    def quantile(self, kind: str, q: float) -> float | None:
        """The bucket bound below which a fraction ``q`` of the log2 errors lie."""
        return prometheus.bucket_quantile(self.buckets.get(kind, {}), q)

    def within(self, kind: str, bound: float) -> float | None:
        """Share of predictions with |log2 error| <= ``bound`` (a bucket bound)."""
        cum = dict(self.buckets.get(kind, {}))
        total = cum.get(float("inf"), 0.0)
        if total <= 0 or bound not in cum or -bound not in cum:
            return None
        below = max((n for le, n in cum.items() if le < -bound), default=0.0)
        return (cum[bound] - below) / total

    def summary(self) -> dict:
        """Everything above as plain data (``--json``)."""
        admitted = sum(self.confusion.get(o, 0.0) for o in OUTCOMES[1:])
        missed = self.confusion.get("admitted-missed", 0.0) + \
            self.confusion.get("would-refuse-missed", 0.0)
        false_refusals = self.confusion.get("would-refuse-met", 0.0)
        would = false_refusals + self.confusion.get("would-refuse-missed", 0.0)
        return {
            "confusion": {o: self.confusion.get(o, 0.0) for o in OUTCOMES},
            "refusals_by_reason": dict(self.refusals),
            "held_by_outcome": dict(self.held),
            "would_refuse_by_reason": dict(self.would_refuse),
            "missed_share_of_admitted": missed / admitted if admitted else None,
            "false_share_of_would_refuse": false_refusals / would if would else None,
            "calibration": {kind: {"p10": self.quantile(kind, 0.1),
                                   "p50": self.quantile(kind, 0.5),
                                   "p90": self.quantile(kind, 0.9),
                                   "within_2x": self.within(kind, 1.0)}
                            for kind in ("ttft", "tpot")},
            "stall_ms_per_token": {w: dict(k) for w, k in sorted(self.stall.items())},
        }


_fetch = fetch_text  # the name the command reads through (tests replace it)


ADMITTING = ("Router", "Frontend")
"""Components where admission runs; a ``Models`` pool's are named ``Router@<pool>``."""


def local_metrics_sources(state_dir: str | None) -> list[tuple[str, str]]:
    """(/metrics URL, served model) of the local graphs' Router replicas, every model
    pool's included, and frontends (admission runs in one or the other).  A frontend's
    admission is its graph's first model's (the pools are routed by their own Router)."""
    out = []
    for info in local_supervisors(state_root(state_dir)):
        for rep in (supervisor_status(info) or {}).get("replicas", []):
            component = str(rep.get("component", ""))
            if component.split("@")[0] in ADMITTING and (url := replica_metrics_url(rep)):
                out.append((url, str(rep.get("model") or "?").split(", ")[0]))
    return out


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:+.2f}"


GROUP_LABELS = {"class": "class_name", "worker": "worker"}
BY_MODEL = "model"
"""Grouped by the model of the process each text came from (local graphs only)."""


def grouped(texts: list[str], by: str) -> dict[str, dict]:
    """The summary per value of ``by`` ('class' or 'worker') over the scraped texts."""
    label = GROUP_LABELS[by]
    values: set[str] = set()
    for text in texts:
        samples = prometheus.parse(text)
        for name in (f"{PREFIX}_qos_confusion_total",
                     f"{PREFIX}_qos_prediction_log2_ratio_bucket"):
            values.update(v for v in prometheus.by_label(samples, name, label) if v)
    out = {}
    for value in sorted(values):
        cal = Calibration()
        for text in texts:
            cal.add(text, **{label: value})
        out[value] = cal.summary()
    return out


def grouped_by_source(texts: list[tuple[str, str]]) -> dict[str, dict]:
    """The summary per model over (text, model) pairs."""
    out: dict[str, Calibration] = {}
    for text, model in texts:
        out.setdefault(model, Calibration()).add(text)
    return {model: cal.summary() for model, cal in sorted(out.items())}


def _group_table(by: str, groups: dict[str, dict]) -> Table:
    table = Table(title=f"per {by}")
    for col in (by, "refused", "admitted-met", "admitted-missed", "missed",
                "TTFT p50", "TTFT within 2x", "TPOT p50", "TPOT within 2x"):
        table.add_column(col, justify="right")
    for value, g in groups.items():
        c, q = g["confusion"], g["calibration"]
        table.add_row(value, f"{c['refused']:.0f}", f"{c['admitted-met']:.0f}",
                      f"{c['admitted-missed']:.0f}", _fmt(g["missed_share_of_admitted"], True),
                      _fmt(q["ttft"]["p50"]), _fmt(q["ttft"]["within_2x"], True),
                      _fmt(q["tpot"]["p50"]), _fmt(q["tpot"]["within_2x"], True))
    return table


@app.command()
def calibration(
    metrics: list[str] = typer.Option(None, "--metrics", help="A /metrics URL to read "
                                      "(repeatable); default: every local graph's Router "
                                      "replicas and frontends."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    by: str | None = typer.Option(None, "--by", help="Also per 'class', per 'worker' "
                                  "(the worker each request was predicted for) or per "
                                  "'model' (the local graphs' models)."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help="Where local graphs are registered."),
) -> None:
    """The admission confusion table, refusals by reason, and how close the TTFT and TPOT
    predictions came to what was measured."""
    if by is not None and by not in (*GROUP_LABELS, BY_MODEL):
        typer.echo(f"--by {by!r}: give one of {sorted((*GROUP_LABELS, BY_MODEL))}", err=True)
        raise typer.Exit(2)
    if by == BY_MODEL and metrics:
        typer.echo("--by model reads the local graphs (it knows no model of a --metrics URL)",
                   err=True)
        raise typer.Exit(2)
    sources = ([(url, "?") for url in metrics] if metrics
               else local_metrics_sources(state_dir))
    urls = [url for url, _ in sources]
    if not urls:
        typer.echo("no running graph found; pass --metrics URL", err=True)
        raise typer.Exit(1)
    cal = Calibration()
    read = [(text, model) for url, model in sources if (text := _fetch(url)) is not None]
    texts = [text for text, _ in read]
    if not texts:
        typer.echo(f"could not read any of {urls}", err=True)
        raise typer.Exit(1)
    for text in texts:
        cal.add(text)
    out = cal.summary()
    if by == BY_MODEL:
        out["by_model"] = grouped_by_source(read)
    elif by is not None:
        out[f"by_{by}"] = grouped(texts, by)
    if json_out:
        typer.echo(json.dumps(out, indent=2))
        return
    _print(out, by)


def _print(out: dict, by: str | None) -> None:
    """The human form of ``calibration``'s summary."""
    console = cli_console()
    table = Table(title="admission outcomes")
    table.add_column("outcome")
    table.add_column("requests", justify="right")
    for outcome, n in out["confusion"].items():
        table.add_row(outcome, f"{n:.0f}")
    console.print(table)
    console.print(f"missed among admitted: {_fmt(out['missed_share_of_admitted'], True)}; "
                  f"would-refuse that met the SLO (shadow): "
                  f"{_fmt(out['false_share_of_would_refuse'], True)}")
    for title, rows in (("refused", out["refusals_by_reason"]),
                        ("held, by how the hold ended", out["held_by_outcome"]),
                        ("would refuse (shadow)", out["would_refuse_by_reason"])):
        if rows:
            console.print(f"{title}: " + ", ".join(f"{r} {n:.0f}" for r, n in rows.items()))
    cal_table = Table(title="calibration: log2(measured / predicted), bucket bounds")
    for col in ("kind", "p10", "p50", "p90", "within 2x"):
        cal_table.add_column(col, justify="right")
    for kind, q in out["calibration"].items():
        cal_table.add_row(kind, _fmt(q["p10"]), _fmt(q["p50"]), _fmt(q["p90"]),
                          _fmt(q["within_2x"], True))
    console.print(cal_table)
    if out["stall_ms_per_token"]:
        stall = Table(title="prompt stall, ms per prompt token: charged by admission, "
                      "measured from finished answers")
        for col in ("worker", "charged", "measured", "measured / charged"):
            stall.add_column(col, justify="right")
        for worker, k in out["stall_ms_per_token"].items():
            charged, measured = k.get("charged"), k.get("measured")
            ratio = measured / charged if charged and measured is not None else None
            stall.add_row(worker, "-" if charged is None else f"{charged:.4f}",
                          "-" if measured is None else f"{measured:.4f}",
                          "-" if ratio is None else f"{ratio:.2f}")
        console.print(stall)
    if by is not None:
        console.print(_group_table(by, out[f"by_{by}"]))
