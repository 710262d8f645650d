"""PNG plots of replay results: latency CDFs, and goodput / p99 TTFT against offered load.

Data preparation (:func:`cdf`, :func:`latency_samples`, :func:`sweep_series`) is pure and
tested; drawing uses matplotlib's non-interactive Agg backend, imported on first use.
"""

from __future__ import annotations

from pathlib import Path

from splitserve.bench.sweep import by_config


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF: sorted values and the fraction of samples <= each ((i + 1) / n)."""
    xs = sorted(v for v in values if v is not None)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def latency_samples(result: dict) -> dict[str, list[float]]:
    """TTFT and TPOT of the ok requests of one replay result, in milliseconds."""
    ok = [r for r in result.get("requests", []) if r.get("outcome") == "ok"]
    return {"ttft_ms": [r["ttft_s"] * 1e3 for r in ok if r.get("ttft_s") is not None],
            "tpot_ms": [r["tpot_s"] * 1e3 for r in ok if r.get("tpot_s") is not None]}


def sweep_series(points: list[dict]) -> dict[str, dict[str, list]]:
    """Per configuration, series ordered by load: offered req/s, goodput, p99 TTFT.
    Points without an offered rate are skipped."""
    out: dict[str, dict[str, list]] = {}
    for config, ps in by_config(points).items():
        ps = [p for p in ps if p.get("offered_rps") is not None]
        out[config] = {"offered_rps": [p["offered_rps"] for p in ps],
                       "goodput_rps": [p.get("goodput_rps") for p in ps],
                       "ttft_p99_ms": [p.get("ttft_p99_ms") for p in ps],
                       "rate_scale": [p["rate_scale"] for p in ps]}
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(results: dict[str, dict], path: str | Path, title: str = "",
                      slo: dict[str, float] | None = None) -> Path:
    """TTFT and TPOT CDFs, one line per labelled result; SLO limits as dashed lines."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        drawn = False
        for label, res in results.items():
            xs, ys = cdf(latency_samples(res)[key])
            if xs:
                ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
                drawn = True
        limit = (slo or {}).get(key)
        if limit is not None:
            ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of ok requests")
        ax.set_ylim(0, 1.01)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.set_xscale("log")
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title(f"{name} CDF")
    return _save(fig, path, title)


def plot_sweep(points: list[dict], path: str | Path, title: str = "",
               slo: dict[str, float] | None = None) -> Path:
    """Goodput and p99 TTFT against offered load, one line per configuration."""
    plt = _plt()
    fig, (ag, at) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = sweep_series(points)
    top = 0.0
    for config, s in series.items():
        ag.plot(s["offered_rps"], [g if g is not None else float("nan") for g in s["goodput_rps"]],
                marker="o", label=config)
        at.plot(s["offered_rps"], [t if t is not None else float("nan") for t in s["ttft_p99_ms"]],
                marker="o", label=config)
        top = max([top, *s["offered_rps"]])
    if top:
        ag.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="offered")
    ag.set_xlabel("offered load (req/s)")
    ag.set_ylabel("goodput (req/s meeting the SLO)")
    ag.set_title("Goodput" + (f" (SLO {_slo_text(slo)})" if slo else ""))
    at.set_xlabel("offered load (req/s)")
    at.set_ylabel("p99 TTFT (ms)")
    at.set_yscale("log")
    at.set_title("p99 TTFT")
    if slo and slo.get("ttft_ms") is not None:
        at.axhline(slo["ttft_ms"], color="grey", linestyle="--", linewidth=1, label="TTFT SLO")
    for ax in (ag, at):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path, title)


def _slo_text(slo: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in slo.items())


def _save(fig, path, title: str | None) -> Path:
    """Title, lay out and write a figure as PNG (creating its folder); returns the path."""
    plt = _plt()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
