"""``load_tokenizer``: the class a model directory names, without AutoTokenizer's detour
through the model's config class (and torch)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from splitserve.contracts.kit.model_dir import load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"}]
TEXT = "Hello <|im_end|> world\n\t  ünïcode 123 def f(x): return x"


def test_same_tokenizer_as_auto_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert type(ours) is type(auto)
    assert ours(TEXT)["input_ids"] == auto(TEXT)["input_ids"]
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True) == \
        auto.apply_chat_template(MESSAGES, add_generation_prompt=True)
    for attr in ("model_max_length", "eos_token", "bos_token", "pad_token", "unk_token",
                 "all_special_ids", "chat_template", "added_tokens_decoder"):
        assert getattr(ours, attr) == getattr(auto, attr), attr


def test_unknown_or_missing_class_goes_through_auto_tokenizer(smollm2_dir, tmp_path):
    reference = load_tokenizer(smollm2_dir)(TEXT)["input_ids"]
    unknown = tmp_path / "unknown"
    shutil.copytree(smollm2_dir, unknown, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((unknown / "tokenizer_config.json").read_text())
    (unknown / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "tokenizer_class": "NoSuchTokenizerFast"}))
    # AutoTokenizer falls back to the tokenizer.json it finds.
    assert load_tokenizer(unknown)(TEXT)["input_ids"] == reference
    missing = tmp_path / "missing"
    shutil.copytree(smollm2_dir, missing, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg.pop("tokenizer_class")
    (missing / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(missing)(TEXT)["input_ids"] == reference


def test_loading_the_tokenizer_does_not_import_torch(smollm2_dir):
    code = ("import sys; from splitserve.contracts.kit.model_dir import load_tokenizer; "
            f"load_tokenizer({str(smollm2_dir)!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
