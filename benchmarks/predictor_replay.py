"""Replay a run's admission inputs through the latency predictor, offline, and measure
how right its predictions were.

A frontend started with ``SPLITSERVE_QOS_TRACE=FILE`` writes every call its predictor
gets (each placement with its prompt, first tokens, decode progress, releases) to
FILE.  A run in shadow mode (``qos.mode: shadow``: everything admitted, nothing
refused) sends the same traffic whatever the predictor says, so its trace can be
replayed through any version of the predictor and the predictions compared on the
same requests: what an A/B of goodput on this machine cannot do (the same tree's
goodput varies by up to 1.4x from run to run), a replay does exactly, in seconds.

    SPLITSERVE_QOS_TRACE=run.jsonl python benchmarks/heldout.py \\
        --cases long-answer-sustained --configs splitserve-shadow
    python benchmarks/predictor_replay.py run.jsonl [--json out.json]

Reported per kind (TTFT, TPOT), over requests whose prediction came from a learned fit:
the p10 / p50 / p90 of log2(measured / predicted), the share within 2x, and against
each request's class targets (from the trace: the TPOT budget of a class that may
refuse; the TTFT target given with ``--ttft-ms``) how many were predicted within and
missed (admitted and missed, had admission enforced), and predicted over and met
(refused in vain).

With ``--verdicts`` (and ``--ttft-ms``) every placement is also judged as the enforcing
default would judge it (docs/qos.md's one-line form: the trace's class with that TTFT
target and its TPOT budget, ``may_reject``, holding on), and each verdict's reason is
set against how the request ended: per reason, how many there were and how many met
both targets.  A refusal or a hold whose request met is a false one, an admission whose
request missed is admitted-and-missed.  The run admitted everything, so its fleet was
busier than an enforcing one: "met" after a refusal is a lower bound of the false
refusals.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.router.qos.admission import admit  # noqa: E402
from components.router.qos.classes import QosConfig  # noqa: E402
from components.router.qos.predictor import Calibration  # noqa: E402
from components.router.qos.types import AdmissionRequest  # noqa: E402

EVENTS = ("place", "first_token", "progress", "release")


def read(path: str) -> list[dict]:
    """The predictor's input calls in a trace file, in the order they were made."""
    rows = []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("event") in EVENTS:
                rows.append(row)
    return rows


def enforcing(ttft_ms: float, tpot_ms: float, more: dict | None = None) -> QosConfig:
    """docs/qos.md's one-line admission form with these targets (holding on), and
    ``more`` of the ``qos`` section (``--qos``) over it."""
    return QosConfig.model_validate({
        "classes": [{"name": "default", "ttft_ms": ttft_ms, "tpot_ms": tpot_ms or 1e6,
                     "may_reject": True}], "low_priority_threshold_ms": 0, **(more or {})})


def replay(rows: Iterable[dict], predictor, ttft_ms: float | None = None,
           qos: dict | None = None) -> list[tuple[dict, Calibration]]:
    """Drive ``predictor`` (a fresh ``LatencyPredictor``) with the calls in ``rows``;
    returns each finished request's placement row with its calibration.  With
    ``ttft_ms``, each placement row also gets ``verdict``: the reason the enforcing
    default (``enforcing``, with ``qos`` over it) would give it at that moment."""
    placed: dict[str, dict] = {}
    configs: dict[float, QosConfig] = {}
    out = []
    for row in rows:
        event, rid, at = row["event"], row["request"], row["at"]
        if event == "place":
            config = None
            if ttft_ms is not None:
                budget = row["tpot_budget_ms"]
                if budget not in configs:
                    configs[budget] = enforcing(ttft_ms, budget, qos)
                config = configs[budget]
            est = predictor.predict(row["worker"], row["own"], at,
                                    output_tokens=row["max_tokens"], class_name=row["class"],
                                    restore_ms=row["restore_ms"],
                                    context_tokens=row.get("context", 0),
                                    running_slack=config is not None,
                                    headroom=config.hold.running_headroom if config else 0.0)
            if row["waited_ms"] > 0:
                est = est.model_copy(update={"waited_ms": row["waited_ms"]})
            if config is not None:
                verdict = admit(AdmissionRequest(
                    request_id=rid, class_name="default",
                    prompt_tokens=max(1, row.get("context") or row["own"]),
                    max_tokens=max(1, row["max_tokens"])), est, config, holding=True)
                row = {**row, "verdict": verdict.reason, "admitted": verdict.admit}
            predictor.place(rid, row["worker"], est, at, class_name=row["class"],
                            would_reject=row["would_reject"], max_tokens=row["max_tokens"],
                            tpot_budget_ms=row["tpot_budget_ms"])
            placed[rid] = row
        elif event == "first_token":
            predictor.first_token(rid, at)
        elif event == "progress":
            predictor.decode_progress(rid, row["tokens"], at)
        else:
            given = given_load(predictor, rid, at)
            cal = predictor.finish(rid, at, ok=row["ok"], ttft_s=row["ttft_s"],
                                   duration_s=row["duration_s"],
                                   output_tokens=row["output_tokens"])
            if cal is not None and rid in placed:
                out.append(({**placed.pop(rid), "given_load_tpot_ms": given}, cal))
    return out


