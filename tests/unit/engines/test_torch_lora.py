"""LoRA adapters in the torch engine: an adapter's greedy output equals transformers +
peft's token for token (all projections or some, biases in the base, rsLoRA scaling),
every row of a batch mixing the base model and adapters gets exactly what it gets alone,
the prefix cache and its events are keyed by adapter (aggregated, disaggregated, live KV
moves), and what cannot be served exactly is refused by name.

Tiny random models and random adapters written with peft (tests/fixtures/tiny_models.py)
keep each run to seconds.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file

from splitserve.components.engines.torch_cpu import (
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineCore,
    LoadedModel,
    Request,
    RequestOutput,
    hash_block,
    load_model,
)
from splitserve.components.engines.torch_cpu.adapter import MOVE_SUFFIX, TorchEngine
from splitserve.components.engines.torch_cpu.loader import reference_model
from splitserve.components.engines.torch_cpu.lora import lora_scale, read_lora
from splitserve.components.engines.torch_cpu.model import score_prompt
from splitserve.components.engines.torch_cpu.runner import EngineRunner
from splitserve.components.engines.torch_cpu.sections import TorchEngineArgs
from splitserve.contracts.engine import GenerateParams
from tests.fixtures.tiny_models import write_lora_adapter

pytestmark = pytest.mark.unit

PROMPTS = ["The quick brown fox jumps over", "def f(x):\n    return", "Paris is the"]
NEW_TOKENS = 8
LONG = tuple(range(300, 340))  # 40 tokens: two full blocks of 16 and a partial one
MOVE_TOKENS = 120
PEFT_WARNINGS = pytest.mark.filterwarnings(  # peft 0.21 calls a deprecated transformers API
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
# name -> (base family, write_lora_adapter arguments); "llama-all" is the tiny_lora fixture
ADAPTERS = {
    "llama-qv": ("llama", {"rank": 4, "alpha": 8, "targets": ("q_proj", "v_proj"), "seed": 1}),
    "qwen2-all": ("qwen2", {"seed": 2}),
    "qwen3-rslora": ("qwen3", {"rank": 16, "alpha": 8, "seed": 3, "use_rslora": True,
                               "targets": ("k_proj", "o_proj", "up_proj", "down_proj")}),
}


@pytest.fixture(scope="module")
def adapters(tiny_models, tiny_lora, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Adapter name -> (base family, adapter directory)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {"llama-all": ("llama", tiny_lora)}
    for name, (family, kw) in ADAPTERS.items():
        made[name] = (family, write_lora_adapter(tiny_models[family], root / name, **kw))
    return made


@pytest.fixture(scope="module")
def loaded(tiny_models):
    cache: dict[str, LoadedModel] = {}

    def load(family: str) -> LoadedModel:
        if family not in cache:
            cache[family] = load_model(str(tiny_models[family]))
        return cache[family]

    return load


def core_with(model: LoadedModel, adapters: dict[str, Path], **config) -> EngineCore:
    """A fresh engine core over ``model`` with ``adapters`` (name -> directory) loaded."""
    core = EngineCore(model.weights, model.config, EngineConfig(**{"num_blocks": 64, **config}))
    for name, path in adapters.items():
        core.add_lora(name, core.read_lora(str(path)))
    return core


def run(core: EngineCore, requests: list[Request]) -> dict[str, list[RequestOutput]]:
    for req in requests:
        core.add_request(req)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while core.has_unfinished():
        for out in core.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def stored(core: EngineCore) -> list[BlockStored]:
    return [e for e in core.drain_kv_events() if isinstance(e, BlockStored)]


def peft_model(tiny_models, family: str, adapter: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(reference_model(tiny_models[family]), str(adapter)).eval()


# ---- what an adapter computes ------------------------------------------------------------
@PEFT_WARNINGS
@pytest.mark.parametrize("name", ["llama-all", "llama-qv", "qwen2-all", "qwen3-rslora"])
def test_adapter_greedy_output_equals_peft_and_differs_from_the_base(
        loaded, tiny_models, adapters, name):
    family, path = adapters[name]
    model = loaded(family)
    prompts = [model.tokenizer(p)["input_ids"] for p in PROMPTS]
    ref = peft_model(tiny_models, family, path)
    expected = []
    for ids in prompts:
        prompt = torch.tensor([ids])
        with torch.inference_mode():
            out = ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                               max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=model.tokenizer.pad_token_id)
        expected.append(out[0, len(ids):].tolist())
    core = core_with(model, {name: path})
    reqs = [Request(f"{kind}{i}", tuple(ids), max_tokens=NEW_TOKENS,
                    lora=name if kind == "a" else None)
            for kind in ("a", "b") for i, ids in enumerate(prompts)]
    outs = run(core, reqs)  # adapter and base requests batched together
    got = [tokens(outs[f"a{i}"]) for i in range(len(prompts))]
    base = [tokens(outs[f"b{i}"]) for i in range(len(prompts))]
    assert got == expected
    assert all(len(e) == NEW_TOKENS for e in expected)  # no early EOS hid a difference
    assert all(g != b for g, b in zip(got, base, strict=True))


@PEFT_WARNINGS
@pytest.mark.parametrize("name", ["llama-qv", "qwen2-all", "qwen3-rslora"])
def test_adapter_logits_match_peft(loaded, tiny_models, adapters, name):
    family, path = adapters[name]
    model = loaded(family)
    lora = read_lora(path, model.config, 64)
    ids = model.tokenizer(PROMPTS[0])["input_ids"]
    with torch.inference_mode():
        ref = peft_model(tiny_models, family, path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(score_prompt(model.weights, model.config, ids, lora=lora), ref,
                               rtol=1e-4, atol=1e-4)


def test_what_an_adapter_holds(loaded, adapters):
    rs = read_lora(adapters["qwen3-rslora"][1], loaded("qwen3").config, 64)
    assert rs.rank == 16 and rs.scale == lora_scale(8, 16, rslora=True) == 2.0
    assert rs.targets == {"k_proj", "o_proj", "up_proj", "down_proj"}
    qv = read_lora(adapters["llama-qv"][1], loaded("llama").config, 64)
    assert qv.scale == 2.0 and qv.targets == {"q_proj", "v_proj"}
    # q and v become slices of the fused qkv output, around k's columns
    q, v = qv.layers[0]["qkv"]
    cfg = loaded("llama").config
    assert (q.start, q.end) == (0, cfg.num_heads * cfg.head_dim)
    assert v.end == (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert set(qv.layers[1]) == {"qkv"}  # nothing else of the layer is touched


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(loaded, adapters):
    """The base model and two adapters in one batch, chunked prefills beside decodes:
    every request's tokens and log-probabilities equal its run alone, bit for bit."""
    model = loaded("llama")
    loras = {n: adapters[n][1] for n in ("llama-all", "llama-qv")}
    prompts = [tuple(model.tokenizer(p)["input_ids"]) for p in PROMPTS] + [LONG]
    plan = [(None, 0), ("llama-all", 0), ("llama-qv", 0), ("llama-all", 3), ("llama-qv", 1),
            (None, 3), ("llama-qv", 3)]

    def request(i: int) -> Request:
        lora, p = plan[i]
        return Request(f"r{i}", prompts[p], max_tokens=10, lora=lora, logprobs=2)

    def result(outs: list[RequestOutput]):
        return tokens(outs), [lp for o in outs for lp in o.logprobs or ()]

    alone = [result(run(core_with(model, loras), [request(i)])[f"r{i}"])
             for i in range(len(plan))]
    mixed = run(core_with(model, loras, max_prefill_tokens=24, max_chunk_tokens=16),
                [request(i) for i in range(len(plan))])
    assert [result(mixed[f"r{i}"]) for i in range(len(plan))] == alone
    assert alone[0][0] != alone[1][0] != alone[2][0]


