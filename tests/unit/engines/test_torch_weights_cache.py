"""The cached fp32 weights are the GGUF's de-quantised values: the engine and the
transformers reference in the engine tests are both built from that cache."""

from __future__ import annotations

import torch


def test_cached_weights_equal_the_gguf_dequantisation(smollm2):
    from transformers import AutoModelForCausalLM

    from splitserve.contracts.model_files import gguf_path

    path = gguf_path()
    gguf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32)
    ours, theirs = smollm2.hf_model.state_dict(), gguf.state_dict()
    assert set(ours) == set(theirs)
    different = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert different == []
    ids = torch.tensor([[1, 2, 3, 400, 5000, 12, 7, 99]])
    with torch.no_grad():
        assert torch.equal(smollm2.hf_model(ids).logits, gguf.eval()(ids).logits)
