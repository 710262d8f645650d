"""Observations from the supervisor's status and Prometheus text, without sockets."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve.planner.sources import (
    FrontendTotals,
    MetricsSource,
    build_observation,
    parse_metrics,
)

pytestmark = pytest.mark.unit

CONTROL = "http://control.test"


def worker_text(waiting: int, kv_ratio: float) -> str:
    return ("# TYPE splitserve_worker_waiting_requests gauge\n"
            f"splitserve_worker_waiting_requests {waiting}\n"
            "# TYPE splitserve_worker_kv_usage_ratio gauge\n"
            f"splitserve_worker_kv_usage_ratio {kv_ratio}\n")


def frontend_text(requests: int, prompt: int, output: int, ttft_sum: float, ttft_n: int) -> str:
    return ("# TYPE splitserve_frontend_requests_total counter\n"
            f'splitserve_frontend_requests_total{{endpoint="chat",outcome="ok",status="200"}} '
            f"{requests - 1}\n"
            f'splitserve_frontend_requests_total{{endpoint="chat",outcome="rejected",'
            f'status="503"}} 1\n'
            "# TYPE splitserve_frontend_prompt_tokens_total counter\n"
            f"splitserve_frontend_prompt_tokens_total {prompt}\n"
            "# TYPE splitserve_frontend_output_tokens_total counter\n"
            f"splitserve_frontend_output_tokens_total {output}\n"
            "# TYPE splitserve_frontend_ttft_seconds histogram\n"
            f'splitserve_frontend_ttft_seconds_bucket{{le="+Inf"}} {ttft_n}\n'
            f"splitserve_frontend_ttft_seconds_count {ttft_n}\n"
            f"splitserve_frontend_ttft_seconds_sum {ttft_sum}\n")


def row(component: str, index: int, state: str = "ready", metrics: str | None = None,
        endpoint: str = "") -> dict:
    return {"component": component, "replica": index, "state": state, "endpoint": endpoint,
            "metrics": metrics if metrics is not None else f"http://{component}-{index}/metrics"}


STATUS = {"replicas": [
    row("Frontend", 0, endpoint="http://frontend", metrics=""),
    row("PrefillWorker", 0), row("PrefillWorker", 1), row("PrefillWorker", 2, "starting"),
    row("DecodeWorker", 0), row("DecodeWorker", 1), row("DecodeWorker", 2, "stopping"),
]}


def test_parse_metrics_sums_labels():
    values = parse_metrics(frontend_text(10, 500, 50, 2.0, 4))
    assert values["splitserve_frontend_requests_total"] == 10
    assert values["splitserve_frontend_ttft_seconds_sum"] == 2.0


def test_build_observation_pools_and_rates():
    scrapes = {"http://PrefillWorker-0/metrics": parse_metrics(worker_text(3, 0.5)),
               "http://PrefillWorker-1/metrics": parse_metrics(worker_text(1, 0.1)),
               "http://DecodeWorker-0/metrics": parse_metrics(worker_text(6, 0.8)),
               "http://DecodeWorker-1/metrics": parse_metrics(worker_text(2, 0.4))}
    prev = FrontendTotals(0.0, parse_metrics(frontend_text(10, 1000, 100, 1.0, 2)))
    now = FrontendTotals(10.0, parse_metrics(frontend_text(30, 21000, 600, 4.0, 8)))
    o = build_observation(10.0, STATUS, scrapes, now, prev, queue_depth=4)
    # prefill: 3 live (2 ready + 1 starting); (3 + 1 waiting + 4 queued) / 2 ready
    assert (o.prefill.replicas, o.prefill.ready, o.prefill.queue_length) == (3, 2, 4.0)
    assert o.prefill.kv_cache_usage == pytest.approx(30.0)
    # decode: the stopping replica is not counted
    assert (o.decode.replicas, o.decode.queue_length) == (2, 4.0)
    assert o.decode.kv_cache_usage == pytest.approx(60.0) and o.decode.gpu_utilization is None
    assert (o.requests_per_s, o.prompt_tokens_per_s, o.output_tokens_per_s) == (2.0, 2000.0,
                                                                                 50.0)
    assert o.ttft_s == pytest.approx(0.5) and o.itl_s is None


def test_first_round_has_no_rates_and_empty_queue_is_zero():
    o = build_observation(0.0, STATUS, {}, None, None, queue_depth=0)
    assert o.requests_per_s is None and o.ttft_s is None
    assert o.prefill.queue_length == 0.0 and o.decode.queue_length is None


def test_gpu_metric_when_exported():
    text = worker_text(0, 0.2) + "# TYPE gpu_util gauge\ngpu_util 70\n"
    scrapes = {"http://DecodeWorker-0/metrics": parse_metrics(text),
               "http://DecodeWorker-1/metrics": parse_metrics(text.replace("70", "90"))}
    o = build_observation(0.0, STATUS, scrapes, None, None, None, gpu_metric="gpu_util")
    assert o.decode.gpu_utilization == 80.0


def test_metrics_source_scrapes_what_status_lists():
    counts = {"front": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if url == f"{CONTROL}/v1/status":
            return httpx.Response(200, json=STATUS)
        if url == "http://frontend/metrics":
            counts["front"] += 1
            n = counts["front"]
            return httpx.Response(200, text=frontend_text(10 * n, 100 * n, 10 * n, n, n))
        if url == "http://prefillworker-1/metrics":  # httpx lower-cases host names
            return httpx.Response(503)  # a replica going away: skipped, counted
        return httpx.Response(200, text=worker_text(2, 0.5))

    async def main():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        source = MetricsSource(CONTROL, client=client, queue_depth=lambda: 6)
        first = await source.observe(100.0)
        second = await source.observe(110.0)
        await client.aclose()
        return source, first, second

    source, first, second = asyncio.run(main())
    assert first.requests_per_s is None and second.requests_per_s == 1.0
    assert second.prompt_tokens_per_s == 10.0 and second.ttft_s == 1.0
    # the failed scrape is not read as zero: mean worker queue 2 + shared queue 6 / 2 ready
    assert second.prefill.queue_length == 2 + 6 / 2
    assert source.scrape_errors == 2


def test_a_pools_planner_reads_only_its_models_requests_from_a_shared_frontend():
    """A frontend serving several models labels its series by model; each pool's planner
    counts its own model's requests, tokens and latencies only."""
    text = ("# TYPE splitserve_frontend_requests_total counter\n"
            'splitserve_frontend_requests_total{endpoint="chat",outcome="ok",status="200",'
            'model="a"} 7\n'
            'splitserve_frontend_requests_total{endpoint="chat",outcome="ok",status="200",'
            'model="b"} 3\n'
            'splitserve_frontend_requests_total{endpoint="chat",outcome="invalid",'
            'status="400",model=""} 5\n'
            "# TYPE splitserve_frontend_ttft_seconds histogram\n"
            'splitserve_frontend_ttft_seconds_count{model="a"} 7\n'
            'splitserve_frontend_ttft_seconds_sum{model="a"} 0.7\n'
            'splitserve_frontend_ttft_seconds_count{model="b"} 3\n'
            'splitserve_frontend_ttft_seconds_sum{model="b"} 3.0\n')
    mine = parse_metrics(text, model="b")
    assert mine["splitserve_frontend_requests_total"] == 3
    assert (mine["splitserve_frontend_ttft_seconds_sum"],
            mine["splitserve_frontend_ttft_seconds_count"]) == (3.0, 3)
    assert parse_metrics(text)["splitserve_frontend_requests_total"] == 15


