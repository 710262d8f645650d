"""A LoRA adapter on vLLM's disaggregated graph (the CPU build, KV pulled over NIXL): the
prefill engine loads the adapter as the decode engine does, and with remote prefill
forced an adapter request is prefilled there with its adapter, its KV pulled by the
decode engine, and the answer is what transformers with peft gives (a prompt prefilled
by the base model would answer differently); the base model's answer is unchanged."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import dynamo, fleet
from tests.e2e.prompts import FORCED
from tests.e2e.test_lora import MAX_TOKENS, adapters, greedy, peft_greedy
from tests.e2e.test_own_model import PROMPT_IDS, transformers_greedy
from tests.fixtures.tiny_models import write_lora_adapter, write_vllm_cpu_llama
from tests.graphs import start_graph
from tests.installed import needs_vllm
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.exclusive, needs_vllm]

BASE, ADAPTER = "vllm-llama", "vllm-llama-sql"
RANK = 8


def test_an_adapter_request_is_prefilled_remotely_with_its_adapter(tmp_path_factory,
                                                                    smollm2_dir):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vllm-disagg-lora")
    llama = write_vllm_cpu_llama(root / "llama", smollm2_dir)
    adapter = write_lora_adapter(llama, root / "adapter", rank=RANK)
    lora = ["enable_lora=true", "max_loras=2", f"max_lora_rank={RANK}", "max_model_len=512",
            "max_num_seqs=4"]
    run, url = start_graph(
        root / "graph", "graphs.disagg:Frontend", "configs/vllm_disagg.yaml",
        f"--Common.model={llama}", f"--Common.served_model_name={BASE}", FORCED,
        *(f"--{pool}.engine_args.{arg}" for pool in ("DecodeWorker", "PrefillWorker")
          for arg in lora), timeout_s=600)
    try:
        res = dynamo(run, "lora", "load", ADAPTER, str(adapter))
        assert res.returncode == 0, res.stderr

        def roles() -> list[tuple[str, str]]:
            return sorted((w.get("role", "serve"), w["state"])
                          for a in adapters(run) for w in a["workers"].values())

        wait_until(lambda: roles() == [("prefill", "loaded"), ("serve", "loaded")], 120,
                   what="the adapter loaded on the decode and the prefill engine")
        tok = AutoTokenizer.from_pretrained(llama)
        base, adapted = greedy(url, BASE), greedy(url, ADAPTER)
        assert base.status_code == 200 and adapted.status_code == 200, (base.text,
                                                                         adapted.text)
        want_base = transformers_greedy(llama, PROMPT_IDS, MAX_TOKENS)
        want_adapted = peft_greedy(llama, adapter, PROMPT_IDS, MAX_TOKENS)
        assert want_adapted != want_base
        assert base.json()["choices"][0]["text"] == tok.decode(want_base,
                                                               skip_special_tokens=True)
        assert adapted.json()["choices"][0]["text"] == tok.decode(want_adapted,
                                                                  skip_special_tokens=True)
        assert fleet(run, "DecodeWorker", "splitserve_disagg_decisions_total") == {
            (("reason", "forced-remote"), ("where", "remote")): 2.0}
        assert fleet(run, "PrefillWorker", "splitserve_prefill_jobs_total") == {
            (("outcome", "done"),): 2.0}
    finally:
        assert run.stop(timeout_s=90) == 0, run.output()[-3000:]
