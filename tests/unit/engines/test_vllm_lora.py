"""LoRA adapters on vLLM's CPU engine: loaded at run time, applied per request, equal to
transformers + peft token for token, refused where vLLM refuses them, unloaded only when
no request uses them, and named on the KV events the router indexes.

One engine serves the whole module (vLLM's CPU build, a tiny random Llama): it starts in
about a minute on two cores, so the module is ``slow`` and ``exclusive`` (vLLM pins its
compute threads to cores).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from splitserve.components.engines.vllm.config import (
    VllmEngineArgs,
    VllmKvTransfer,
    check_lora_config,
)
from splitserve.components.engines.vllm.engine import VllmEngine
from splitserve.contracts.block_events import BlockStored
from splitserve.contracts.engine import GenerateParams
from tests.fixtures.tiny_models import write_lora_adapter, write_vllm_cpu_llama
from tests.unit.engines.adapter_helpers import collect, deltas
from tests.installed import needs_vllm

pytestmark = [pytest.mark.unit, pytest.mark.slow, pytest.mark.exclusive,
              pytest.mark.timeout(900), needs_vllm]

NAME = "tiny-adapter"
RANK = 8
PROMPT = GenerateParams(token_ids=tuple(range(5, 25)), max_tokens=8, temperature=0.0,
                        ignore_eos=True)
BLOCK = 128  # vLLM's CPU attention block size


# ---- the model and its reference ----------------------------------------------------------

def peft_greedy(base: Path, adapter: Path | None, prompt: tuple[int, ...], n: int) -> list[int]:
    """``n`` greedy tokens of transformers' model, with peft's adapter applied when given
    (no end token stops it: the engine is asked to ignore EOS)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        with warnings.catch_warnings():  # peft reads a property transformers deprecated
            warnings.simplefilter("ignore", FutureWarning)
            model = peft.PeftModel.from_pretrained(model, str(adapter))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@dataclasses.dataclass
class Served:
    """The module's engine, the loop it runs on, and the KV events it relayed."""

    runner: asyncio.Runner
    engine: VllmEngine
    base: Path
    adapter: Path
    events: list

    def run(self, coro):
        return self.runner.run(coro)


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("vllm-lora")
    base = write_vllm_cpu_llama(root / "llama", smollm2_dir)
    adapter = write_lora_adapter(base, root / "adapter", rank=RANK)
    args = VllmEngineArgs(model=str(base), dtype="float32", max_model_len=2 * BLOCK + 64,
                          block_size=BLOCK, max_num_seqs=4, enable_lora=True, max_loras=2,
                          max_lora_rank=RANK)
    env = dict(os.environ)
    runner = asyncio.Runner()
    engine = VllmEngine(args, "tiny")
    events: list = []

    async def start():
        ready = asyncio.Event()
        relay = asyncio.ensure_future(engine.run_kv_events(events.extend, ready))
        await ready.wait()
        await engine.start()
        return relay

    async def stop(relay):
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        # vLLM's loggers do not propagate to the root: listen where the output handler
        # logs (it logged an EngineDeadError traceback at every stop before the engine
        # cancelled it first)
        errors = _ErrorRecords()
        handler_log = logging.getLogger("vllm.v1.engine.async_llm")
        handler_log.addHandler(errors)
        try:
            await engine.shutdown()
            await asyncio.sleep(0.5)  # a worker's loop runs on after its engine stopped
        finally:
            handler_log.removeHandler(errors)
        return errors.records

    relay = runner.run(start())
    ctx = engine._engine.engine_core.resources.ctx
    try:
        yield Served(runner, engine, base, adapter, events)
    finally:
        errors = runner.run(stop(relay))
        runner.close()
        assert not errors, [r.getMessage() for r in errors]
        # vLLM's engine client leaves its ZMQ context to the garbage collector, whose
        # ResourceWarning failed whichever later test the collection ran in: the
        # engine's shutdown destroys it
        assert ctx.closed
        os.environ.clear()
        os.environ.update(env)  # the engine set vLLM's variables for its own start


