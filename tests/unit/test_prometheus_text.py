"""splitserve.contracts.prometheus: the one reader of /metrics text, on real exposition
(prometheus_client's own ``generate_latest``) and on Dynamo-style text."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.contracts import prometheus

pytestmark = pytest.mark.unit

INF = math.inf


def exported() -> str:
    """What a component's /metrics serves: prometheus_client's exposition of a registry."""
    r = CollectorRegistry()
    jobs = Counter("app_jobs", "Jobs by outcome", ["outcome"], registry=r)
    jobs.labels("done").inc(3)
    jobs.labels("failed").inc()
    Counter("app_restarts", "Restarts", registry=r).inc(2)
    Gauge("app_queue", "Waiting requests", registry=r).set(4)
    usage = Gauge("app_kv_usage_ratio", "KV used", ["worker", "dp_rank"], registry=r)
    usage.labels("a1", "0").set(0.25)
    usage.labels("b2", "0").set(0.5)
    Gauge("app_unknown", "Not measured yet", registry=r).set(math.nan)
    lat = Histogram("app_ttft_seconds", "TTFT", ["model"], buckets=(0.1, 1.0), registry=r)
    for model, x in (("m", 0.05), ("m", 0.5), ("m", 5.0), ("n", 0.05)):
        lat.labels(model).observe(x)
    return generate_latest(r).decode()


# As Dynamo's runtime (the Rust prometheus crate) writes it: no ``_created`` series,
# integer values, a counter typed without ``_total``, an escaped label value, a
# histogram over several label sets, NaN and +Inf values, no final newline.
DYNAMO = r"""# HELP dynamo_component_requests_total Total number of requests processed
# TYPE dynamo_component_requests_total counter
dynamo_component_requests_total{dynamo_component="backend",dynamo_endpoint="generate"} 12
dynamo_component_requests_total{dynamo_component="backend",dynamo_endpoint="clear_kv"} 1
# HELP dynamo_component_errors Errors (a counter typed without _total)
# TYPE dynamo_component_errors counter
dynamo_component_errors{dynamo_endpoint="generate",error_type="a \"quoted\"\\path\nline"} 2
# HELP dynamo_component_inflight_requests Requests in flight
# TYPE dynamo_component_inflight_requests gauge
dynamo_component_inflight_requests{dynamo_endpoint="generate"} 3
dynamo_component_inflight_requests{dynamo_endpoint="clear_kv"} 0
# HELP dynamo_frontend_load_ratio Load
# TYPE dynamo_frontend_load_ratio gauge
dynamo_frontend_load_ratio NaN
# HELP dynamo_frontend_limit Limit
# TYPE dynamo_frontend_limit gauge
dynamo_frontend_limit +Inf
# HELP dynamo_component_request_duration_seconds Time spent
# TYPE dynamo_component_request_duration_seconds histogram
dynamo_component_request_duration_seconds_bucket{dynamo_endpoint="generate",le="0.005"} 0
dynamo_component_request_duration_seconds_bucket{dynamo_endpoint="generate",le="0.5"} 8
dynamo_component_request_duration_seconds_bucket{dynamo_endpoint="generate",le="+Inf"} 12
dynamo_component_request_duration_seconds_sum{dynamo_endpoint="generate"} 3.5
dynamo_component_request_duration_seconds_count{dynamo_endpoint="generate"} 12
dynamo_component_request_duration_seconds_bucket{dynamo_endpoint="clear_kv",le="0.005"} 1
dynamo_component_request_duration_seconds_bucket{dynamo_endpoint="clear_kv",le="0.5"} 1
dynamo_component_request_duration_seconds_bucket{dynamo_endpoint="clear_kv",le="+Inf"} 1
dynamo_component_request_duration_seconds_sum{dynamo_endpoint="clear_kv"} 0.001
dynamo_component_request_duration_seconds_count{dynamo_endpoint="clear_kv"} 1
dynamo_untyped_thing 9"""

TEXTS = {"exported": exported(), "dynamo": DYNAMO}
ERR = ("error_type", 'a "quoted"\\path\nline')


# (text, sample name, labels, value): parse() keeps the names as written.
PARSED = [
    ("exported", "app_jobs_total", (("outcome", "done"),), 3.0),
    ("exported", "app_jobs_total", (("outcome", "failed"),), 1.0),
    ("exported", "app_restarts_total", (), 2.0),
    ("exported", "app_queue", (), 4.0),
    ("exported", "app_kv_usage_ratio", (("dp_rank", "0"), ("worker", "b2")), 0.5),
    ("exported", "app_ttft_seconds_bucket", (("le", "0.1"), ("model", "m")), 1.0),
    ("exported", "app_ttft_seconds_bucket", (("le", "+Inf"), ("model", "m")), 3.0),
    ("exported", "app_ttft_seconds_count", (("model", "n"),), 1.0),
    ("exported", "app_ttft_seconds_sum", (("model", "m"),), 5.55),
    ("dynamo", "dynamo_component_requests_total",
     (("dynamo_component", "backend"), ("dynamo_endpoint", "generate")), 12.0),
    ("dynamo", "dynamo_component_errors", (("dynamo_endpoint", "generate"), ERR), 2.0),
    ("dynamo", "dynamo_frontend_limit", (), INF),
    ("dynamo", "dynamo_component_request_duration_seconds_bucket",
     (("dynamo_endpoint", "clear_kv"), ("le", "0.005")), 1.0),
    ("dynamo", "dynamo_untyped_thing", (), 9.0),
]


@pytest.mark.parametrize(("text", "name", "labels", "want"), PARSED)
def test_parse_keeps_names_labels_and_values(text, name, labels, want):
    got = prometheus.parse(TEXTS[text])[name][labels]
    assert type(got) is float and got == pytest.approx(want)


# (text, a name parse() must not produce): the parser's family names, its renaming.
NOT_NAMES = [("exported", "app_jobs"), ("exported", "app_ttft_seconds"),
             ("dynamo", "dynamo_component_requests"), ("dynamo", "dynamo_component_errors_total")]


@pytest.mark.parametrize(("text", "name"), NOT_NAMES)
def test_family_names_are_not_sample_names(text, name):
    assert name not in prometheus.parse(TEXTS[text])


@pytest.mark.parametrize("text", ["exported", "dynamo"])
def test_parse_is_the_library_parser_but_for_bare_counters(text):
    """Every sample the library reads, under the library's name, except that a counter
    typed without ``_total`` keeps its written name."""
    parsed = prometheus.parse(TEXTS[text])
    library = {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
               for fam in text_string_to_metric_families(TEXTS[text]) for s in fam.samples}
    ours = {(n.replace("dynamo_component_errors", "dynamo_component_errors_total"), k): v
            for n, series in parsed.items() for k, v in series.items()}
    assert ours.keys() == library.keys()
    assert all(ours[k] == v or math.isnan(v) and math.isnan(ours[k])
               for k, v in library.items())


def test_nan_is_kept():
    assert math.isnan(prometheus.parse(TEXTS["exported"])["app_unknown"][()])
    assert math.isnan(prometheus.value(prometheus.parse(DYNAMO), "dynamo_frontend_load_ratio"))


# (text, name, labels to match, sum of the matching samples)
VALUES = [
    ("exported", "app_jobs_total", {}, 4.0),
    ("exported", "app_jobs_total", {"outcome": "done"}, 3.0),
    ("exported", "app_jobs_total", {"outcome": "lost"}, 0.0),
    ("exported", "app_jobs_total", {"shard": "x"}, 0.0),
    ("exported", "app_jobs_total", {"shard": ""}, 4.0),  # absent label == empty value
    ("exported", "app_missing_total", {}, 0.0),
    ("exported", "app_kv_usage_ratio", {"dp_rank": "0"}, 0.75),
    ("exported", "app_kv_usage_ratio", {"dp_rank": "0", "worker": "a1"}, 0.25),
    ("exported", "app_ttft_seconds_count", {}, 4.0),
    ("dynamo", "dynamo_component_requests_total", {"dynamo_endpoint": "generate"}, 12.0),
    ("dynamo", "dynamo_component_requests_total", {"dynamo_component": "backend"}, 13.0),
    ("dynamo", "dynamo_component_errors", {"error_type": ERR[1]}, 2.0),
    ("dynamo", "dynamo_component_inflight_requests", {}, 3.0),
    ("dynamo", "dynamo_frontend_limit", {}, INF),
]


@pytest.mark.parametrize(("text", "name", "labels", "want"), VALUES)
def test_value_sums_the_matching_samples(text, name, labels, want):
    assert prometheus.value(prometheus.parse(TEXTS[text]), name, **labels) == \
        pytest.approx(want)


# (text, name, label, labels to match, sums by the label's value)
BY_LABEL = [
    ("exported", "app_jobs_total", "outcome", {}, {"done": 3.0, "failed": 1.0}),
    ("exported", "app_kv_usage_ratio", "worker", {}, {"a1": 0.25, "b2": 0.5}),
    ("exported", "app_kv_usage_ratio", "dp_rank", {}, {"0": 0.75}),
    ("exported", "app_kv_usage_ratio", "worker", {"worker": "b2"}, {"b2": 0.5}),
    ("exported", "app_jobs_total", "shard", {}, {"": 4.0}),  # no such label: one group
    ("exported", "app_missing_total", "outcome", {}, {}),
    ("dynamo", "dynamo_component_requests_total", "dynamo_endpoint",
     {"dynamo_component": "backend"}, {"generate": 12.0, "clear_kv": 1.0}),
    ("dynamo", "dynamo_component_errors", "error_type", {}, {ERR[1]: 2.0}),
    ("dynamo", "dynamo_component_request_duration_seconds_count", "dynamo_endpoint", {},
     {"generate": 12.0, "clear_kv": 1.0}),
]


@pytest.mark.parametrize(("text", "name", "label", "labels", "want"), BY_LABEL)
def test_by_label_groups_the_matching_samples(text, name, label, labels, want):
    assert prometheus.by_label(prometheus.parse(TEXTS[text]), name, label, **labels) == \
        pytest.approx(want)


def test_totals_drop_the_labels():
    totals = prometheus.totals(prometheus.parse(TEXTS["exported"]))
    assert totals["app_jobs_total"] == 4.0
    assert totals["app_kv_usage_ratio"] == 0.75
    assert totals["app_ttft_seconds_sum"] == pytest.approx(5.6)
    assert totals["app_ttft_seconds_count"] == 4.0
    assert math.isnan(totals["app_unknown"])
    dynamo = prometheus.totals(prometheus.parse(DYNAMO))
    assert dynamo["dynamo_component_requests_total"] == 13.0
    assert dynamo["dynamo_component_errors"] == 2.0
    assert "dynamo_component_errors_total" not in dynamo


# (text, histogram name, labels to match, buckets, count, sum)
HISTOGRAMS = [
    ("exported", "app_ttft_seconds", {"model": "m"}, {0.1: 1.0, 1.0: 2.0, INF: 3.0}, 3.0, 5.55),
    ("exported", "app_ttft_seconds", {"model": "n"}, {0.1: 1.0, 1.0: 1.0, INF: 1.0}, 1.0, 0.05),
    ("exported", "app_ttft_seconds", {}, {0.1: 2.0, 1.0: 3.0, INF: 4.0}, 4.0, 5.6),
    ("exported", "app_ttft_seconds", {"model": "x"}, {}, 0.0, 0.0),
    ("exported", "app_missing_seconds", {}, {}, 0.0, 0.0),
    ("dynamo", "dynamo_component_request_duration_seconds", {"dynamo_endpoint": "generate"},
     {0.005: 0.0, 0.5: 8.0, INF: 12.0}, 12.0, 3.5),
    ("dynamo", "dynamo_component_request_duration_seconds", {},
     {0.005: 1.0, 0.5: 9.0, INF: 13.0}, 13.0, 3.501),
]


@pytest.mark.parametrize(("text", "name", "labels", "buckets", "count", "total"), HISTOGRAMS)
def test_histogram_sums_the_matching_label_sets(text, name, labels, buckets, count, total):
    h = prometheus.histogram(prometheus.parse(TEXTS[text]), name, **labels)
    assert h.buckets == pytest.approx(buckets)
    assert list(h.buckets) == sorted(h.buckets)
    assert (h.count, h.sum) == (pytest.approx(count), pytest.approx(total))


# (cumulative buckets, q, the bound estimate)
QUANTILES = [
    ({}, 0.5, None),
    ({0.1: 0.0, INF: 0.0}, 0.5, None),
    ({0.1: 1.0, 1.0: 2.0, INF: 3.0}, 0.0, 0.1),
    ({0.1: 1.0, 1.0: 2.0, INF: 3.0}, 0.3, 0.1),
    ({0.1: 1.0, 1.0: 2.0, INF: 3.0}, 0.5, 1.0),
    ({0.1: 1.0, 1.0: 2.0, INF: 3.0}, 0.9, INF),  # beyond the last finite bound
    ({INF: 3.0, -0.5: 1.0, 0.5: 3.0}, 0.9, 0.5),  # any order
    ({-1.0: 0.0, 0.0: 8.0, 1.0: 9.0, INF: 10.0}, 0.5, 0.0),
]


@pytest.mark.parametrize(("buckets", "q", "want"), QUANTILES)
def test_bucket_quantile_is_the_first_bound_reaching_q(buckets, q, want):
    assert prometheus.bucket_quantile(buckets, q) == want


def test_histogram_quantile():
    h = prometheus.histogram(prometheus.parse(DYNAMO), "dynamo_component_request_duration_"
                             "seconds", dynamo_endpoint="generate")
    assert (h.quantile(0.5), h.quantile(0.99)) == (0.5, INF)
    assert prometheus.Histogram().quantile(0.5) is None


@pytest.mark.parametrize("text", ["app_jobs_total{outcome=done} 1\n", "app_jobs_total x\n",
                                  "# TYPE app_jobs_total\n"])
def test_malformed_text_raises_value_error(text):
    with pytest.raises(ValueError):
        prometheus.parse(text)


def test_empty_text_is_an_empty_scrape():
    assert prometheus.parse("") == {}


def test_imports_nothing_of_the_project():
    tree = ast.parse(Path(prometheus.__file__).read_text())
    roots = {(n.module or "").split(".")[0] for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
              for a in n.names}
    assert roots <= {"__future__", "collections", "dataclasses", "prometheus_client"}
