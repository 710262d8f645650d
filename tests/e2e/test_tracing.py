"""One request through the disaggregated torch graph is one trace: the frontend, the
router, the decode worker and the prefill worker each export their spans (OTLP/HTTP, to
a receiver of this test's own), every span hangs under the client's ``traceparent``, and
the spans carry what each hop decided (admission, routing, offload, queue wait, prefill,
KV transfer, first token, stream)."""

from __future__ import annotations

import os
import secrets
import time

import httpx
import pytest

from splitserve.bench.graphrun import INFRA_ENV
from tests.e2e.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.e2e.prompts import FORCED, MODEL, QUESTIONS
from tests.integration.serve_helpers import ServeRun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# What one remotely prefilled request leaves, by span: its process and its parent's name.
TREE = {
    "POST /v1/chat/completions": ("Frontend", None),
    "stream": ("Frontend", "POST /v1/chat/completions"),
    "first_token": ("Frontend", "stream"),
    "routing": ("Router", "stream"),
    "admission": ("Router", "stream"),
    "decode": ("DecodeWorker", "stream"),
    "offload": ("DecodeWorker", "decode"),
    "remote_prefill": ("DecodeWorker", "decode"),
    "prefill_queue_wait": ("PrefillWorker", "remote_prefill"),
    "prefill": ("PrefillWorker", "remote_prefill"),
    "prefill_compute": ("PrefillWorker", "prefill"),
    "kv_transfer": ("PrefillWorker", "prefill"),
}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The disaggregated torch graph, remote prefill forced, exporting spans here."""
    with OtlpReceiver() as rx:
        env = {k: v for k, v in os.environ.items() if k not in INFRA_ENV}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=rx.url, OTEL_BSP_SCHEDULE_DELAY="100")
        run = ServeRun(tmp_path_factory.mktemp("traced"), "graphs.disagg:Frontend", "-f",
                       "configs/disagg.yaml", "--Frontend.port=0", FORCED, env=env)
        try:
            ready = run.wait_ready(180)
        except BaseException:
            run.kill_all()
            raise
        url = next(r["endpoint"] for r in ready["rows"] if r["component"] == "Frontend")
        try:
            yield rx, url
        finally:
            assert run.stop() == 0


def trace_of(rx: OtlpReceiver, trace_id: str, names, timeout_s: float = 30
             ) -> dict[str, ReceivedSpan]:
    """The trace's spans by name, once every one of ``names`` arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in rx.spans() if s.trace_id == trace_id]
        got = {s.name: s for s in spans}
        if set(names) <= set(got) or time.monotonic() > deadline:
            assert not rx.errors, rx.errors
            assert len(got) == len(spans), sorted(s.name for s in spans)  # one of each
            return got
        time.sleep(0.2)


def test_one_request_is_one_trace_across_every_process(traced):
    rx, url = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": MODEL, "temperature": 0, "max_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": QUESTIONS[0]}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"traceparent": f"00-{trace_id}-{client_span}-01"}) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "[DONE]" in text
    spans = trace_of(rx, trace_id, TREE)
    assert set(spans) == set(TREE), sorted(spans)
    root = spans["POST /v1/chat/completions"]
    assert root.parent_span_id == client_span  # the client's span is the root's parent
    for name, (service, parent) in TREE.items():
        s = spans[name]
        assert s.service == service, (name, s.service)
        if parent is not None:
            assert s.parent_span_id == spans[parent].span_id, (name, parent)
    pids = {s.service: s.pid for s in spans.values()}
    assert len(pids) == 4 and len(set(pids.values())) == 4, pids  # four processes

    a = {name: s.attributes for name, s in spans.items()}
    assert a[root.name]["http.response.status_code"] == 200
    assert a["stream"]["splitserve.finish_reason"] == "length"
    assert a["stream"]["splitserve.output_tokens"] == 6
    assert a["admission"]["splitserve.admission.verdict"] == "admit"
    assert a["admission"]["splitserve.admission.reason"]
    assert a["admission"]["splitserve.predicted_ttft_ms"] > 0
    assert a["admission"]["splitserve.predicted_tpot_ms"] > 0
    assert a["routing"]["splitserve.worker_id"] == a["decode"]["splitserve.worker_id"]
    assert any(k.startswith("splitserve.score.") for k in a["routing"]), a["routing"]
    assert a["offload"]["splitserve.offload.where"] == "remote"
    assert a["offload"]["splitserve.offload.reason"] == "forced-remote"
    assert a["remote_prefill"]["splitserve.outcome"] == "done"
    assert a["prefill"]["splitserve.outcome"] == "done"
    assert a["kv_transfer"]["splitserve.kv.bytes"] > 0
    assert a["kv_transfer"]["splitserve.kv.transfer_s"] > 0
    assert a["prefill_compute"]["splitserve.prefill.compute_s"] > 0
    assert a["decode"]["splitserve.output_tokens"] == 6
    # the queue wait ends where the prefill begins, after the job was enqueued
    wait = spans["prefill_queue_wait"]
    assert spans["remote_prefill"].start_ns <= wait.start_ns <= wait.end_ns
    assert wait.end_ns == spans["prefill"].start_ns


def test_a_bad_traceparent_starts_a_new_trace_and_the_request_is_served(traced):
    rx, url = traced
    before = {s.trace_id for s in rx.spans()}
    body = {"model": MODEL, "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "user", "content": QUESTIONS[2]}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                   headers={"traceparent": "00-not-a-trace-01"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    roots: list[ReceivedSpan] = []
    while not roots and time.monotonic() < deadline:
        roots = [s for s in rx.spans() if s.name == "POST /v1/chat/completions"
                 and s.trace_id not in before]
        time.sleep(0.2)
    assert len(roots) == 1 and roots[0].parent_span_id == ""
