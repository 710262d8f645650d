"""What ``heldout.py`` reads besides the meter's latencies: this project's admission
counters (confusion table, verdicts, holds) and frontend load from its ``/metrics``, and
the per-5 s timelines of a run's requests."""

from __future__ import annotations

import contextlib
import re
import time

from splitserve.bench.graphrun import parse_prometheus


MetricsUrls = str | list[str] | None
"""One ``/metrics`` URL, or one per replica (several frontend processes), summed."""


def _texts(metrics_urls: MetricsUrls, timeout_s: float = 10) -> list[str]:
    import urllib.request

    urls = [metrics_urls] if isinstance(metrics_urls, str) else list(metrics_urls or ())
    out = []
    for url in urls:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            out.append(r.read().decode())
    return out


def confusion(metrics_urls: MetricsUrls, family: str = "splitserve_qos_confusion_total",
              keys: tuple[str, ...] = ("outcome",)) -> dict[str, float] | None:
    """Our frontend's counters of ``family`` summed by the ``keys`` labels (joined by
    '/') over its replicas: the confusion table by default, the verdicts by outcome and
    reason with ``verdicts``."""
    if metrics_urls is None:
        return None
    out: dict[str, float] = {}
    for text in _texts(metrics_urls):
        for labels, v in parse_prometheus(text).get(family, {}).items():
            cell = "/".join(dict(labels).get(k, "") for k in keys)
            out[cell] = out.get(cell, 0.0) + v
    return out


def prediction_error(metrics_urls: MetricsUrls) -> dict[str, dict] | None:
    """Our frontend's prediction error over the run, per kind (``ttft``, ``tpot``): the
    p10, p50 and p90 of log2(measured / predicted) and the share within 2x, read from
    its histograms (every replica's) as ``dynamo qos calibration`` reads them."""
    if metrics_urls is None:
        return None
    from splitserve.cli.qos_cmd import Calibration

    cal = Calibration()
    for text in _texts(metrics_urls):
        cal.add(text)
    return cal.summary()["calibration"]


def verdicts(metrics_urls: MetricsUrls) -> dict[str, float] | None:
    """Admission's verdicts by outcome and reason (``no-estimate``: judged on no fit)."""
    return confusion(metrics_urls, "splitserve_qos_admissions_total", ("outcome", "reason"))


class Sampler:
    """Our frontend's event-loop lag and requests in flight, read from its /metrics every
    ``every_s`` while a case runs (a saturated loop delays every stream it carries)."""

    GAUGES = {"splitserve_frontend_event_loop_lag_seconds": "loop_lag_s",
              "splitserve_frontend_inflight_requests": "inflight"}

    def __init__(self, metrics_urls: MetricsUrls, every_s: float = 0.5) -> None:
        import threading

        self.url, self.every_s, self.rows = metrics_urls, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(OSError, ValueError):
                fams = [parse_prometheus(text) for text in _texts(self.url, 2)]
                row = {"t_s": round(time.monotonic() - t0, 2)}
                for fam, key in self.GAUGES.items():  # the replicas' loop lag: the worst
                    values = [sum(f.get(fam, {}).values()) for f in fams]
                    row[key] = max(values) if key == "loop_lag_s" else sum(values)
                self.rows.append(row)

    def __enter__(self) -> Sampler:
        if self.url:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.url:
            self._thread.join(5)

    def windows(self, width_s: float = 5.0) -> list[dict]:
        """Per ``width_s`` of the run: the highest loop lag and requests in flight seen."""
        out: dict[int, dict] = {}
        for row in self.rows:
            w = out.setdefault(int(row["t_s"] // width_s), {"from_s": int(row["t_s"] // width_s)
                                                            * width_s})
            for key in self.GAUGES.values():
                w[f"max_{key}"] = max(w.get(f"max_{key}", 0.0), row.get(key, 0.0))
        return [out[k] for k in sorted(out)]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def timeline(records: list[dict], slo: dict[str, float], width_s: float = 5.0) -> list[dict]:
    """Per ``width_s`` of scheduled arrivals: requests sent, refused (503), served in
    the SLO, admitted and missed (served late, or no answer), and the admitted requests'
    measured TTFT against admission's prediction (``x-splitserve-predicted-ttft-ms``;
    requests that never got a first token carry none)."""
    rows: dict[int, dict] = {}
    for r in records:
        k = int(r["scheduled_s"] // width_s)
        row = rows.setdefault(k, {"from_s": k * width_s, "sent": 0, "refused": 0,
                                  "met": 0, "admitted_missed": 0, "_ttft": [], "_pred": [],
                                  "_ratio": []})
        row["sent"] += 1
        if r["outcome"] == "rejected":
            row["refused"] += 1
            continue
        ok = (r["outcome"] == "ok" and r.get("ttft_s") is not None
              and r["ttft_s"] * 1000 <= slo.get("ttft_ms", float("inf"))
              and (r.get("tpot_s") is None
                   or r["tpot_s"] * 1000 <= slo.get("tpot_ms", float("inf"))))
        row["met" if ok else "admitted_missed"] += 1
        if r.get("ttft_s") is not None:
            row["_ttft"].append(r["ttft_s"])
            if r.get("predicted_ttft_s") is not None:
                row["_pred"].append(r["predicted_ttft_s"])
                row["_ratio"].append(r["ttft_s"] / max(1e-3, r["predicted_ttft_s"]))
    out = []
    for k in sorted(rows):
        row = rows[k]
        ttft, pred, ratio = row.pop("_ttft"), row.pop("_pred"), row.pop("_ratio")
        row.update(ttft_p50_s=_pct(ttft, 0.5), predicted_p50_s=_pct(pred, 0.5),
                   measured_over_predicted_p50=_pct(ratio, 0.5))
        out.append(row)
    return out


def rejected_codes(records: list[dict]) -> dict[str, int]:
    """Requests not served, by outcome and the error's OpenAI ``code`` when it has one."""
    codes: dict[str, int] = {}
    for r in records:
        if r["outcome"] != "ok":
            text = str(r.get("error", ""))
            found = re.search(r'"code":\s*"([^"]+)"', text)
            key = f"{r['outcome']}: {found.group(1) if found else text[:60]}"
            codes[key] = codes.get(key, 0) + 1
    return codes


def false_refusals(shadow: dict[str, float] | None) -> tuple[float, float, float] | None:
    """From shadow mode's confusion table: (would refuse, of those met the SLO anyway,
    that share): the refusals the default would have made in vain on this traffic."""
    if not shadow:
        return None
    met, missed = shadow.get("would-refuse-met", 0.0), shadow.get("would-refuse-missed", 0.0)
    would = met + missed
    return (would, met, met / would) if would else (0.0, 0.0, 0.0)
