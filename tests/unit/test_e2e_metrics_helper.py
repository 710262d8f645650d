"""The e2e tests' one Prometheus reader, on text alone (no process, no HTTP)."""

from __future__ import annotations

from tests.e2e.helpers import by_label, fleet, metric, scrape

TEXT = r"""# HELP splitserve_prefill_jobs_total Prefill jobs by outcome
# TYPE splitserve_prefill_jobs_total counter
splitserve_prefill_jobs_total{outcome="done"} 3.0
splitserve_prefill_jobs_total{outcome="failed"} 1.0
# HELP splitserve_prefill_jobs_created Prefill jobs by outcome
# TYPE splitserve_prefill_jobs_created gauge
splitserve_prefill_jobs_created{outcome="done"} 1.7e+09
# HELP splitserve_worker_kv_usage_ratio KV blocks used / total
# TYPE splitserve_worker_kv_usage_ratio gauge
splitserve_worker_kv_usage_ratio{worker="a1",dp_rank="0"} 0.25
splitserve_worker_kv_usage_ratio{worker="b2",dp_rank="0"} 0.5
# HELP splitserve_frontend_ttft_seconds Time to first token
# TYPE splitserve_frontend_ttft_seconds histogram
splitserve_frontend_ttft_seconds_bucket{model="m",le="0.1"} 2.0
splitserve_frontend_ttft_seconds_bucket{model="m",le="+Inf"} 5.0
splitserve_frontend_ttft_seconds_sum{model="m"} 1.5
splitserve_frontend_ttft_seconds_count{model="m"} 5.0
# HELP splitserve_router_decisions_total Decisions
# TYPE splitserve_router_decisions_total counter
splitserve_router_decisions_total{profile="kv, \"aware\"",reason="a\\b\nc",worker="a1"} 4.0
splitserve_router_decisions_total{profile="round-robin",reason="picked",worker="a1"} 2.0
splitserve_router_decisions_total{profile="round-robin",reason="picked",worker="b2"} 1.0
# HELP dynamo_component_requests Requests (a counter typed without _total)
# TYPE dynamo_component_requests counter
dynamo_component_requests{endpoint="generate"} 7
splitserve_untyped_thing 9
"""


def test_samples_keep_their_names_labels_and_values():
    m = scrape(TEXT)
    assert m["splitserve_prefill_jobs_total"] == {(("outcome", "done"),): 3.0,
                                                  (("outcome", "failed"),): 1.0}
    assert "splitserve_prefill_jobs" not in m  # the family name is not a sample name
    assert m["splitserve_worker_kv_usage_ratio"] == {
        (("dp_rank", "0"), ("worker", "a1")): 0.25, (("dp_rank", "0"), ("worker", "b2")): 0.5}
    assert m["splitserve_frontend_ttft_seconds_bucket"] == {
        (("le", "0.1"), ("model", "m")): 2.0, (("le", "+Inf"), ("model", "m")): 5.0}
    assert m["splitserve_frontend_ttft_seconds_count"] == {(("model", "m"),): 5.0}
    assert m["splitserve_frontend_ttft_seconds_sum"] == {(("model", "m"),): 1.5}
    assert m["dynamo_component_requests"] == {(("endpoint", "generate"),): 7.0}
    assert m["splitserve_untyped_thing"] == {(): 9.0}


def test_escaped_label_values_are_unescaped():
    decisions = scrape(TEXT)["splitserve_router_decisions_total"]
    key = (("profile", 'kv, "aware"'), ("reason", "a\\b\nc"), ("worker", "a1"))
    assert decisions[key] == 4.0
    assert by_label(TEXT, "splitserve_router_decisions_total", "profile") == {
        'kv, "aware"': 4.0, "round-robin": 3.0}


def test_metric_sums_the_samples_whose_labels_match():
    name = "splitserve_router_decisions_total"
    assert metric(TEXT, name) == 7.0
    assert metric(TEXT, name, worker="a1") == 6.0
    assert metric(TEXT, name, profile="round-robin", worker="b2") == 1.0
    assert metric(TEXT, name, profile='kv, "aware"') == 4.0
    assert metric(TEXT, name, worker="zz") == 0.0
    assert metric(TEXT, "splitserve_prefill_jobs_total", outcome="done") == 3.0
    assert metric(TEXT, "splitserve_missing_total") == 0.0


def test_fleet_sums_over_the_replicas_that_serve_metrics():
    class Run:
        def replicas(self, component):
            assert component == "PrefillWorker"
            return [{"metrics": TEXT}, {"metrics": None}, {"metrics": TEXT}]

    assert fleet(Run(), "PrefillWorker", "splitserve_prefill_jobs_total") == {
        (("outcome", "done"),): 6.0, (("outcome", "failed"),): 2.0}
    assert fleet(Run(), "PrefillWorker", "splitserve_disagg_fallbacks_total") == {}
