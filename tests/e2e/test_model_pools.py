"""Two models in one routed graph (tiny random Qwen3 and Llama written by the fixture):
``Common.model`` and one ``Models`` pool, each with its own router and worker in its own
namespace behind one frontend.  Each answers under its served name with its own greedy
tokens (equal to transformers' for that model), /v1/models lists both, another name gets
404, `dynamo status` names each replica's model, `dynamo route explain --model` asks
that model's router, and a pool scaled to zero leaves
/v1/models (its requests get 503) until it is scaled back."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.helpers import dynamo, ready, scale
from tests.e2e.test_own_model import PROMPT_IDS, transformers_greedy
from tests.graphs import start_graph
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIRST, POOLED = "my-qwen3", "my-llama"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pools(tmp_path_factory, tiny_models):
    run, url = start_graph(tmp_path_factory.mktemp("model-pools"), "graphs.agg_router:Frontend",
                           "configs/agg_router.yaml", f"--Common.model={tiny_models['qwen3']}",
                           f"--Common.served_model_name={FIRST}",
                           f"--Models.llama.model={tiny_models['llama']}",
                           f"--Models.llama.served_model_name={POOLED}", timeout_s=240)
    yield run, url
    assert run.stop(timeout_s=60) == 0, run.output()[-3000:]


def listed(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]


def greedy(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
        "min_tokens": MAX_TOKENS, "logprobs": 0})


def test_each_model_answers_with_its_own_weights(pools, tiny_models):
    from transformers import AutoTokenizer

    _, url = pools
    # The graph is ready once every replica is; the frontend lists a pool once its
    # watch has seen that pool's workers, a moment later.
    wait_until(lambda: listed(url) == [FIRST, POOLED], 30, interval_s=0.2,
               what=f"/v1/models to list {FIRST} and {POOLED}")
    tok = AutoTokenizer.from_pretrained(tiny_models["qwen3"])  # both carry this tokenizer
    for model, family in ((FIRST, "qwen3"), (POOLED, "llama")):
        r = greedy(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        want = transformers_greedy(tiny_models[family], PROMPT_IDS, MAX_TOKENS)
        assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    assert greedy(url, FIRST).json()["choices"][0]["text"] != \
        greedy(url, POOLED).json()["choices"][0]["text"]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert FIRST in r.json()["error"]["message"] and POOLED in r.json()["error"]["message"]


def test_status_names_each_replicas_model(pools):
    run, _ = pools
    models = {r["component"]: r["model"] for r in run.status()["replicas"]}
    assert models["Worker"] == models["Router"] == FIRST
    assert models["Worker@llama"] == models["Router@llama"] == POOLED
    assert models["Frontend"] == f"{FIRST}, {POOLED}"
    shown = json.loads(dynamo(run, "status", "--json").stdout)
    rows = {r["component"]: r["model"] for s in shown["supervisors"] for r in s["replicas"]}
    assert rows == models
    for model, namespace in ((POOLED, "dynamo-llama"), (FIRST, "dynamo")):
        res = dynamo(run, "route", "explain", "--json", "--prompt", "Hi", "--model", model)
        assert res.returncode == 0, res.stderr
        explained = json.loads(res.stdout)
        assert (explained["model"], explained["namespace"]) == (model, namespace)
        assert explained["worker_id"] is not None
    res = dynamo(run, "route", "explain", "--prompt", "Hi", "--model", "nobody")
    assert res.returncode == 1 and "--model 'nobody': no local graph serves it" in res.stderr


def test_a_pool_scaled_away_leaves_the_list_until_it_is_back(pools):
    run, url = pools
    scale(run, "Worker@llama", 0)
    try:
        wait_until(lambda: listed(url) == [FIRST], 60, interval_s=0.5,
                   what="the llama pool left /v1/models")
        r = greedy(url, POOLED)
        assert r.status_code == 503, r.text
        assert greedy(url, FIRST).status_code == 200
    finally:
        scale(run, "Worker@llama", 1)
    wait_until(lambda: len(ready(run, "Worker@llama")) == 1 and listed(url) == [FIRST, POOLED],
               120, interval_s=0.5, what="the llama pool back on /v1/models")
    assert greedy(url, POOLED).status_code == 200