def test_a_pools_planner_counts_its_models_lora_adapters_too():
    """A LoRA adapter's requests run on its base model's workers: the frontend labels
    them with the adapter as model and the base as base_model, and the base pool's
    planner (which reads by base_model) counts them."""
    def text(adapter_requests: int) -> str:
        return ("# TYPE splitserve_frontend_requests_total counter\n"
                'splitserve_frontend_requests_total{endpoint="chat",outcome="ok",'
                'status="200",model="b",base_model="b"} 3\n'
                'splitserve_frontend_requests_total{endpoint="chat",outcome="ok",'
                f'status="200",model="b-lora",base_model="b"}} {adapter_requests}\n'
                'splitserve_frontend_requests_total{endpoint="chat",outcome="ok",'
                'status="200",model="a",base_model="a"} 7\n')

    assert parse_metrics(text(4), base_model="b")["splitserve_frontend_requests_total"] == 7
    assert parse_metrics(text(4), base_model="a")["splitserve_frontend_requests_total"] == 7
    status = {"replicas": [{"component": "Frontend", "state": "ready",
                            "endpoint": "http://frontend"}]}
    scrapes = iter([text(4), text(14)])

    def handler(request: httpx.Request) -> httpx.Response:
        if str(request.url) == f"{CONTROL}/v1/status":
            return httpx.Response(200, json=status)
        return httpx.Response(200, text=next(scrapes))

    async def main():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        source = MetricsSource(CONTROL, client=client, model="b")
        await source.observe(100.0)
        second = await source.observe(101.0)
        await client.aclose()
        return second

    assert asyncio.run(main()).requests_per_s == 10.0  # the adapter's, in b's pool
