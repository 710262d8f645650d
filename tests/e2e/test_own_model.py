"""The README's main command pointed at a model directory of the user's (a tiny random
Qwen3 written by the fixture): it is listed and answered under its served name, another
name gets 404, and the graph's greedy tokens equal transformers' on the same prompt."""

from __future__ import annotations

import httpx
import pytest

from tests.graphs import start_graph

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVED = "my-qwen3"
PROMPT_IDS = [1, 504, 3458, 282, 4649, 314, 1345, 30]  # plain ids: no template involved
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def own_model(tmp_path_factory, tiny_models):
    model = tiny_models["qwen3"]
    run, url = start_graph(tmp_path_factory.mktemp("own-model"), "graphs.agg:Frontend",
                           "configs/agg.yaml", f"--Common.model={model}",
                           f"--Common.served_model_name={SERVED}", timeout_s=240)
    yield model, url
    assert run.stop(timeout_s=60) == 0, run.output()[-3000:]


def transformers_greedy(model_dir, ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_the_model_is_listed_and_answered_under_its_served_name(own_model):
    _, url = own_model
    listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed] == [SERVED]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": SERVED, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_greedy_tokens_equal_transformers(own_model):
    model, url = own_model
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": SERVED, "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 0, "min_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got_text = choice["text"]
    want = transformers_greedy(model, PROMPT_IDS, MAX_TOKENS)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    assert got_text == tok.decode(want, skip_special_tokens=True)
    assert len(choice["logprobs"]["tokens"]) == MAX_TOKENS
