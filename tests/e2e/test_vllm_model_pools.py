"""Two models served by vLLM side by side in one routed graph: the tiny random Qwen3 of
``tiny_models`` as ``Common.model`` and a tiny random Llama with heads of 32 (vLLM's CPU
attention has no kernel for the shared Llama's heads of 16) as a ``Models`` pool, each
behind its own router with one vLLM worker.  Both are listed on /v1/models, each answers
under its served name with the greedy tokens transformers gives for that model, and
another name gets 404.  A peft adapter of the pooled Llama loaded at run time (`dynamo
lora load --base-model`) is served by vLLM under its own name and answers as transformers
with peft does, the base model's answer unchanged."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import dynamo
from tests.e2e.test_lora import MAX_TOKENS, greedy, peft_greedy
from tests.e2e.test_own_model import PROMPT_IDS, transformers_greedy
from tests.fixtures.tiny_models import write_lora_adapter, write_vllm_cpu_llama
from tests.graphs import start_graph
from tests.installed import needs_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.exclusive, needs_vllm]

FIRST, POOLED, ADAPTER = "vllm-qwen3", "vllm-llama", "vllm-llama-sql"
RANK = 8


@pytest.fixture(scope="module")
def pools(tmp_path_factory, tiny_models, smollm2_dir):
    root = tmp_path_factory.mktemp("vllm-pools")
    llama = write_vllm_cpu_llama(root / "llama", smollm2_dir)
    run, url = start_graph(
        root / "graph", "graphs.agg_router:Frontend", "configs/vllm_agg_router.yaml",
        f"--Common.model={tiny_models['qwen3']}", f"--Common.served_model_name={FIRST}",
        "--Worker.replicas=1", "--Worker.engine_args.max_model_len=512",
        "--Worker.engine_args.max_num_seqs=4", "--Worker.engine_args.enable_lora=true",
        "--Worker.engine_args.max_loras=2", f"--Worker.engine_args.max_lora_rank={RANK}",
        f"--Models.llama.model={llama}",
        f"--Models.llama.served_model_name={POOLED}", timeout_s=600)
    adapter = write_lora_adapter(llama, root / "adapter", rank=RANK)
    yield run, url, {FIRST: tiny_models["qwen3"], POOLED: llama, ADAPTER: adapter}
    assert run.stop(timeout_s=90) == 0, run.output()[-3000:]


def test_two_models_on_vllm_answer_each_with_its_own_weights(pools):
    run, url, dirs = pools
    listed = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    assert listed == [FIRST, POOLED]
    models = {r["component"]: r["model"] for r in run.status()["replicas"]}
    assert models["Worker"] == FIRST and models["Worker@llama"] == POOLED
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs[FIRST])  # both carry SmolLM2's tokenizer
    answers = {}
    for model in (FIRST, POOLED):
        r = greedy(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        answers[model] = r.json()["choices"][0]["text"]
        want = transformers_greedy(dirs[model], PROMPT_IDS, MAX_TOKENS)
        assert answers[model] == tok.decode(want, skip_special_tokens=True), model
    assert answers[FIRST] != answers[POOLED]
    r = httpx.post(f"{url}/v1/completions", timeout=30, json={
        "model": "nobody", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_an_adapter_of_the_pooled_model_is_served_by_vllm_as_peft_answers(pools):
    from transformers import AutoTokenizer

    run, url, dirs = pools
    res = dynamo(run, "lora", "load", ADAPTER, str(dirs[ADAPTER]), "--base-model", POOLED)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{ADAPTER}: loaded on {POOLED}")
    models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert list(models) == [FIRST, POOLED, ADAPTER]
    assert models[ADAPTER]["parent"] == POOLED
    tok = AutoTokenizer.from_pretrained(dirs[POOLED])
    base, adapted = greedy(url, POOLED), greedy(url, ADAPTER)
    assert base.status_code == 200 and adapted.status_code == 200, (base.text, adapted.text)
    want_base = transformers_greedy(dirs[POOLED], PROMPT_IDS, MAX_TOKENS)
    want_adapted = peft_greedy(dirs[POOLED], dirs[ADAPTER], PROMPT_IDS, MAX_TOKENS)
    assert want_adapted != want_base
    assert base.json()["choices"][0]["text"] == tok.decode(want_base, skip_special_tokens=True)
    assert adapted.json()["choices"][0]["text"] == tok.decode(want_adapted,
                                                              skip_special_tokens=True)
