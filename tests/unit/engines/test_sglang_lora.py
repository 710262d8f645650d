"""LoRA adapters on the SGLang adapter: its settings built into SGLang's real ServerArgs
and resolved by SGLang's own LoRA step; loads, unloads and requests checked against the
installed SGLang's signatures (its engine module does not import here, so they are built
from its source) and against a double that refuses what SGLang refuses."""

from __future__ import annotations

import ast
import asyncio
import copy
import dataclasses
import inspect
import json
import time
from functools import cache
from pathlib import Path

import msgspec
import pytest
from pydantic import ValidationError

from splitserve.components.engines.sglang.config import (
    SglangEngineArgs,
    check_server_args,
    server_args_kwargs,
)
from splitserve.components.engines.sglang.engine import SglangEngine
from splitserve.components.engines.sglang.kv_relay import convert_batch
from splitserve.contracts.block_events import BlockStored
from splitserve.contracts.engine import GenerateParams
from tests.fixtures.engine_doubles import BootstrapRooms, SglangEngineDouble, tokens_for
from tests.unit.engines.adapter_helpers import collect
from tests.unit.engines.upstream import needs_sglang_module, sglang_source

pytestmark = pytest.mark.unit

_sglang_installed = needs_sglang_module("sglang.srt.server_args")

MODEL = "/models/Llama-3.1-8B-Instruct"
EP = "tcp://127.0.0.1:5557"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
P = GenerateParams(token_ids=(5, 6, 7, 8), max_tokens=6, temperature=0.0)


def lora_args(**kw) -> SglangEngineArgs:
    return SglangEngineArgs(enable_lora=True, max_lora_rank=8, lora_target_modules=TARGETS,
                            **kw)


