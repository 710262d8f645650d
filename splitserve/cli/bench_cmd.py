"""`dynamo bench`: replay a trace against any OpenAI-compatible endpoint; JSON and PNG plots.

    dynamo bench run --url http://127.0.0.1:8000 \\
        --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --duration-s 60 --token-scale 16 --output-scale 16 --slo ttft=500,tpot=50 \\
        --out results.json --plots plots/
    dynamo bench sweep --url http://127.0.0.1:8000 --rate-scales 2,4,8 --duration-s 60 \\
        --out sweep.json --plots plots/
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import typer

from splitserve.bench import replay as rp
from splitserve.bench import sweep as sw

app = typer.Typer(help="Replay request traces against an OpenAI-compatible endpoint, "
                       "write JSON results and PNG plots.", no_args_is_help=True)

TRACE_HELP = "Mooncake JSONL or Azure CSV (relative paths: working directory, then repository root)"


def build_config(*, trace: str = rp.DEFAULT_TRACE, fmt: str = "auto", start_s: float = 0.0,
                 duration_s: float | None = None, max_requests: int | None = None,
                 time_scale: float = 1.0, rate_scale: float = 1.0, token_scale: int = 16,
                 output_scale: float = 1.0, max_output: int | None = None,
                 context: int = rp.DEFAULT_CONTEXT, seed: int = 0,
                 slo: str = "ttft=2000,tpot=100", request_timeout: float = 300.0,
                 model: str | None = None) -> rp.ReplayConfig:
    """Validated replay settings from CLI values (raises typer.BadParameter)."""
    if fmt not in ("auto", "mooncake", "azure"):
        raise typer.BadParameter(f"unknown format {fmt!r}", param_hint="--format")
    for name, v in (("--time-scale", time_scale), ("--rate-scale", rate_scale),
                    ("--output-scale", output_scale), ("--request-timeout", request_timeout)):
        if not v > 0:
            raise typer.BadParameter("must be > 0", param_hint=name)
    if duration_s is not None and not duration_s > 0:
        raise typer.BadParameter("must be > 0", param_hint="--duration-s")
    if max_requests is not None and max_requests < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--max-requests")
    if token_scale < 1 or rp.TRACE_BLOCK_TOKENS % token_scale:
        raise typer.BadParameter(f"must divide {rp.TRACE_BLOCK_TOKENS}", param_hint="--token-scale")
    try:
        slo_d = rp.parse_slo(slo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--slo") from None
    return rp.ReplayConfig(trace=trace, format=fmt, start_s=start_s, duration_s=duration_s,
                           max_requests=max_requests, time_scale=time_scale,
                           rate_scale=rate_scale, token_scale=token_scale,
                           output_scale=output_scale, max_output=max_output, context=context,
                           seed=seed, slo=slo_d, timeout_s=request_timeout, model=model)


def _describe(reqs: list, workload: dict, label: str = "") -> None:
    tag = f"[{label}] " if label else ""
    p = workload["prompt_tokens"]
    offered = workload["offered_rps"]
    typer.echo(f"{tag}{len(reqs)} requests over {workload['replay_span_s']:.1f}s "
               f"({'-' if offered is None else f'{offered:.1f}'} req/s offered); prompt tokens "
               f"p50 {p['p50']:.0f} p99 {p['p99']:.0f}; {workload['clipped_requests']} clipped")


def execute_run(url: str, cfg: rp.ReplayConfig, *, label: str = "", progress_s: float = 5.0,
                deadline_s: float | None = None) -> dict:
    """Prepare, replay and summarise one run (printing progress); the JSON-ready result."""
    reqs, workload = rp.prepare(cfg)
    _describe(reqs, workload, label)
    res = rp.run_replay(url, cfg, label=label, progress_s=progress_s, deadline_s=deadline_s,
                        reqs=reqs, workload=workload)
    rp.print_summary(res["summary"], label)
    return res


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    typer.echo(f"wrote {path}")


def _command() -> str:
    return "dynamo " + " ".join(sys.argv[1:]) if sys.argv else "dynamo bench"


# shared options -----------------------------------------------------------------------
URL = typer.Option(..., "--url", help="Base URL of an OpenAI-compatible server")
TRACE = typer.Option(rp.DEFAULT_TRACE, "--trace", help=TRACE_HELP)
FMT = typer.Option("auto", "--format", help="auto, mooncake or azure")
START = typer.Option(0.0, "--start-s", help="Window start (trace seconds)")
DURATION = typer.Option(None, "--duration-s", help="Window length (trace seconds)")
MAXREQ = typer.Option(None, "--max-requests", help="At most this many requests")
TSCALE = typer.Option(1.0, "--time-scale", help="Multiply arrival times (0.5 = twice as fast)")
TOKSCALE = typer.Option(16, "--token-scale", help="Divide prompt lengths and the 512-token block")
OUTSCALE = typer.Option(1.0, "--output-scale", help="Divide output lengths")
MAXOUT = typer.Option(None, "--max-output", help="Clip max_tokens to this")
CONTEXT = typer.Option(rp.DEFAULT_CONTEXT, "--context", help="Served context length")
SEED = typer.Option(0, "--seed", help="Seed of the block token RNG")
SLO = typer.Option("ttft=2000,tpot=100", "--slo", help="ttft=MS,tpot=MS[,e2e=MS]")
RTIMEOUT = typer.Option(300.0, "--request-timeout", help="Per-request timeout (s)")
MODEL = typer.Option(None, "--model", help="Model name (default: first of /v1/models)")
DEADLINE = typer.Option(None, "--deadline-s", help="Cancel what still runs this long after start")
PROGRESS = typer.Option(5.0, "--progress-s", help="Progress line every N seconds (0 = none)")
PLOTS = typer.Option(None, "--plots", help="Write PNG plots into this directory")
RATE = typer.Option(1.0, "--rate-scale", help="Multiply the request rate")
RATES = typer.Option("1,2,4", "--rate-scales", help="Comma-separated request-rate multipliers")
FRESH = typer.Option(True, "--fresh-prefixes/--same-prefixes",
                     help="Seed each load point's block tokens differently (seed + i), so a "
                          "point cannot hit prefixes cached by the one before")
PAUSE = typer.Option(3.0, "--pause-s", help="Idle time between points")
OUT_RUN = typer.Option(None, "--out", help="Write the result JSON here")
OUT_SWEEP = typer.Option(None, "--out", help="Write the sweep JSON here")
LABEL_RUN = typer.Option("", "--label", help="Name of the endpoint in output and plots")
LABEL_SWEEP = typer.Option("endpoint", "--label", help="Name of the endpoint in the points")


@app.command("run")
def run(url: str = URL, trace: str = TRACE, fmt: str = FMT, start_s: float = START,
        duration_s: float | None = DURATION, max_requests: int | None = MAXREQ,
        time_scale: float = TSCALE,
        rate_scale: float = RATE,
        token_scale: int = TOKSCALE, output_scale: float = OUTSCALE,
        max_output: int | None = MAXOUT, context: int = CONTEXT, seed: int = SEED,
        slo: str = SLO, request_timeout: float = RTIMEOUT, model: str | None = MODEL,
        deadline_s: float | None = DEADLINE, progress_s: float = PROGRESS,
        out: Path | None = OUT_RUN, plots: Path | None = PLOTS,
        label: str = LABEL_RUN) -> None:
    """Replay one trace window open loop; TTFT/TPOT/E2E, goodput; JSON and CDF plots."""
    cfg = build_config(trace=trace, fmt=fmt, start_s=start_s, duration_s=duration_s,
                       max_requests=max_requests, time_scale=time_scale, rate_scale=rate_scale,
                       token_scale=token_scale, output_scale=output_scale,
                       max_output=max_output, context=context, seed=seed, slo=slo,
                       request_timeout=request_timeout, model=model)
    res = execute_run(url, cfg, label=label, progress_s=progress_s, deadline_s=deadline_s)
    res["command"] = _command()
    if out is not None:
        _write_json(out, res)
    if plots is not None:
        from splitserve.bench.plots import plot_latency_cdfs

        p = plot_latency_cdfs({label or url: res}, plots / "latency_cdf.png",
                              title=f"{Path(trace).name}, rate x{rate_scale:g}", slo=cfg.slo)
        typer.echo(f"wrote {p}")


@app.command("sweep")
def sweep(url: str = URL, trace: str = TRACE, fmt: str = FMT, start_s: float = START,
          duration_s: float | None = DURATION, max_requests: int | None = MAXREQ,
          time_scale: float = TSCALE,
          rate_scales: str = RATES,
          token_scale: int = TOKSCALE, output_scale: float = OUTSCALE,
          max_output: int | None = MAXOUT, context: int = CONTEXT, seed: int = SEED,
          fresh_prefixes: bool = FRESH, pause_s: float = PAUSE,
          slo: str = SLO, request_timeout: float = RTIMEOUT, model: str | None = MODEL,
          deadline_s: float | None = DEADLINE, progress_s: float = PROGRESS,
          out: Path | None = OUT_SWEEP, plots: Path | None = PLOTS,
          label: str = LABEL_SWEEP) -> None:
    """Replay the same window at several request rates; goodput and p99 TTFT vs load."""
    try:
        scales = sw.parse_rate_scales(rate_scales)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rate-scales") from None
    base = build_config(trace=trace, fmt=fmt, start_s=start_s, duration_s=duration_s,
                        max_requests=max_requests, time_scale=time_scale, rate_scale=scales[0],
                        token_scale=token_scale, output_scale=output_scale,
                        max_output=max_output, context=context, seed=seed, slo=slo,
                        request_timeout=request_timeout, model=model)
    results, points = {}, []
    for i, rs in enumerate(scales):
        cfg = replace(base, rate_scale=rs, seed=seed + i if fresh_prefixes else seed)
        tag = f"x{rs:g}"
        res = execute_run(url, cfg, label=tag, progress_s=progress_s, deadline_s=deadline_s)
        results[tag] = res
        points.append(sw.point_from_result(res, label, rs))
        if i + 1 < len(scales) and pause_s > 0:
            time.sleep(pause_s)
    typer.echo(sw.markdown_points(points))
    if out is not None:
        _write_json(out, {"command": _command(), "slo": base.slo, "points": points,
                          "results": results})
    if plots is not None:
        from splitserve.bench.plots import plot_latency_cdfs, plot_sweep

        for p in (plot_sweep(points, plots / "sweep.png", title=Path(trace).name, slo=base.slo),
                  plot_latency_cdfs(results, plots / "latency_cdf.png", title=Path(trace).name,
                                    slo=base.slo)):
            typer.echo(f"wrote {p}")
