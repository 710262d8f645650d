"""The engine core under hostile input and failing steps: it rejects what it cannot embed,
fails only the request a step cannot compute, and keeps serving the others."""

from __future__ import annotations

import pytest

from splitserve.components.engines.torch_cpu import LoadedModel, Request, RequestOutput
from splitserve.components.engines.torch_cpu import engine as engine_module

pytestmark = pytest.mark.unit

POISON = 31337  # a real vocabulary id that the failing forward below refuses


@pytest.fixture(scope="module")
def prompt(smollm2: LoadedModel) -> tuple[int, ...]:
    return tuple(smollm2.tokenizer("The three primary colours are")["input_ids"])


def drain(engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture
def poisoned_forward(monkeypatch) -> set[int]:
    """The model's forward pass raises (as an out-of-range gather would) whenever the
    batch holds one of the returned set's ids (POISON at first), whatever else it holds."""
    real = engine_module.forward
    poison = {POISON}

    def forward(weights, config, pool, batch, tile):
        if any(int(t) in poison for t in batch.token_ids):
            raise IndexError("index out of range in self")
        return real(weights, config, pool, batch, tile)

    monkeypatch.setattr(engine_module, "forward", forward)
    return poison


@pytest.mark.parametrize("bad", [49152, 2**63, 10**9, -1])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_step(make_engine, prompt,
                                                                       bad) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(Request("bad", prompt + (bad,), max_tokens=4))
    assert not engine.has_unfinished()
    outs = drain_after(engine, Request("ok", prompt, max_tokens=4))
    assert outs["ok"][-1].finish_reason == "length" and len(tokens(outs["ok"])) == 4


def drain_after(engine, req: Request) -> dict[str, list[RequestOutput]]:
    engine.add_request(req)
    return drain(engine)


def test_a_request_failing_inside_a_batched_step_fails_alone(make_engine, prompt,
                                                            poisoned_forward) -> None:
    reference = drain_after(make_engine(), Request("ref", prompt, max_tokens=8))["ref"]
    engine = make_engine()
    engine.add_request(Request("good", prompt, max_tokens=8))
    engine.add_request(Request("bad", prompt + (POISON,), max_tokens=8))
    outs = drain(engine)
    bad = outs["bad"]
    assert bad[-1].finished and bad[-1].finish_reason == "error"
    assert "IndexError" in bad[-1].error and not tokens(bad)
    assert outs["good"][-1].finish_reason == "length"
    assert tokens(outs["good"]) == tokens(reference)
    assert engine.stats().kv_blocks_used == 0
    again = drain_after(engine, Request("after", prompt, max_tokens=8))
    assert tokens(again["after"]) == tokens(reference)


def test_a_request_failing_mid_decode_keeps_its_tokens_and_frees_its_blocks(
        make_engine, prompt, poisoned_forward) -> None:
    reference = tokens(drain_after(make_engine(), Request("ref", prompt, max_tokens=3))["ref"])
    poisoned_forward.add(reference[0])  # the first decode step feeds this token back
    engine = make_engine()
    d = drain_after(engine, Request("d", prompt, max_tokens=3))["d"]
    assert d[-1].finish_reason == "error" and tokens(d) == reference[:1]
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