def lora(params: GenerateParams = PROMPT, name: str | None = NAME) -> GenerateParams:
    return dataclasses.replace(params, lora=name)


# ---- the real engine ----------------------------------------------------------------------

def test_adapter_output_equals_peft_and_differs_from_the_base(served):
    e = served.engine
    assert e.info.capabilities.serves_lora
    served.run(e.load_lora(NAME, str(served.adapter)))
    assert e.loras() == {NAME: str(served.adapter)}
    with_adapter = served.run(collect(e.generate("a", lora())))
    base = served.run(collect(e.generate("b", PROMPT)))
    n = PROMPT.max_tokens
    assert with_adapter == peft_greedy(served.base, served.adapter, PROMPT.token_ids, n)
    assert base == peft_greedy(served.base, None, PROMPT.token_ids, n)
    assert with_adapter != base


def test_requests_reach_vllm_as_its_renderer_makes_them(served):
    """Not the raw prompt vLLM deprecates (and logs, once per process): the engine input
    its own renderer makes, with the prompt's ids unchanged."""
    e = served.engine
    seen = []
    generate = e._engine.generate

    def recording(engine_input, *args, **kwargs):
        seen.append(engine_input)
        return generate(engine_input, *args, **kwargs)

    e._engine.generate = recording
    try:
        out = served.run(collect(e.generate("rendered", PROMPT)))
    finally:
        del e._engine.generate
    assert out == peft_greedy(served.base, None, PROMPT.token_ids, PROMPT.max_tokens)
    assert len(seen) == 1 and isinstance(seen[0], dict)
    assert seen[0]["type"] == "token"
    assert list(seen[0]["prompt_token_ids"]) == list(PROMPT.token_ids)


def test_loading_the_same_adapter_again_is_a_no_op_and_a_name_keeps_its_path(served, tmp_path):
    e = served.engine
    served.run(e.load_lora(NAME, str(served.adapter)))
    served.run(e.load_lora(NAME, str(served.adapter) + "/"))  # the same directory
    assert e.loras() == {NAME: str(served.adapter)}
    other = shutil.copytree(served.adapter, tmp_path / "copy")
    with pytest.raises(ValueError, match="unload it before loading"):
        served.run(e.load_lora(NAME, str(other)))


def test_a_request_naming_an_adapter_not_loaded_is_refused(served):
    e = served.engine
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        e.validate(lora(name="nope"))
    with pytest.raises(ValueError, match="'nope' is not loaded"):  # and when sent anyway
        served.run(collect(e.generate("c", lora(name="nope"))))
    assert e.inflight() == 0


