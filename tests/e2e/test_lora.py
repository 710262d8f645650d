"""LoRA adapters on a live routed graph of torch workers serving a tiny random Llama (the
``tiny_models`` fixture) with a random peft adapter of it (``tiny_lora``):

- `dynamo lora load` loads it on the running worker; /v1/models then lists the base
  model and the adapter (its parent the base model);
- the adapter's greedy tokens differ from the base model's and equal what transformers
  with peft give for the same prompt tokens; the base model's are unchanged;
- `dynamo route explain --lora` names it (an adapter nobody loaded: `lora-not-loaded`);
- the management endpoint refuses a request without the graph's control token (401);
- a replica started afterwards loads the adapter too, and requests reach it;
- unloaded over HTTP, the adapter leaves /v1/models and its requests get 404;
- in a disaggregated graph the prefill worker loads the adapter too, and an adapter
  request is prefilled there with it and answers as peft does.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.helpers import dynamo, fleet, metric, ready, scale
from tests.e2e.prompts import FORCED
from tests.e2e.test_own_model import PROMPT_IDS, transformers_greedy
from tests.graphs import start_graph
from tests.integration.serve_helpers import http_post_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BASE, ADAPTER = "tiny-llama", "sql-lora"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def graph(tmp_path_factory, tiny_models):
    run, url = start_graph(tmp_path_factory.mktemp("lora"), "graphs.agg_router:Frontend",
                           "configs/agg_router.yaml", f"--Common.model={tiny_models['llama']}",
                           f"--Common.served_model_name={BASE}", "--Worker.replicas=1",
                           timeout_s=240)
    yield run, url
    assert run.stop(timeout_s=60) == 0, run.output()[-3000:]


def listed(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def greedy(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
        "min_tokens": MAX_TOKENS})


def peft_greedy(base_dir, adapter_dir, ids: list[int], n: int) -> list[int]:
    import warnings

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with warnings.catch_warnings():  # peft's own call of a deprecated transformers name
        warnings.filterwarnings("ignore", category=FutureWarning,
                                module=r"transformers\.modeling_utils")
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def adapters(run) -> list[dict]:
    res = dynamo(run, "lora", "list", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["data"]


def test_an_adapter_loaded_at_run_time_answers_as_peft_does(graph, tiny_models, tiny_lora):
    from transformers import AutoTokenizer

    run, url = graph
    res = dynamo(run, "lora", "load", ADAPTER, str(tiny_lora))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{ADAPTER}: loaded on {BASE}")
    models = listed(url)
    assert list(models) == [BASE, ADAPTER]
    assert models[ADAPTER]["parent"] == models[ADAPTER]["root"] == BASE
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    # The base model first: had its prompt's KV been credited to the adapter's request
    # (same tokens), the adapter's answer could not equal peft's below.
    base, adapted = greedy(url, BASE), greedy(url, ADAPTER)
    assert base.status_code == 200 and adapted.status_code == 200, (base.text, adapted.text)
    assert adapted.json()["model"] == ADAPTER
    want_base = transformers_greedy(tiny_models["llama"], PROMPT_IDS, MAX_TOKENS)
    want_adapted = peft_greedy(tiny_models["llama"], tiny_lora, PROMPT_IDS, MAX_TOKENS)
    assert want_adapted != want_base  # the adapter changes the answer...
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert base.json()["choices"][0]["text"] == text(want_base)
    assert adapted.json()["choices"][0]["text"] == text(want_adapted)  # ...as peft's does
    assert metric(f"{url}/metrics", "splitserve_frontend_requests_total", model=ADAPTER,
                  base_model=BASE, outcome="ok") == 1


def test_route_explain_names_the_adapter(graph):
    run, _ = graph
    res = dynamo(run, "route", "explain", "--json", "--prompt", "Hi", "--lora", ADAPTER)
    assert res.returncode == 0, res.stderr
    reply = json.loads(res.stdout)
    assert reply["lora"] == ADAPTER and reply["decision"]["lora"] == ADAPTER
    assert reply["worker_id"] is not None
    res = dynamo(run, "route", "explain", "--json", "--prompt", "Hi", "--lora", "nope")
    assert json.loads(res.stdout)["reason"] == "lora-not-loaded"


def test_the_management_endpoints_need_the_control_token(graph, tiny_lora):
    run, url = graph
    code, body = http_post_json(f"{url}/v1/load_lora_adapter",
                                {"lora_name": "x", "lora_path": str(tiny_lora)})
    assert code == 401 and body["error"]["type"] == "authentication_error"
    code, body = http_post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": ADAPTER},
                                token="not-the-token")
    assert code == 401
    code, body = http_post_json(f"{url}/v1/load_lora_adapter",
                                {"lora_name": "x", "lora_path": "/no/such/adapter"},
                                token=run.token())
    assert code == 400 and body["error"]["param"] == "lora_path"


def test_a_replica_started_later_loads_the_adapter(graph):
    run, url = graph
    scale(run, "Worker", 2)
    wait_until(lambda: len(ready(run, "Worker")) == 2, 180, what="a second worker")
    wait_until(lambda: sum(s["state"] == "loaded" for a in adapters(run)
                           for s in a["workers"].values()) == 2, 60,
               what="the adapter loaded on both workers")
    for _ in range(4):  # the router sends them to either: both answer the same
        r = greedy(url, ADAPTER)
        assert r.status_code == 200, r.text
    res = dynamo(run, "status", "--json")
    rows = [r for rows in json.loads(res.stdout)["etcd"].values() for r in rows
            if r["component"] == "worker" and r["endpoint"] == "generate"]
    assert [r.get("loras") for r in rows] == [{ADAPTER: "loaded"}] * 2


def test_an_unloaded_adapter_is_404(graph):
    run, url = graph
    code, body = http_post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": ADAPTER},
                                token=run.token(), timeout_s=30)
    assert code == 200, body
    assert list(listed(url)) == [BASE]
    r = greedy(url, ADAPTER)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert greedy(url, BASE).status_code == 200
    wait_until(lambda: adapters(run) == [], 30, what="the adapter's records gone")


@pytest.mark.deep  # its own disaggregated graph; the decision itself: tests/unit/worker
def test_a_disaggregated_graph_prefills_an_adapter_request_with_its_adapter(
        tmp_path_factory, tiny_models, tiny_lora):
    """The prefill worker loads the adapter as the decode worker does (its status has
    role ``prefill``); with remote prefill forced, the adapter's request is offloaded,
    its job names the adapter, and the answer is peft's (a prompt prefilled without the
    adapter would answer differently)."""
    from transformers import AutoTokenizer

    run, url = start_graph(tmp_path_factory.mktemp("lora-disagg"), "graphs.disagg:Frontend",
                           "configs/disagg.yaml", f"--Common.model={tiny_models['llama']}",
                           f"--Common.served_model_name={BASE}", FORCED, timeout_s=240)
    try:
        res = dynamo(run, "lora", "load", ADAPTER, str(tiny_lora))
        assert res.returncode == 0, res.stderr

        def roles() -> list[tuple[str, str]]:
            return sorted((w.get("role", "serve"), w["state"])
                          for a in adapters(run) for w in a["workers"].values())

        wait_until(lambda: roles() == [("prefill", "loaded"), ("serve", "loaded")], 60,
                   what="the adapter loaded on the decode and the prefill worker")
        r = greedy(url, ADAPTER)
        assert r.status_code == 200, r.text
        tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
        want = peft_greedy(tiny_models["llama"], tiny_lora, PROMPT_IDS, MAX_TOKENS)
        assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
        assert greedy(url, BASE).status_code == 200
        assert fleet(run, "DecodeWorker", "splitserve_disagg_decisions_total") == {
            (("reason", "forced-remote"), ("where", "remote")): 2.0}
        assert fleet(run, "PrefillWorker", "splitserve_prefill_jobs_total") == {
            (("outcome", "done"),): 2.0}
    finally:
        assert run.stop(timeout_s=60) == 0, run.output()[-3000:]
