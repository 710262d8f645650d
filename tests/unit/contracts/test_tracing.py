"""``contracts.tracing``: off by default at no cost, on through the OTEL_* variables,
W3C trace context in and out."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from splitserve.contracts import tracing
from splitserve.contracts.tracing import NOOP, parse_traceparent, wanted_exporters

pytestmark = pytest.mark.unit

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exported():
    """Tracing on in this process with an in-memory exporter; the finished spans."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    assert tracing.setup("TestComponent", environ={}, exporter=exporter)
    try:
        yield exporter.get_finished_spans
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


def test_off_without_the_variables_and_when_the_sdk_is_disabled():
    assert wanted_exporters({}) == []
    assert wanted_exporters({"OTEL_TRACES_EXPORTER": "none",
                             "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) == []
    assert wanted_exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                             "OTEL_SDK_DISABLED": "true"}) == []
    assert wanted_exporters({"OTEL_TRACES_EXPORTER": "otlp",
                             "OTEL_SDK_DISABLED": "TRUE"}) == []
    assert wanted_exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces"}
                            ) == ["otlp"]
    assert wanted_exporters({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    assert not tracing.setup("Frontend", environ={"OTEL_SDK_DISABLED": "true",
                                                  "OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing.enabled()


def test_off_every_helper_is_the_shared_noop():
    assert not tracing.enabled()
    span = tracing.start("request", {"traceparent": CLIENT}, {"a": 1}, kind="server")
    assert span is NOOP and not span
    assert span.child("x") is NOOP and span.carrier() == {}
    span.set({"a": 1})
    span.record("y", 0, 1)
    span.end({"b": 2}, error="boom")
    assert tracing.from_dynamo(object()) is None
    assert tracing.dynamo_context(span) is None
    assert tracing.inject(None) is None and tracing.inject({"k": "v"}) == {"k": "v"}
    with tracing.active({"traceparent": CLIENT}):
        assert tracing.current() is NOOP
    tracing.record("z", None, 0, 1)


def test_off_imports_no_opentelemetry():
    """Importing the module and the request path's helpers, off, loads nothing of
    OpenTelemetry (the process starts clean: this one has loaded the SDK in other
    tests)."""
    code = (
        "import sys\n"
        "from splitserve.contracts import tracing\n"
        "from splitserve.components.frontend import app, pipeline, backend, inproc\n"
        "from splitserve.components.worker import coordinator, prefill_loop, kv_moves\n"
        "from splitserve.components.router import service\n"
        "from splitserve.components.prefill_queue import nats_queue\n"
        "assert not tracing.setup('Frontend')\n"
        "s = tracing.start('request', {'traceparent': 'x'})\n"
        "s.end({'a': 1})\n"
        "tracing.stream_span(None)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_off_costs_well_under_a_microsecond_per_call():
    span = tracing.start("request")
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        s = tracing.start("stream", span)
        s.end()
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 2e-6, per_call  # two calls; about 0.1 us each on this machine


@pytest.mark.parametrize("value,expected", [
    (CLIENT, (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331, 1)),
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
     (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331, 0)),
    # a later version may append fields; its first four are read
    ("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
     (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331, 1)),
])
def test_traceparent_parses(value, expected):
    tp = parse_traceparent(value)
    assert tp is not None and (tp.trace_id, tp.span_id, tp.flags) == expected
    assert parse_traceparent(tp.header()) == tp


@pytest.mark.parametrize("value", [
    None, 17, "", "garbage", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",  # extra on version 00
    "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",  # short trace id
    "x" * 10_000,
])
def test_bad_traceparents_are_refused(value):
    assert parse_traceparent(value) is None


def test_on_spans_continue_the_callers_trace_and_export(exported):
    root = tracing.start("POST /v1/chat/completions", {"traceparent": CLIENT,
                                                       "tracestate": "vendor=1"},
                         {"http.request.method": "POST", "skip": None}, kind="server")
    assert root
    carrier = root.carrier()
    tp = parse_traceparent(carrier["traceparent"])
    assert tp.trace_id == 0x0af7651916cd43dd8448eb211c80319c and tp.sampled
    assert carrier["tracestate"] == "vendor=1"
    # another process continues it from the carrier
    remote = tracing.start("decode", dict(carrier), kind="server")
    remote.record("offload", remote.start_ns, tracing.now_ns(), {"where": "remote",
                                                                   "obj": object()})
    with tracing.active(remote):
        assert tracing.inject({"Nats-Msg-Id": "r1"})["traceparent"].startswith(
            "00-0af7651916cd43dd8448eb211c80319c-")
        tracing.record("admission", None, remote.start_ns, tracing.now_ns(), {"v": True})
    remote.end({"tokens": 3}, error="boom")
    root.end({"http.response.status_code": 200})
    spans = {s.name: s for s in exported()}
    assert set(spans) == {"POST /v1/chat/completions", "decode", "offload", "admission"}
    r = spans["POST /v1/chat/completions"]
    assert r.parent.span_id == 0xb7ad6b7169203331 and r.parent.is_remote
    assert r.attributes["http.response.status_code"] == 200 and "skip" not in r.attributes
    assert r.resource.attributes["service.name"] == "TestComponent"
    assert spans["decode"].parent.span_id == r.context.span_id
    assert spans["offload"].parent.span_id == spans["decode"].context.span_id
    assert spans["admission"].parent.span_id == spans["decode"].context.span_id
    assert spans["decode"].status.status_code.name == "ERROR"
    assert {s.context.trace_id for s in spans.values()} == {tp.trace_id}


def test_on_a_bad_or_missing_traceparent_starts_a_new_trace(exported):
    for headers in ({"traceparent": "00-nope"}, {}, {"traceparent": 5}):
        tracing.start("request", headers, kind="server").end()
    spans = exported()
    assert len(spans) == 3
    assert all(s.parent is None for s in spans)
    assert len({s.context.trace_id for s in spans}) == 3


def test_on_the_service_name_follows_otel_service_name():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.setup("Router", environ={"OTEL_SERVICE_NAME": "edge-router"}, exporter=exporter)
    try:
        tracing.start("x").end()
    finally:
        tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "edge-router"


def test_on_dynamo_metadata_carries_the_context(exported):
    class Meta(dict):
        pass

    class Ctx:
        metadata = Meta()

    span = tracing.start("stream")
    ctx = Ctx()
    tracing.to_dynamo(ctx, span)
    assert tracing.from_dynamo(ctx) == span.carrier()
    assert tracing.from_dynamo(object()) is None  # no metadata: nothing carried
    child = tracing.start("route", tracing.from_dynamo(ctx))
    child.end()
    span.end()
    by_name = {s.name: s for s in exported()}
    assert by_name["route"].parent.span_id == by_name["stream"].context.span_id


def test_setup_from_the_variables_exports_over_otlp_http(monkeypatch):
    """The real exporter the variables pick, against a small receiver here."""
    from tests.e2e.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "unit")
        assert tracing.setup("Frontend")
        try:
            tracing.start("hello", {"traceparent": CLIENT}).end({"n": 1})
        finally:
            tracing.shutdown()  # flushes the batch
        spans = rx.spans()
    assert [(s.service, s.name, s.trace_id) for s in spans] == [
        ("unit", "hello", "0af7651916cd43dd8448eb211c80319c")]
    assert spans[0].attributes["n"] == 1
