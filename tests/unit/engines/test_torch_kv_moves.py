"""Live KV moves between two torch engines: a running request parked on one continues on
the other from the moved KV, and its greedy output equals the uninterrupted one.

Both engines run the real model on their runner threads.  The agent is a stand-in that
copies blocks between the two pools and announces the arrival (the NIXL write itself is
covered by tests/integration/test_kv_transfer.py and the chaos test); everything the
engines do with the blocks is real, so a wrong block, token count or offset changes the
output.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from splitserve.contracts.engine import GenerateParams
from splitserve.components.engines.torch_cpu.adapter import MOVE_SUFFIX, TorchEngine
from splitserve.components.engines.torch_cpu.runner import EngineRunner

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

BS = 16
PROMPT = tuple(range(200, 237))  # 37 tokens: the parked KV ends inside a block


class CopyAgent:
    """Both sides of a NIXL agent for two pools in one process."""

    def __init__(self, name: str, pools: dict) -> None:
        self.name, self.pools = name, pools
        self.arrived: dict[str, asyncio.Future] = {}
        self.cancelled: list[str] = []
        self.expected = 0
        self.writes = 0

    def _fut(self, rid: str) -> asyncio.Future:
        return self.arrived.setdefault(rid, asyncio.get_running_loop().create_future())

    async def write_blocks(self, peer, src, dst, notify, *, request_id):
        self.writes += 1
        self.pools[peer].kv_pool()[list(dst)] = self.pools[self.name].kv_pool()[list(src)]
        self.pools["agents"][peer]._fut(request_id).set_result(
            type("Arrival", (), {"payload": notify})())
        return type("Res", (), {"nbytes": 0, "seconds": 0.0, "path": "copy"})()

    def expect(self) -> None:
        """Blocks were reserved: the real agent polls fast from now (counted here)."""
        self.expected += 1

    async def wait_for(self, rid: str, timeout_s: float):
        return await asyncio.wait_for(self._fut(rid), timeout_s)

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)


@pytest_asyncio.fixture
async def pair(make_engine):
    pools: dict = {"agents": {}}
    engines = []
    for name in ("a", "b"):
        core = make_engine(block_size=BS, num_blocks=64)
        runner = EngineRunner(core, asyncio.get_running_loop())
        runner.start()
        agent = CopyAgent(name, pools)
        pools[name], pools["agents"][name] = core, agent
        engines.append(TorchEngine(core, runner, BS, agent, arrival_timeout_s=2.0,
                                   late_write_hold_s=0.2, park_hold_s=5.0))
    yield engines
    for e in engines:
        e.runner.stop()


def params(token_ids=PROMPT, max_tokens: int = 24) -> GenerateParams:
    return GenerateParams(token_ids=tuple(token_ids), max_tokens=max_tokens,
                          temperature=0.0)


async def run(stream) -> list[int]:
    return [t async for d in stream for t in d.token_ids]


async def park_after(engine: TorchEngine, rid: str, n: int) -> tuple[list[int], tuple]:
    """Start ``rid`` on ``engine``, read ``n`` tokens, park it; returns the tokens read
    and the parked token ids."""
    stream = engine.generate(rid, params())
    got: list[int] = []
    async for d in stream:
        got += d.token_ids
        if len(got) >= n:
            break
    eid, tokens = await engine.park(rid)
    assert eid == rid
    await stream.aclose()  # what the shell does: ending the stream aborts nothing now
    return got, tokens


async def used(engine: TorchEngine) -> int:
    return (await engine.runner.call(engine.core.stats)).kv_blocks_used


@pytest.mark.parametrize("reference_on", ["a", "b"])
async def test_a_moved_request_continues_exactly_where_it_stopped(pair, reference_on):
    """Run uninterrupted first on the source, or on the target (whose prefix cache then
    holds the request's leading blocks: only the others are written)."""
    a, b = pair
    whole = await run((a if reference_on == "a" else b).generate("ref", params()))
    got, tokens = await park_after(a, "r1", 5)
    assert tokens[:len(PROMPT)] == PROMPT and list(tokens[len(PROMPT):len(PROMPT) + 5]) == got
    assert a.parked() == 1 and await used(a) > 0
    outcomes: list[str] = []

    async def fetch(handoff, notify_id):
        assert notify_id == "r1" + MOVE_SUFFIX
        cached.append(handoff.num_cached_tokens)
        await a.export_parked("r1", handoff, notify_id)

    cached: list[int] = []
    sent = list(tokens[len(PROMPT):])  # what the frontend has after the drained chunk
    rest = await run(b.resume_moved("r1", params(tokens, 24 - len(sent)), fetch,
                                    outcomes.append))
    assert outcomes == ["moved"]
    assert sent + rest == whole
    assert cached == [0 if reference_on == "a" else 2 * BS]  # the full prompt blocks
    # the source freed its blocks once they were written; the target's request is done
    assert a.parked() == 0 and await used(a) == 0
    assert b.runner.inflight() == 0


async def test_a_failed_move_recomputes_and_still_continues_exactly(pair):
    a, b = pair
    whole = await run(a.generate("ref", params()))
    _, tokens = await park_after(a, "r2", 3)

    async def gone(handoff, notify_id):
        raise ConnectionError("the drained replica has left")

    outcomes: list[str] = []
    sent = list(tokens[len(PROMPT):])
    rest = await run(b.resume_moved("r2", params(tokens, 24 - len(sent)), gone,
                                    outcomes.append))
    assert outcomes == ["recomputed"]
    assert sent + rest == whole
    # the reservation for the move is held for a late write, then freed
    await asyncio.sleep(0.5)
    assert await used(b) == 0


async def test_park_refuses_what_cannot_move_and_unread_kv_is_freed(pair, monkeypatch):
    a, _ = pair
    assert await a.park("unknown") is None
    # a request that asks for log-probabilities keeps state its KV does not carry
    stream = a.generate("lp", GenerateParams(token_ids=PROMPT, max_tokens=20,
                                             temperature=0.0, logprobs=0))
    await anext(stream)
    assert await a.park("lp") is None
    await stream.aclose()
    # parked KV nobody reads is freed after the hold
    a.park_hold_s = 0.2
    await park_after(a, "r3", 2)
    assert a.parked() == 1
    await asyncio.sleep(0.5)
    assert a.parked() == 0 and await used(a) == 0
    with pytest.raises(LookupError, match="not parked"):
        await a.export_parked("r3", None, "x")  # type: ignore[arg-type]


async def test_the_notification_names_the_last_token(pair):
    a, b = pair
    _, tokens = await park_after(a, "r4", 4)
    seen = {}

    async def fetch(handoff, notify_id):
        res = await a.export_parked("r4", handoff, notify_id)
        seen["payload"] = json.loads(
            (await b.agent.wait_for(notify_id, 1)).payload)
        return res

    await run(b.resume_moved("r4", params(tokens, 4), fetch))
    assert seen["payload"] == {"request_id": "r4" + MOVE_SUFFIX, "first_token": tokens[-1]}


async def test_a_moved_request_can_move_again(pair):
    """A request continued from moved KV runs under another engine id; a second drain
    parks it by the caller's id and the next replica continues it exactly."""
    a, b = pair
    whole = await run(a.generate("ref", params()))
    _, tokens = await park_after(a, "r5", 3)

    async def from_a(handoff, notify_id):
        await a.export_parked("r5", handoff, notify_id)

    stream = b.resume_moved("r5", params(tokens, 24 - (len(tokens) - len(PROMPT))), from_a)
    got = list(tokens[len(PROMPT):])
    async for d in stream:
        got += d.token_ids
        if len(got) >= 9:
            break
    eid, again = await b.park("r5")
    await stream.aclose()
    assert eid == "r5" + MOVE_SUFFIX and again[:len(PROMPT)] == PROMPT

    async def from_b(handoff, notify_id):
        await b.export_parked(eid, handoff, notify_id)

    rest = await run(a.resume_moved("r5", params(again, 24 - (len(again) - len(PROMPT))),
                                    from_b))
    assert list(again[len(PROMPT):]) + rest == whole
    assert b.parked() == 0 and await used(b) == 0