def write_adapter(path: Path, rank: int = 8, targets: list[str] = TARGETS) -> Path:
    """A PEFT adapter directory as far as SGLang reads it before its weights."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": targets,
        "bias": "none", "task_type": "CAUSAL_LM"}))
    return path


def lora(params: GenerateParams = P, name: str | None = "a") -> GenerateParams:
    return dataclasses.replace(params, lora=name)


# ---- ServerArgs ---------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
def test_lora_settings_build_sglangs_server_args_and_its_lora_step_resolves_them(role):
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import ServerArgs

    args = lora_args(max_loras_per_batch=4, lora_paths={"a": "/adapters/a"}).model_copy(
        update={"model_path": MODEL})  # as the registry's factory fills it in
    kw = server_args_kwargs(args, role, "m", EP)
    sa = check_server_args(kw)
    assert (sa.enable_lora, sa.max_loras_per_batch, sa.max_lora_rank) == (True, 4, 8)
    assert sa.lora_target_modules == TARGETS and sa.lora_paths == ["a=/adapters/a"]
    check_lora_server_args(sa)  # SGLang's launch-time resolution of the LoRA group
    (ref,) = resolved_view(sa).lora_paths
    assert (ref.lora_name, ref.lora_path) == ("a", "/adapters/a")
    assert ServerArgs(**kw).enable_lora  # what sglang.Engine(**kw) builds


def test_without_lora_no_lora_argument_is_sent():
    kw = server_args_kwargs(SglangEngineArgs(), "agg", "m")
    assert not {"enable_lora", "max_loras_per_batch", "lora_paths"} & set(kw)


@pytest.mark.parametrize(("kw", "why"), [
    ({"enable_lora": True}, "you need to specify both --max-lora-rank and "
                            "--lora-target-modules"),
    ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["qq_proj"]},
     "lora_target_modules: SGLang refused"),
    ({"max_lora_rank": 8}, "max_lora_rank: set without enable_lora"),
    ({"enable_lora": True, "lora_paths": {"a=b": "/x"}}, "without '='"),
])
def test_sglang_refuses_lora_settings_it_cannot_serve(kw, why):
    with pytest.raises(ValidationError, match=why):
        SglangEngineArgs(**kw)


# ---- the installed signatures and lookups -------------------------------------------------

@cache
def installed_signature(name: str) -> inspect.Signature:
    """The signature ``sglang.Engine.<name>`` has in the installed source (its module
    imports SGLang's multimodal stack, which is not installed here)."""
    src = sglang_source("srt/entrypoints/engine.py")
    node = copy.deepcopy(src.node(ast.AsyncFunctionDef, name))
    for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                node.args.vararg, node.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    stub = ast.Module(body=[ast.FunctionDef(name=name, args=node.args, body=[ast.Pass()],
                                            decorator_list=[], returns=None)],
                      type_ignores=[])
    ns: dict = {}
    exec(compile(ast.fix_missing_locations(stub), src.label, "exec"), ns)  # noqa: S102
    return inspect.signature(ns[name])


@cache
def lora_update_output() -> type:
    """SGLang's ``LoRAUpdateOutput`` (what a load or unload answers) with the fields its
    installed source declares (``io_struct`` imports the multimodal stack too)."""
    src = sglang_source("srt/managers/io_struct.py")
    node = src.node(ast.ClassDef, "LoRAUpdateOutput", top_level=True)
    names = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
    assert names[0] == "success" and {"error_message", "loaded_adapters"} <= set(names), (
        f"{src.label}: LoRAUpdateOutput's fields changed: {names}")
    return dataclasses.make_dataclass("LoRAUpdateOutput", [
        (n, object) if n == "success" else (n, object, dataclasses.field(default=None))
        for n in names], kw_only=True)


def test_sglang_looks_adapters_up_by_name_in_lora_path():
    """Why a request's adapter goes in as its name: SGLang's tokenizer manager resolves
    ``lora_path`` through its registry, which is keyed by adapter name."""
    sglang_source("srt/managers/tokenizer_manager.py").require(
        "self.lora_registry.acquire(obj.lora_path)")
    sglang_source("srt/lora/lora_registry.py").require(
        "async def acquire(self, lora_name", "lora_ref = self._registry.get(name, None)")
    assert "lora_path" in installed_signature("async_generate").parameters


def test_sglang_answers_a_refused_load_with_a_result_not_an_error():
    src = sglang_source("srt/managers/tokenizer_control_mixin.py")
    body = src.after("    async def load_lora_adapter(", 4000)
    assert "except ValueError as e:" in body and "success=False" in body, src.label


class LoraEngineDouble(SglangEngineDouble):
    """``sglang.Engine`` with its LoRA members, each call bound to the installed signature,
    refusing what SGLang refuses: a load without ``--enable-lora``, a name already
    loaded, an adapter the pool cannot hold (rank, target modules); an unload or a
    request of a name not loaded."""

    def __init__(self, rooms: BootstrapRooms, **server_args) -> None:
        super().__init__(rooms, **server_args)
        self.adapters = dict(p.split("=", 1) for p in server_args.get("lora_paths") or ())
        self.lora_calls: list = []

    def _result(self, error: str | None = None):
        return lora_update_output()(success=error is None, error_message=error,
                                    loaded_adapters=dict(self.adapters))

    def _refusal(self, name: str, path: str) -> str | None:
        if not self.server_args.get("enable_lora"):
            return "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        if name in self.adapters:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        wanted = set(self.server_args.get("lora_target_modules") or ())
        if config["r"] > self.server_args["max_lora_rank"] or not (
                set(config["target_modules"]) <= wanted or "all" in wanted):
            return (f"LoRA adapter {name} with rank {config['r']} is incompatible with the "
                    "current LoRA memory pool configuration.")
        return None

    async def async_load_lora_adapter(self, *args, **kw):
        bound = installed_signature("async_load_lora_adapter").bind(self, *args, **kw)
        name, path = bound.arguments["lora_name"], bound.arguments["lora_path"]
        self.lora_calls.append(("load", name, path))
        error = self._refusal(name, path)
        if error is None:
            self.adapters[name] = path
        return self._result(error)

    async def async_unload_lora_adapter(self, *args, **kw):
        name = installed_signature("async_unload_lora_adapter").bind(
            self, *args, **kw).arguments["lora_name"]
        self.lora_calls.append(("unload", name))
        if self.adapters.pop(name, None) is None:
            return self._result(f"LoRA with name {name} does not exist.")
        return self._result()

    async def async_generate(self, *args, **kw):
        installed_signature("async_generate").bind(self, *args, **kw)
        name = kw.get("lora_path")
        if name is not None and name not in self.adapters:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}")
        gen = await super().async_generate(*args, **kw)
        if kw.get("bootstrap_host") != "2.2.2.2":  # a warm-up is not a request served
            self.calls[-1]["lora_path"] = name
        return gen


async def make(args: SglangEngineArgs, role: str = "agg", rooms: BootstrapRooms | None = None):
    rooms = rooms or BootstrapRooms()
    eng = SglangEngine(args.model_copy(update={"model_path": MODEL}), "m", role,
                       factory=lambda **a: LoraEngineDouble(rooms, **a))
    await eng.start()
    return eng


# ---- the adapter --------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_every_path_names_the_adapter_in_lora_path(tmp_path):
    path = write_adapter(tmp_path / "a")
    rooms = BootstrapRooms()
    agg, pre, dec = [await make(lora_args(), role, rooms) for role in ("agg", "prefill",
                                                                       "decode")]
    for e in (agg, pre, dec):
        assert e.info.capabilities.serves_lora
        await e.load_lora("a", str(path))
        assert e.loras() == {"a": str(path)}
    assert await collect(agg.generate("g", lora())) == tokens_for([5, 6, 7, 8], 6)
    await collect(agg.generate("base", P))
    ticket = await pre.begin_prefill("r", lora())
    await collect(dec.decode("r", lora(), ticket.handoff))
    await asyncio.wait_for(ticket.result, 5)
    sent = [c["lora_path"] for e in (agg, pre, dec) for c in e._engine.calls]
    assert sent == ["a", None, "a", "a"]
    assert agg._engine.lora_calls == [("load", "a", str(path))]