# ---- the prefix cache is keyed by adapter ------------------------------------------------
def test_a_prefix_is_reused_within_one_adapter_only(loaded, adapters):
    core = core_with(loaded("llama"), {"a": adapters["llama-all"][1],
                                       "b": adapters["llama-qv"][1]})

    def cached(rid: str, lora: str | None) -> int:
        return run(core, [Request(rid, LONG, max_tokens=2, lora=lora)])[rid][0].num_cached_tokens

    assert cached("base", None) == 0
    base_events = stored(core)
    assert [e.lora_name for e in base_events] == [None]
    assert core.cached_prefix_tokens(LONG) == 32
    assert core.cached_prefix_tokens(LONG, "a") == 0
    assert cached("a1", "a") == 0  # the base model's blocks are not the adapter's KV
    a_events = stored(core)
    assert [e.lora_name for e in a_events] == ["a"]
    # the router keys them the same way: the adapter seeds the chain
    first = hash_block(None, LONG[:16], "a")
    assert a_events[0].block_hashes == (first, hash_block(first, LONG[16:32], "a"))
    assert set(a_events[0].block_hashes).isdisjoint(base_events[0].block_hashes)
    assert cached("a2", "a") == 32
    assert cached("b1", "b") == 0
    assert cached("base2", None) == 32
    assert core.cached_prefix_tokens(LONG, "a") == core.cached_prefix_tokens(LONG, "b") == 32