def given_load(predictor, rid: str, now: float) -> float | None:
    """The TPOT the predictor's line gives for the load a request really ran in (its
    worker's mean batch, or mean KV where the line is on KV, and its prefill-busy share
    over its decode), read from the predictor's state just before its release: how
    right the model is once the load is known, apart from the load that arrived after
    the request was judged.  Reads the predictor's internals; None where they differ."""
    ticket = predictor.tickets.get(rid)
    start = predictor.at_first.get(rid)
    if ticket is None or start is None or now <= start[0] or now <= ticket.placed_at:
        return None
    base, slope, source = predictor.tpot_line(ticket.worker, now)
    if source == "warmup":
        return None
    w = predictor.workers[ticket.worker]
    span = now - ticket.placed_at
    if hasattr(ticket, "kv_area_at"):
        x = (w.kv_area - ticket.kv_area_at) / span
    else:
        x = max(1.0, (w.area - ticket.area_at) / span)
    busy = min(0.9, max(0.0, (w.busy_area - start[1]) / (now - start[0])))
    return (base + slope * x) / (1.0 - busy)


def _quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


LENGTHS = (16, 64, 256)
"""Answer lengths (``max_tokens``) that bound the TPOT errors' groups in ``summary``."""
LENGTH_GROUPS = (*(f"<={bound}" for bound in LENGTHS), f">{LENGTHS[-1]}")
"""The groups' names, shortest answers first."""


def length_group(max_tokens: int) -> str:
    """The answer-length group of ``summary``'s ``p50_by_answer_length``."""
    for bound, group in zip(LENGTHS, LENGTH_GROUPS, strict=False):
        if max_tokens <= bound:
            return group
    return LENGTH_GROUPS[-1]


def summary(results: list[tuple[dict, Calibration]], ttft_ms: float | None) -> dict:
    """The error quantiles and the confusion against the targets, per kind; for the
    TPOT kinds also the error's p50 per answer length (``length_group``)."""
    out: dict[str, dict] = {}
    for kind in ("ttft", "tpot", "tpot_given_load"):
        errs: list[float] = []
        by_length: dict[str, list[float]] = {}
        within_missed = over_met = judged = 0
        for place, cal in results:
            if kind == "ttft":
                observed, pred, meas = cal.ttft_observed, cal.predicted_ttft_ms, \
                    cal.measured_ttft_ms
                target = ttft_ms
                client_pred, client_meas = pred + cal.waited_ms, meas + cal.waited_ms
            elif kind == "tpot":
                observed, pred, meas = cal.tpot_observed, cal.predicted_tpot_ms, \
                    cal.measured_tpot_ms
                target = place["tpot_budget_ms"] or None
                client_pred, client_meas = pred, meas
            else:
                pred = place.get("given_load_tpot_ms")
                observed, meas = pred is not None, cal.measured_tpot_ms
                pred = pred or 0.0
                target = place["tpot_budget_ms"] or None
                client_pred, client_meas = pred, meas
            if not observed or meas is None or pred <= 0 or meas <= 0:
                continue
            errs.append(math.log2(meas / pred))
            if kind != "ttft":
                by_length.setdefault(length_group(place["max_tokens"]), []).append(errs[-1])
            if target:
                judged += 1
                if client_pred <= target < client_meas:
                    within_missed += 1
                elif client_meas <= target < client_pred:
                    over_met += 1
        if not errs:
            out[kind] = {"samples": 0}
            continue
        out[kind] = {
            "samples": len(errs),
            "p10": round(_quantile(errs, 0.10), 3), "p50": round(_quantile(errs, 0.50), 3),
            "p90": round(_quantile(errs, 0.90), 3),
            "within_2x": round(sum(1 for e in errs if abs(e) <= 1.0) / len(errs), 3),
            "mean_abs": round(sum(abs(e) for e in errs) / len(errs), 3),
            "judged": judged, "predicted_within_missed": within_missed,
            "predicted_over_met": over_met}
        if by_length:
            out[kind]["p50_by_answer_length"] = {
                group: {"samples": len(v), "p50": round(_quantile(v, 0.50), 3)}
                for group in LENGTH_GROUPS if (v := by_length.get(group))}
    return out