@pytest.mark.asyncio
async def test_adapters_of_lora_paths_are_served_from_the_start(tmp_path):
    path = write_adapter(tmp_path / "pre")
    eng = await make(lora_args(lora_paths={"pre": str(path)}))
    assert eng.loras() == {"pre": str(path)}
    await collect(eng.generate("g", lora(name="pre")))
    assert eng._engine.calls[-1]["lora_path"] == "pre"


@pytest.mark.asyncio
async def test_loading_again_is_a_no_op_and_a_name_keeps_its_path(tmp_path):
    eng = await make(lora_args())
    a, b = write_adapter(tmp_path / "a"), write_adapter(tmp_path / "b")
    await eng.load_lora("a", str(a))
    await eng.load_lora("a", str(a) + "/")  # SGLang would refuse a second load
    with pytest.raises(ValueError, match="unload it before loading"):
        await eng.load_lora("a", str(b))
    assert len(eng._engine.lora_calls) == 1


@pytest.mark.asyncio
async def test_what_sglang_refuses_is_refused_naming_it(tmp_path):
    eng = await make(lora_args())
    high = write_adapter(tmp_path / "high", rank=16)
    mlp = write_adapter(tmp_path / "mlp", targets=["gate_proj"])
    for name, path in (("high", high), ("mlp", mlp)):
        with pytest.raises(ValueError, match=f"SGLang refused it: LoRA adapter {name} with "
                           "rank .* incompatible") as exc:
            await eng.load_lora(name, str(path))
        assert str(path) in str(exc.value)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        await eng.load_lora("none", str(tmp_path / "nowhere"))
    assert eng.loras() == {} and len(eng._engine.lora_calls) == 2


@pytest.mark.asyncio
async def test_requests_of_adapters_not_loaded_are_refused_before_sglang(tmp_path):
    eng = await make(lora_args())
    with pytest.raises(ValueError, match="'x' is not loaded on this SGLang engine"):
        eng.validate(lora(name="x"))
    with pytest.raises(ValueError, match="'x' is not loaded"):
        eng.generate("g", lora(name="x"))
    assert eng._engine.calls == [] and eng.inflight() == 0


@pytest.mark.asyncio
async def test_an_engine_without_lora_refuses_adapters_naming_the_switch(tmp_path):
    eng = await make(SglangEngineArgs())
    assert not eng.info.capabilities.serves_lora
    with pytest.raises(ValueError, match="engine_args.enable_lora"):
        await eng.load_lora("a", str(write_adapter(tmp_path / "a")))
    with pytest.raises(ValueError, match="engine_args.enable_lora"):
        eng.validate(lora())
    assert eng._engine.lora_calls == []


@pytest.mark.asyncio
async def test_unload_refuses_while_a_request_uses_the_adapter(tmp_path):
    eng = await make(lora_args())
    await eng.load_lora("a", str(write_adapter(tmp_path / "a")))
    it = eng.generate("long", lora(dataclasses.replace(P, max_tokens=10_000)))
    await it.__anext__()
    with pytest.raises(ValueError, match="in flight"):
        await eng.unload_lora("a")
    await it.aclose()
    await collect(eng.generate("short", lora()))  # stopped at its last delta, not closed
    await eng.unload_lora("a")
    assert eng.loras() == {} and eng._engine.lora_calls[-1] == ("unload", "a")
    with pytest.raises(KeyError, match="'a' is not loaded"):
        await eng.unload_lora("a")
    with pytest.raises(ValueError, match="not loaded"):
        eng.validate(lora())


@pytest.mark.asyncio
async def test_a_prefill_holds_its_adapter_until_it_ends(tmp_path):
    rooms = BootstrapRooms()
    pre, dec = await make(lora_args(), "prefill", rooms), await make(lora_args(), "decode",
                                                                      rooms)
    for e in (pre, dec):
        await e.load_lora("a", str(write_adapter(tmp_path / e.role)))
    ticket = await pre.begin_prefill("r", lora())
    with pytest.raises(ValueError, match="in flight"):
        await pre.unload_lora("a")
    await collect(dec.decode("r", lora(), ticket.handoff))
    await asyncio.wait_for(ticket.result, 5)
    await pre.unload_lora("a")


def test_kv_events_name_the_adapter_the_blocks_hold():
    from sglang.srt.disaggregation.kv_events import BlockStored as SStored
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    batch = KVEventBatch(ts=time.time(), events=[
        SStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                block_size=4, lora_id=7, lora_name="a"),
        SStored(block_hashes=[2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                block_size=4, lora_id=None)])
    adapted, plain = convert_batch(msgspec.msgpack.encode(batch), 4)
    assert isinstance(adapted, BlockStored) and adapted.lora_name == "a"
    assert plain.lora_name is None