def test_unloading_unpublishes_the_adapters_blocks(loaded, adapters):
    core = core_with(loaded("llama"), {"a": adapters["llama-all"][1]})
    run(core, [Request("base", LONG, max_tokens=2), Request("a", LONG, max_tokens=2, lora="a")])
    a_hashes = {h for e in stored(core) if e.lora_name == "a" for h in e.block_hashes}
    assert core.remove_lora("a") == {}
    removed = {h for e in core.drain_kv_events() if isinstance(e, BlockRemoved)
               for h in e.block_hashes}
    assert removed == a_hashes
    # another adapter loaded under the same name is not credited with the old one's KV
    core.add_lora("a", core.read_lora(str(adapters["llama-qv"][1])))
    assert core.cached_prefix_tokens(LONG, "a") == 0
    assert core.cached_prefix_tokens(LONG) == 32


def test_a_remote_prefill_computes_and_hashes_with_the_adapter(loaded, adapters):
    """The prefill engine computes the prompt's KV with the adapter; the decode engine,
    holding only the base model's prefix, reserves every block and continues exactly."""
    model = loaded("llama")
    loras = {"a": adapters["llama-all"][1]}

    def request(rid: str, **kw) -> Request:
        return Request(rid, LONG, max_tokens=10, lora="a", **kw)

    expected = tokens(run(core_with(model, loras), [request("ref")])["ref"])
    prefill, decode = core_with(model, loras), core_with(model, loras)
    run(decode, [Request("base", LONG, max_tokens=2)])
    stored(decode)
    done = run(prefill, [request("p", prefill_only=True)])["p"][-1]
    alloc = decode.allocate_remote(request("p"))
    assert alloc is not None and alloc.num_cached_tokens == 0
    for s, d in zip(done.kv_block_ids, alloc.block_ids, strict=False):
        decode.kv_pool()[d] = prefill.kv_pool()[s]
    prefill.release_kv("p")
    decode.resume_remote("p", done.new_token_ids[0])
    got: list[int] = []
    while decode.has_unfinished():
        for out in decode.step():
            got.extend(out.new_token_ids)
    assert got == expected
    assert {e.lora_name for e in stored(decode)} == {"a"}
    assert decode.cached_prefix_tokens(LONG, "a") == 32


# ---- what is refused, by name ------------------------------------------------------------
def _edit_config(**changes):
    def edit(d: Path) -> None:
        path = d / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


def _edit_tensors(fn):
    def edit(d: Path) -> None:
        path = d / "adapter_model.safetensors"
        tensors = load_file(str(path))
        fn(tensors)
        save_file(tensors, str(path))
    return edit