def _renamed_module(src: Path, dest: Path) -> Path:
    """``src`` with its q_proj weights renamed to a module the model lacks."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k.replace(".q_proj.", ".qx_proj."): v for k, v in tensors.items()},
              str(dest / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())
    config["target_modules"] = [m if m != "q_proj" else "qx_proj"
                                for m in config["target_modules"]]
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def test_adapters_vllm_refuses_are_refused_naming_why_and_the_engine_serves_on(served,
                                                                              tmp_path):
    e = served.engine
    high = write_lora_adapter(served.base, tmp_path / "rank16", rank=2 * RANK)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(served.adapter / "adapter_config.json", weightless)
    cases = {  # name: (path, what vLLM says)
        "missing": (tmp_path / "nowhere", "no adapter_config.json"),
        "rank": (high, f"LoRA rank {2 * RANK} is greater than max_lora_rank {RANK}"),
        "weights": (weightless, "doesn't contain tensors"),
        "modules": (_renamed_module(served.adapter, tmp_path / "renamed"), "qx_proj"),
    }
    for name, (path, why) in cases.items():
        with pytest.raises(ValueError, match=why) as exc:
            served.run(e.load_lora(name, str(path)))
        assert str(path) in str(exc.value), name
        assert name not in e.loras()
    assert e.failure() is None
    assert len(served.run(collect(e.generate("after", PROMPT)))) == PROMPT.max_tokens


def test_unload_waits_for_no_request_and_a_reload_keeps_the_id(served):
    e = served.engine
    served.run(e.load_lora(NAME, str(served.adapter)))
    adapter_id = e._lora.id_of(NAME)

    async def unload_while_streaming():
        it = e.generate("long", lora(dataclasses.replace(PROMPT, max_tokens=200)))
        await it.__anext__()
        try:
            with pytest.raises(ValueError, match="in flight"):
                await e.unload_lora(NAME)
        finally:
            await it.aclose()
        await e.unload_lora(NAME)

    served.run(unload_while_streaming())
    assert e.loras() == {}
    with pytest.raises(KeyError, match=NAME):
        served.run(e.unload_lora(NAME))
    with pytest.raises(ValueError, match="not loaded"):
        e.validate(lora())
    served.run(e.load_lora(NAME, str(served.adapter)))
    assert e._lora.id_of(NAME) == adapter_id
    got = served.run(collect(e.generate("again", lora())))
    assert got == peft_greedy(served.base, served.adapter, PROMPT.token_ids, PROMPT.max_tokens)


def test_more_adapters_than_vllm_keeps_all_serve_vllm_reloads_the_evicted(served, tmp_path):
    """Beyond ``max_cpu_loras`` (here 2) vLLM evicts the least recently used adapter; a
    request naming it brings it back from its path, with the same answers."""
    e = served.engine
    served.run(e.load_lora(NAME, str(served.adapter)))
    others = {f"other-{i}": write_lora_adapter(served.base, tmp_path / f"o{i}", rank=RANK,
                                               seed=i + 1) for i in range(2)}
    for name, path in others.items():
        served.run(e.load_lora(name, str(path)))
    assert set(e.loras()) == {NAME, *others}
    assert e._lora.id_of(NAME) not in served.run(e._engine.list_loras())  # evicted
    got = served.run(collect(e.generate("evicted", lora())))
    assert got == peft_greedy(served.base, served.adapter, PROMPT.token_ids, PROMPT.max_tokens)
    for name in others:
        served.run(e.unload_lora(name))


def test_kv_events_name_the_adapter_the_blocks_were_computed_with(served):
    e = served.engine
    served.run(e.load_lora(NAME, str(served.adapter)))
    long = GenerateParams(token_ids=tuple(range(100, 100 + BLOCK + 3)), max_tokens=2,
                          temperature=0.0, ignore_eos=True)
    served.events.clear()

    async def stored(count: int) -> list[BlockStored]:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            found = [ev for ev in served.events if isinstance(ev, BlockStored)]
            if len(found) >= count:
                return found
            await asyncio.sleep(0.05)
        return [ev for ev in served.events if isinstance(ev, BlockStored)]

    served.run(collect(e.generate("kv-a", lora(long))))
    (adapted,) = served.run(stored(1))
    served.run(collect(e.generate("kv-b", long)))
    adapted, plain = served.run(stored(2))
    assert adapted.lora_name == NAME and plain.lora_name is None
    assert adapted.token_ids == plain.token_ids == long.token_ids[:BLOCK]
    assert adapted.block_hashes != plain.block_hashes  # vLLM keys its cache by adapter


# ---- without the engine -------------------------------------------------------------------

class _AsyncLlm:
    """``AsyncLLM`` as the adapter's LoRA paths call it, each call bound to the installed
    signature: records generate's keywords and the adapters added and removed."""

    def __init__(self, args: VllmEngineArgs) -> None:
        self.vllm_config = SimpleNamespace(lora_config=check_lora_config(args))
        self.calls: list[dict] = []
        self.added: list = []
        self.removed: list[int] = []

    @staticmethod
    def _bind(name: str, *args, **kw) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        inspect.signature(getattr(AsyncLLM, name)).bind(object(), *args, **kw)

    async def add_lora(self, request) -> bool:
        self._bind("add_lora", request)
        self.added.append(request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self._bind("remove_lora", lora_id)
        self.removed.append(lora_id)
        return True

    async def generate(self, prompt, sampling_params, **kw):
        from vllm.outputs import CompletionOutput, RequestOutput

        self._bind("generate", prompt, sampling_params, **kw)
        self.calls.append(kw)
        comp = CompletionOutput(index=0, text="", token_ids=[9], cumulative_logprob=None,
                                logprobs=None, finish_reason="length")
        yield RequestOutput(request_id=kw["request_id"], prompt=None,
                            prompt_token_ids=list(prompt["prompt_token_ids"]),
                            prompt_logprobs=None, outputs=[comp], finished=True,
                            kv_transfer_params={"remote_engine_id": "e"})

    async def abort(self, request_id) -> None:
        pass


def test_prefill_and_decode_engines_pass_the_adapter_too(served):
    from vllm.lora.request import LoRARequest

    args = VllmEngineArgs(kv_events=False, enable_lora=True, max_lora_rank=RANK)

    async def run():
        pre = VllmEngine(args, "m", "prefill", kv_transfer=VllmKvTransfer())
        dec = VllmEngine(args, "m", "decode", kv_transfer=VllmKvTransfer())
        for e in (pre, dec):
            e._engine = _AsyncLlm(args)
            await e.load_lora(NAME, str(served.adapter))
        result = await pre.prefill("p", lora())
        await deltas(dec.decode("d", lora(), result.handoff))
        await deltas(dec.generate("g", PROMPT))
        await dec.unload_lora(NAME)
        return pre._engine, dec._engine

    pre, dec = asyncio.run(run())
    sent = [c.get("lora_request") for c in pre.calls + dec.calls]
    assert sent[2] is None  # the base model: no adapter
    for req in sent[:2]:
        assert isinstance(req, LoRARequest)
        assert (req.lora_name, req.lora_path) == (NAME, str(served.adapter))
        assert req.lora_int_id == pre.added[0].lora_int_id
    assert dec.removed == [dec.added[0].lora_int_id]


def test_an_engine_without_lora_refuses_adapters_naming_the_switch():
    e = VllmEngine(VllmEngineArgs(kv_events=False), "m")
    assert not e.info.capabilities.serves_lora
    with pytest.raises(ValueError, match="engine_args.enable_lora"):
        asyncio.run(e.load_lora(NAME, "/nowhere"))
    with pytest.raises(ValueError, match="engine_args.enable_lora"):
        e.validate(lora())
    e.validate(PROMPT)


def test_lora_settings_are_checked_by_vllms_lora_config():
    from pydantic import ValidationError
    from vllm.engine.arg_utils import AsyncEngineArgs

    from splitserve.components.engines.vllm.config import to_engine_args

    args = VllmEngineArgs(enable_lora=True, max_loras=2, max_lora_rank=64, max_cpu_loras=4)
    ea = to_engine_args(args, "/m", "served")
    assert isinstance(ea, AsyncEngineArgs)
    assert (ea.enable_lora, ea.max_loras, ea.max_lora_rank, ea.max_cpu_loras) == (True, 2, 64, 4)
    assert not to_engine_args(VllmEngineArgs(), "/m", "served").enable_lora
    with pytest.raises(ValidationError, match="max_lora_rank: vLLM's LoRAConfig refused"):
        VllmEngineArgs(enable_lora=True, max_lora_rank=12)  # no kernel for rank 12
    with pytest.raises(ValidationError, match=r"max_cpu_loras \(2\) must be >= max_loras"):
        VllmEngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValidationError, match="max_loras: set without enable_lora"):
        VllmEngineArgs(max_loras=2)
