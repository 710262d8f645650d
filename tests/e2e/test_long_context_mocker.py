"""A simulated long-context fleet: Common.context_length above the model's own window on
mocker workers serves a 100k-token prompt and refuses one beyond the configured window."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.graphs import start_graph

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_mocker_fleet_serves_prompts_up_to_the_configured_context_length(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Worker.replicas=1",
                           "--Worker.engine_args.speedup_ratio=100",
                           "--Common.context_length=131072")
    rng = random.Random(0)
    try:
        answers = {}
        for n in (100_000, 140_000):
            prompt = [rng.randint(100, 40_000) for _ in range(n)]
            answers[n] = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4})
    finally:
        assert run.stop() == 0, run.output()[-3000:]
    assert answers[100_000].status_code == 200, answers[100_000].text
    assert answers[100_000].json()["usage"]["prompt_tokens"] == 100_000
    refused = answers[140_000]
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert "131072" in refused.json()["error"]["message"]