def _rename(old: str, new: str):
    def fn(t: dict) -> None:
        for key in [k for k in t if old in k]:
            t[key.replace(old, new)] = t.pop(key)
    return fn


Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
BROKEN = {
    "no config": (lambda d: (d / "adapter_config.json").unlink(),
                  r"adapter_config.json: missing"),
    "no weights": (lambda d: (d / "adapter_model.safetensors").unlink(),
                   r"adapter_model.safetensors: missing"),
    "dora": (_edit_config(use_dora=True), r"adapter_config.json: use_dora=True is not"),
    "bias": (_edit_config(bias="lora_only"), r"bias='lora_only' is not supported"),
    "not lora": (_edit_config(peft_type="IA3"), r"peft_type 'IA3'"),
    "saved modules": (_edit_config(modules_to_save=["lm_head"]), r"modules_to_save="),
    "module outside": (_edit_config(target_modules=["q_proj", "lm_head"]),
                       r"target_modules lm_head outside"),
    "tensor outside": (_edit_tensors(_rename("layers.0.mlp.up_proj", "layers.0.mlp.fc1")),
                       r"tensor base_model.model.model.layers.0.mlp.fc1.lora_[AB].weight is not "
                       r"a LoRA A or B weight of a decoder projection"),
    "rank": (_edit_config(r=128), r"r=128 is above this engine's max_lora_rank=64"),
    "layer": (_edit_tensors(_rename("layers.1.", "layers.5.")),
              r"is for layer 5; the base model has 2 layers"),
    "shape": (_edit_tensors(lambda t: t.update({Q_B: t[Q_B][:60]})),
              r"layer 0 q_proj lora_B has shape \[60, 8\]; the base model \(r=8\) needs "
              r"\[64, 8\]"),
    "rank of tensors": (_edit_config(r=4),
                        r"layer 0 down_proj lora_A has shape \[8, 128\]; the base model "
                        r"\(r=4\) needs \[4, 128\]"),
    "half a pair": (_edit_tensors(lambda t: t.pop(Q_B)), r"layer 0 q_proj has no lora_B"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_adapter_that_cannot_be_served_exactly_is_refused_by_name(
        loaded, tiny_lora, tmp_path, case):
    edit, message = BROKEN[case]
    copy = Path(shutil.copytree(tiny_lora, tmp_path / "adapter"))
    edit(copy)
    with pytest.raises(ValueError, match=message):
        read_lora(copy, loaded("llama").config, 64)


def test_engine_args_give_the_slots_and_the_rank_limit():
    args = TorchEngineArgs()
    assert (args.max_loras, args.max_lora_rank) == (4, 64)
    assert (EngineConfig().max_loras, EngineConfig().max_lora_rank) == (4, 64)
    with pytest.raises(ValueError, match="max_loras"):
        TorchEngineArgs(max_loras=0)


# ---- the engine behind the Engine protocol -----------------------------------------------
class CopyAgent:
    """Both sides of a NIXL agent for engines in one process: copies blocks between
    their pools and announces the arrival."""

    def __init__(self, name: str, peers: dict) -> None:
        self.name, self.peers = name, peers
        self.arrived: dict[str, asyncio.Future] = {}

    def _fut(self, rid: str) -> asyncio.Future:
        return self.arrived.setdefault(rid, asyncio.get_running_loop().create_future())

    async def write_blocks(self, peer, src, dst, notify, *, request_id):
        target = self.peers[peer]
        target.core.kv_pool()[list(dst)] = self.peers[self.name].core.kv_pool()[list(src)]
        target.agent._fut(request_id).set_result(type("Arrival", (), {"payload": notify})())
        return type("Written", (), {"nbytes": 0, "seconds": 0.0, "path": "copy"})()

    def expect(self) -> None:
        """Blocks were reserved (the real agent polls faster from now)."""

    async def wait_for(self, rid: str, timeout_s: float):
        return await asyncio.wait_for(self._fut(rid), timeout_s)

    def cancel(self, rid: str) -> None:
        """A late write for ``rid`` is not unpacked (nothing to do here)."""


@pytest_asyncio.fixture
async def engines(loaded):
    """Two torch engines over the tiny Llama (each with an agent: disaggregation and
    live KV moves work between them) and a third with one adapter slot."""
    model = loaded("llama")
    peers: dict = {}
    made = {}
    for name, slots in (("a", 4), ("b", 4), ("one", 1)):
        core = EngineCore(model.weights, model.config,
                          EngineConfig(num_blocks=64, max_loras=slots))
        runner = EngineRunner(core, asyncio.get_running_loop())
        runner.start()
        made[name] = peers[name] = TorchEngine(core, runner, 16, CopyAgent(name, peers),
                                               arrival_timeout_s=2.0, late_write_hold_s=0.2,
                                               park_hold_s=5.0)
    yield made
    for eng in made.values():
        eng.runner.stop()


def params(lora: str | None = "x", token_ids=LONG, max_tokens: int = 12) -> GenerateParams:
    return GenerateParams(token_ids=tuple(token_ids), max_tokens=max_tokens, temperature=0.0,
                          lora=lora)


async def collect(stream) -> list[int]:
    return [t async for d in stream for t in d.token_ids]


@pytest.mark.asyncio
async def test_loading_validating_and_unloading(engines, adapters, tmp_path):
    eng = engines["a"]
    path = str(adapters["llama-all"][1])
    assert eng.info.capabilities.serves_lora and eng.loras() == {}
    with pytest.raises(ValueError, match="adapter 'x' is not loaded"):
        eng.validate(params())
    await eng.load_lora("x", path)
    await eng.load_lora("x", path)  # the same directory again: nothing changes
    assert eng.loras() == {"x": path}
    eng.validate(params())
    with pytest.raises(ValueError, match="'x' is loaded from .* already"):
        await eng.load_lora("x", str(adapters["llama-qv"][1]))
    with pytest.raises(ValueError, match="adapter_config.json: missing"):
        await eng.load_lora("y", str(tmp_path))
    with pytest.raises(KeyError, match="adapter 'y' is not loaded"):
        await eng.unload_lora("y")
    stream = eng.generate("r", params(max_tokens=200))
    await anext(stream)
    with pytest.raises(ValueError, match="adapter 'x' is in use by 1 request"):
        await eng.unload_lora("x")
    await stream.aclose()  # the client left: the request is aborted
    await eng.unload_lora("x")
    assert eng.loras() == {}
    assert await eng.runner.call(eng.core.loras.paths) == {}


@pytest.mark.asyncio
async def test_no_slot_left_is_refused_until_one_is_freed(engines, adapters):
    eng = engines["one"]
    await eng.load_lora("x", str(adapters["llama-all"][1]))
    with pytest.raises(ValueError, match="no LoRA slot left for 'z': max_loras=1"):
        await eng.load_lora("z", str(adapters["llama-qv"][1]))
    await eng.unload_lora("x")
    await eng.load_lora("z", str(adapters["llama-qv"][1]))
    assert list(eng.loras()) == ["z"]


@pytest.mark.asyncio
async def test_disaggregated_and_moved_requests_keep_their_adapter(engines, adapters):
    """reserve_remote / prefill / decode between two engines, and a live KV move,
    each end with exactly the aggregated adapter output."""
    a, b = engines["a"], engines["b"]
    for eng in (a, b):
        await eng.load_lora("x", str(adapters["llama-all"][1]))
    whole = await collect(a.generate("ref", params()))
    assert whole != await collect(a.generate("base", params(lora=None)))
    assert await b.cached_prefix_tokens(LONG, "x") == 0
    handoff = await b.reserve_remote("d1", params())
    result = await a.prefill("d1", params(), destination=handoff)
    assert await collect(b.decode("d1", params(), handoff, result.first_token)) == whole
    assert await b.cached_prefix_tokens(LONG, "x") == 32
    assert await b.cached_prefix_tokens(LONG) == 0

    # long enough that the request is still running when it is parked
    whole = await collect(a.generate("ref2", params(max_tokens=MOVE_TOKENS)))
    stream = a.generate("m1", params(max_tokens=MOVE_TOKENS))
    got: list[int] = []
    async for d in stream:
        got += d.token_ids
        if len(got) >= 4:
            break
    eid, moved = await a.park("m1")
    await stream.aclose()
    outcomes: list[str] = []

    async def fetch(dest, notify_id):
        assert notify_id == "m1" + MOVE_SUFFIX
        await a.export_parked(eid, dest, notify_id)

    sent = list(moved[len(LONG):])
    rest = await collect(b.resume_moved("m1", params(token_ids=moved,
                                                     max_tokens=MOVE_TOKENS - len(sent)),
                                        fetch, outcomes.append))
    assert outcomes == ["moved"] and sent + rest == whole
