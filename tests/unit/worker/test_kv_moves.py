"""The aggregated shell's side of live KV moves, around an engine stand-in: what a parked
stream's drained chunk carries, the ``kv_export`` replies, and when a continuing replica
recomputes instead of fetching.  The engine's own part (parking, writing, resuming the
real model) is tests/unit/engines/test_torch_kv_moves.py; the whole path over NIXL is
tests/e2e/test_kv_moves_torch.py."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.contracts.engine import GenerateParams, TokenDelta
from splitserve.contracts.wire import KvSource
from splitserve.components.worker.agg import stream_chunks
from splitserve.components.worker.kv_moves import DrainCut, KvMoves
from splitserve.contracts.kit.worker_metrics import WorkerMetrics

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

PROMPT = (5, 6, 7)


class Engine:
    """Streams one token per 10 ms; ``park`` returns the prompt, the tokens streamed so
    far and ``unsent`` more (made before the cut, never streamed), or None."""

    def __init__(self, parkable: bool = True, unsent: tuple[int, ...] = (90, 91)) -> None:
        self.parkable, self.unsent = parkable, unsent
        self.streamed: list[int] = []
        self.generated: list[str] = []
        self.exported: list[tuple] = []

    async def generate(self, rid: str, params: GenerateParams):
        self.generated.append(rid)
        for t in range(100, 200):
            await asyncio.sleep(0.01)
            self.streamed.append(t)
            yield TokenDelta(token_ids=(t,))

    async def park(self, rid: str):
        if not self.parkable:
            return None
        return rid + "#kv", (*PROMPT, *self.streamed, *self.unsent)

    async def export_parked(self, rid, destination, notify_id):
        if rid != "parked":
            raise LookupError(f"request {rid!r} is not parked here")
        self.exported.append((rid, destination.block_ids, notify_id))
        return type("Res", (), {"nbytes": 64, "seconds": 0.01, "path": "direct"})()

    def resume_moved(self, rid, params, fetch, outcome):
        raise AssertionError("not expected in these tests")


def moves_for(engine: Engine, client=None) -> KvMoves:
    return KvMoves(engine, client, WorkerMetrics().registry, fetch_timeout_s=0.5)


def outcome(moves: KvMoves, name: str) -> float:
    return moves.metrics.outcomes.labels(name)._value.get()


async def drained_after_two(engine: Engine) -> tuple[list[dict], KvMoves]:
    moves = moves_for(engine)
    cut = asyncio.Event()
    drain = DrainCut(cut, moves, "r1", len(PROMPT))
    chunks = []
    async for c in stream_chunks(engine.generate("r1", GenerateParams(PROMPT)),
                                 WorkerMetrics(), None, drain):
        chunks.append(c)
        if len(chunks) == 2:
            cut.set()
    return chunks, moves


async def test_a_parked_stream_ends_with_the_kv_and_the_tokens_not_yet_sent():
    engine = Engine()
    chunks, moves = await drained_after_two(engine)
    *sent, last = chunks
    assert [c["token_ids"] for c in sent] == [[100], [101]]
    # what the engine made after the two streamed tokens, whether or not the stream
    # had read it, then the KV of every token but the last
    made = engine.streamed[2:] + list(engine.unsent)
    assert last == {"token_ids": made, "drained": True,
                    "kv": {"request_id": "r1#kv", "tokens": len(PROMPT) + 2 + len(made) - 1}}
    assert moves.announcing == 0 and outcome(moves, "parked") == 1


async def test_a_stream_that_cannot_be_parked_ends_with_a_plain_drained_chunk():
    chunks, moves = await drained_after_two(Engine(parkable=False))
    assert chunks[-1] == {"token_ids": [], "drained": True}
    assert moves.announcing == 0 and outcome(moves, "parked") == 0


async def test_kv_export_replies_ok_or_names_the_error():
    engine = Engine()
    moves = moves_for(engine)
    dest = {"kind": "torch-blocks", "nixl_agent": "agg-2", "block_ids": [4, 5],
            "block_size": 16}
    ok = [r async for r in moves.export({"request_id": "parked", "destination": dest,
                                         "notify_id": "n1"})]
    assert ok == [{"ok": True, "nbytes": 64, "seconds": 0.01, "path": "direct"}]
    assert engine.exported == [("parked", [4, 5], "n1")]
    for bad in ({"request_id": "gone", "destination": dest, "notify_id": "n"},
                {"request_id": "parked", "destination": {"kind": "torch-blocks"},
                 "notify_id": "n"}):
        (reply,) = [r async for r in moves.export(bad)]
        assert set(reply) == {"error"}
    assert outcome(moves, "exported") == 1 and outcome(moves, "export_failed") == 2


async def test_a_kv_source_that_does_not_match_the_request_is_recomputed():
    engine = Engine()
    moves = moves_for(engine)
    params = GenerateParams(token_ids=(1, 2, 3, 4))
    stream = moves.resume("r2", params, KvSource(worker_id=7, request_id="r2", tokens=2))
    await anext(stream)
    await stream.aclose()
    assert engine.generated == ["r2"] and outcome(moves, "recomputed") == 1


class ExportClient:
    """Dynamo's client to ``kv_export``: answers with ``reply``, or never."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.asked: list[tuple] = []

    async def direct(self, payload, worker_id):
        self.asked.append((payload, worker_id))

        async def stream():
            if self.reply is None:
                await asyncio.sleep(3600)
            yield self.reply
        return stream()


@pytest.mark.parametrize("reply", [{"error": "LookupError: not parked"}, None])
async def test_a_fetch_that_is_refused_or_unanswered_raises(reply):
    from splitserve.contracts.engine import TorchBlocksHandoff

    client = ExportClient(reply)
    fetch = moves_for(Engine(), client)._fetcher(
        KvSource(worker_id=0xAB, request_id="r3", tokens=9))
    handoff = TorchBlocksHandoff(nixl_agent="agg-1", block_ids=[1], block_size=16)
    with pytest.raises((RuntimeError, asyncio.TimeoutError)):
        await fetch(handoff, "r3#kv")
    payload, worker = client.asked[0]
    assert worker == 0xAB and payload["request_id"] == "r3"
    assert payload["notify_id"] == "r3#kv" and payload["destination"]["block_ids"] == [1]
