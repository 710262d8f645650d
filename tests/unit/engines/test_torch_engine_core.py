"""Engine core behaviour: batching, prefix cache, preemption, abort, sampling, disaggregation."""

from __future__ import annotations

import pytest

from splitserve.components.engines.torch_cpu import (
    BlockRemoved,
    EngineConfig,
    EngineCore,
    LoadedModel,
    Request,
    RequestOutput,
)

pytestmark = pytest.mark.unit

TEXTS = [
    "Once upon a time",
    "The three primary colours are",
    "Write a haiku about the sea:",
    "import numpy as np\n\ndef mean(xs):",
    "List the planets of the solar system in order from the sun:",
    "Q: What is 12 times 12?\nA:",
    "The mitochondria is",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean, which",
    "Hello",
    "A recipe for pancakes needs flour, eggs, milk and",
    "The best way to learn a new programming language is to",
    "Translate to French: I would like a cup of coffee, please.",
]


def run(engine: EngineCore, requests: list[Request]) -> dict[str, list[RequestOutput]]:
    """Add all requests, step until done, return each request's outputs in order."""
    for req in requests:
        engine.add_request(req)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def prompts(smollm2: LoadedModel) -> list[tuple[int, ...]]:
    return [tuple(smollm2.tokenizer(t)["input_ids"]) for t in TEXTS]


@pytest.fixture(scope="module")
def sequential(smollm2: LoadedModel, prompts) -> list[list[int]]:
    """Greedy outputs, one request at a time on a fresh engine each."""
    result = []
    for i, p in enumerate(prompts):
        engine = EngineCore(smollm2.weights, smollm2.config, EngineConfig(num_blocks=16))
        result.append(tokens(run(engine, [Request(f"s{i}", p, max_tokens=12)])[f"s{i}"]))
    return result


def test_batched_greedy_equals_sequential(make_engine, prompts, sequential) -> None:
    # Small prefill budget: prompts are chunked and mixed with decodes differently
    # than when run alone; 32 requests (each prompt in the batch several times).
    engine = make_engine(max_prefill_tokens=48, max_running=32)
    reqs = [Request(f"b{k}", prompts[k % len(prompts)], max_tokens=12) for k in range(32)]
    outs = run(engine, reqs)
    for k in range(32):
        assert tokens(outs[f"b{k}"]) == sequential[k % len(prompts)], k
    assert engine.stats().num_running == 0


@pytest.mark.parametrize("chunk, short_waits", [(None, True), (16, False)])
def test_a_chunk_cap_lets_a_short_prompt_past_a_long_one(make_engine, prompts, sequential,
                                                          chunk, short_waits) -> None:
    # The long prompt arrives first and alone would take the whole per-step budget.
    engine = make_engine(max_prefill_tokens=48, max_chunk_tokens=chunk)
    long_prompt = tuple(t for p in prompts for t in p)[:120]
    engine.add_request(Request("long", long_prompt, max_tokens=2))
    engine.add_request(Request("short", prompts[8], max_tokens=12))  # "Hello"
    outs: dict[str, list] = {"short": [], "long": []}
    for o in engine.step():
        outs[o.request_id].append(o)
    assert bool(tokens(outs["short"])) is not short_waits  # a token in the first step
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    assert tokens(outs["short"]) == sequential[8]  # greedy output unchanged by chunking


def test_repeated_prompt_is_a_prefix_hit(make_engine, prompts, sequential) -> None:
    engine = make_engine()
    long_prompt = prompts[7]
    first = run(engine, [Request("a", long_prompt, max_tokens=12)])["a"]
    second = run(engine, [Request("b", long_prompt, max_tokens=12)])["b"]
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == (len(long_prompt) - 1) // 16 * 16 > 0
    assert tokens(second) == tokens(first) == sequential[7]
    assert engine.stats().prefix_hit_tokens == second[-1].num_cached_tokens