def met(place: dict, cal: Calibration, ttft_ms: float) -> bool:
    """Whether a request met its targets as its client saw them (its wait before the
    placement in its TTFT; its class's TPOT budget, when it has one)."""
    if cal.measured_ttft_ms + cal.waited_ms > ttft_ms:
        return False
    budget = place["tpot_budget_ms"]
    return not budget or cal.measured_tpot_ms is None or cal.measured_tpot_ms <= budget


def verdicts(results: list[tuple[dict, Calibration]], ttft_ms: float) -> dict:
    """Per verdict reason (``replay`` with a TTFT target), the requests and how many of
    them met their targets, and the median answer length (``max_tokens``) of those that
    met and of those that missed; with the admitted-and-missed and the false refusals
    (holds counted with them) as shares."""
    reasons: dict[str, dict] = {}
    lengths: dict[tuple[str, bool], list[float]] = {}
    admitted = missed = turned = turned_met = 0
    for place, cal in results:
        if "verdict" not in place:
            continue
        ok = met(place, cal, ttft_ms)
        cell = reasons.setdefault(place["verdict"], {"n": 0, "met": 0})
        cell["n"] += 1
        cell["met"] += ok
        lengths.setdefault((place["verdict"], ok), []).append(place["max_tokens"])
        if place["admitted"]:
            admitted += 1
            missed += not ok
        else:
            turned += 1
            turned_met += ok
    for (reason, ok), v in lengths.items():
        reasons[reason]["max_tokens_p50_" + ("met" if ok else "missed")] = _quantile(v, 0.5)
    return {"reasons": dict(sorted(reasons.items())), "admitted": admitted,
            "admitted_missed": missed,
            "admitted_missed_share": round(missed / admitted, 3) if admitted else None,
            "refused_or_held": turned, "of_which_met": turned_met,
            "false_share": round(turned_met / turned, 3) if turned else None}


def load_predictor(spec: str):
    """``module:Class`` (default: the tree's ``LatencyPredictor``), built fresh."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "LatencyPredictor")()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="QoS trace files (SPLITSERVE_QOS_TRACE)")
    ap.add_argument("--predictor", default="components.router.qos.predictor:LatencyPredictor",
                    help="module:Class of the predictor to replay through")
    ap.add_argument("--ttft-ms", type=float, default=None,
                    help="the TTFT target the confusion is judged on (default: none)")
    ap.add_argument("--verdicts", action="store_true",
                    help="also judge every placement as the enforcing default would, "
                    "against how it ended (needs --ttft-ms)")
    ap.add_argument("--qos", type=json.loads, default=None, metavar="JSON",
                    help="with --verdicts: fields of the qos section over the default "
                    "(e.g. '{\"hold\": {\"running_headroom\": 0.1}}')")
    ap.add_argument("--json", default=None, help="also write the summaries here")
    args = ap.parse_args(argv)
    if args.verdicts and args.ttft_ms is None:
        ap.error("--verdicts needs --ttft-ms")
    report = {}
    for path in args.traces:
        rows = read(path)
        if not any(r["event"] == "place" for r in rows):
            print(f"{path}: no placements recorded (a trace from before inputs were "
                  "traced?)", file=sys.stderr)
            return 2
        results = replay(rows, load_predictor(args.predictor),
                         args.ttft_ms if args.verdicts else None, args.qos)
        report[path] = summary(results, args.ttft_ms)
        for kind, s in report[path].items():
            print(f"{Path(path).name} {kind}: " + " ".join(f"{k}={v}" for k, v in s.items()))
        if args.verdicts:
            v = report[path]["verdicts"] = verdicts(results, args.ttft_ms)
            print(f"{Path(path).name} verdicts: " + " ".join(
                f"{k}={c['n']}/{c['met']}met" for k, c in v["reasons"].items())
                + f" | admitted-missed {v['admitted_missed']}/{v['admitted']}"
                f" false {v['of_which_met']}/{v['refused_or_held']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"predictor": args.predictor, "qos": args.qos,
                                               "report": report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
