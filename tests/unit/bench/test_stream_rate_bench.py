"""The stream-rate benchmark reads each answer's step only from gaps whose both tokens
arrived inside its window (after the prompts were prefilled)."""

from __future__ import annotations

import pytest

from .loader import load_benchmark

pytestmark = pytest.mark.unit

bench_stream_rate = load_benchmark("bench_stream_rate")


def test_steps_are_read_inside_the_window_only():
    start = 100.0
    w0 = start + bench_stream_rate.SETTLE_S + bench_stream_rate.WINDOW[0]
    w1 = start + bench_stream_rate.SETTLE_S + bench_stream_rate.WINDOW[1]
    # Slow tokens before the window (prefill, a burst), 20 ms ones inside it.
    before = [start + 0.5 * i for i in range(int((w0 - start) / 0.5))]
    inside = [w0 + 0.02 * i for i in range(int((w1 - w0) / 0.02))]
    answers = [(start, before + inside), (start, before)]  # the second ended before
    steps = bench_stream_rate.steps_in(answers, start)
    assert steps == [pytest.approx(20.0)]