def test_tiny_pool_preempts_and_evicts_but_outputs_stay_correct(
    make_engine, prompts, sequential
) -> None:
    engine = make_engine(num_blocks=12, block_size=4, attention_tile=8, max_running=8)
    outs = run(engine, [Request(f"t{i}", p, max_tokens=12) for i, p in enumerate(prompts[:8])])
    for i in range(8):
        assert tokens(outs[f"t{i}"]) == sequential[i], i
    assert engine.stats().num_preemptions > 0
    assert any(isinstance(e, BlockRemoved) for e in engine.drain_kv_events())


def test_priority_decides_who_is_preempted(make_engine, prompts) -> None:
    engine = make_engine(num_blocks=10, block_size=4, attention_tile=8)
    engine.add_request(Request("low", prompts[7], max_tokens=12, priority=0))
    engine.add_request(Request("high", prompts[4], max_tokens=12, priority=5))
    finished: list[str] = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]
    assert engine.stats().num_preemptions > 0


def test_abort_frees_blocks_and_reports(make_engine, prompts) -> None:
    engine = make_engine()
    engine.add_request(Request("x", prompts[7], max_tokens=50))
    engine.add_request(Request("y", prompts[1], max_tokens=50))
    engine.step()
    engine.step()
    used_before = engine.stats().kv_blocks_used
    engine.abort("x")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "x"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert engine.stats().kv_blocks_used < used_before
    engine.abort("y")
    engine.step()
    assert engine.stats().kv_blocks_used == 0
    assert not engine.has_unfinished()


def test_prompt_that_can_never_fit_is_rejected(make_engine) -> None:
    engine = make_engine(num_blocks=2, block_size=4, attention_tile=8)
    with pytest.raises(ValueError, match="can never fit"):
        engine.add_request(Request("big", tuple(range(1, 10)), max_tokens=1))


def test_max_tokens_finishes_with_length(make_engine, prompts) -> None:
    outs = run(make_engine(), [Request("l", prompts[0], max_tokens=3, stop_token_ids=())])["l"]
    assert len(tokens(outs)) == 3 and outs[-1].finish_reason == "length"


def test_seeded_sampling_is_reproducible(make_engine, prompts) -> None:
    def sample(seed: int, rid: str) -> list[int]:
        req = Request(rid, prompts[2], max_tokens=10, temperature=1.0, top_p=0.9, seed=seed)
        return tokens(run(make_engine(), [req])[rid])

    a, b = sample(7, "a"), sample(7, "b")
    assert a == b
    assert any(sample(s, f"c{s}") != a for s in (8, 9, 10))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefill_elsewhere_then_resume_equals_local(
    make_engine, prompts, temperature: float
) -> None:
    prompt = prompts[7]

    def request(rid: str, **kw) -> Request:
        return Request(rid, prompt, max_tokens=12, temperature=temperature, seed=3, **kw)

    expected = tokens(run(make_engine(), [request("ref")])["ref"])

    prefill_engine, decode_engine = make_engine(), make_engine()
    done = run(prefill_engine, [request("p", prefill_only=True)])["p"][-1]
    assert done.finished and len(done.new_token_ids) == 1 and done.kv_block_ids
    alloc = decode_engine.allocate_remote(request("p"))
    assert alloc is not None and alloc.num_cached_tokens == 0
    src, dst = prefill_engine.kv_pool(), decode_engine.kv_pool()
    # the decode side may hold one more block (for the tokens it will generate)
    for s, d in zip(done.kv_block_ids, alloc.block_ids, strict=False):
        dst[d] = src[s]  # whole-block copy, as the KV transfer layer will do
    prefill_engine.release_kv("p")
    decode_engine.resume_remote("p", done.new_token_ids[0])
    got: list[int] = []  # the decode engine reports the first token too
    while decode_engine.has_unfinished():
        for o in decode_engine.step():
            got.extend(o.new_token_ids)
    assert got == expected
    assert decode_engine.stats().kv_blocks_used == 0
    assert prefill_engine.stats().kv_blocks_used == 0
