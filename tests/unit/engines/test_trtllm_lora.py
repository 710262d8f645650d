"""TensorRT-LLM serves no LoRA adapter here, and says so: its LLM API loads adapters only
as requests name them (no load or unload call), and Dynamo's TensorRT-LLM worker, the
reference these calls follow, sends no adapter at all.  The KV events still carry an
adapter's name the way Dynamo's publisher reads it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
from splitserve.components.engines.trtllm.engine import NotServedHere, TrtllmEngine
from splitserve.components.engines.trtllm.events import convert_event
from splitserve.contracts.engine import AbilityAbsent, GenerateParams
from tests.unit.engines.upstream import dynamo_source, package_dir

pytestmark = pytest.mark.unit

P = GenerateParams(token_ids=(1, 2, 3), max_tokens=2)


def test_the_engine_declares_no_lora_and_refuses_requests_naming_an_adapter():
    eng = TrtllmEngine(TrtllmEngineArgs(), "m", machine_id=1)
    assert not eng.info.capabilities.serves_lora
    with pytest.raises(AbilityAbsent, match=r"load_lora\(\) \(capabilities.serves_lora"):
        asyncio.run(eng.load_lora("a", "/adapters/a"))
    with pytest.raises(AbilityAbsent, match="serves_lora"):
        eng.loras()
    with pytest.raises(NotServedHere, match="lora: .* no LoRA adapter"):
        eng.validate(dataclasses.replace(P, lora="a"))
    eng.validate(P)


def test_dynamos_trtllm_worker_sends_no_adapter():
    """The day Dynamo's worker passes a ``lora_request`` (or builds the LLM with a
    ``lora_config``), there is a reference to follow: this fails to say so."""
    root = package_dir("ai-dynamo", "dynamo") / "trtllm"
    using = sorted(str(f.relative_to(root)) for f in root.rglob("*.py")
                   if "tests" not in f.parts
                   and ("lora_request" in f.read_text() or "lora_config" in f.read_text()))
    assert using == [], f"Dynamo's TensorRT-LLM worker now serves LoRA: {using}"


def test_stored_events_carry_the_adapter_name_as_dynamo_reads_it():
    dynamo_source("trtllm/publisher.py").require('lora_name = data.get("lora_name")')
    block = {"block_hash": 1, "tokens": [{"token_id": t} for t in range(4)]}
    (adapted,) = convert_event({"data": {"type": "stored", "parent_hash": None,
                                         "blocks": [block], "lora_name": "a"}}, 4)
    (plain,) = convert_event({"data": {"type": "stored", "parent_hash": None,
                                       "blocks": [block]}}, 4)
    assert adapted.lora_name == "a" and plain.lora_name is None
