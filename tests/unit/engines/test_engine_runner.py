"""The engine runner's failure handling: per-request errors stay per request, a dead
loop fails every waiting request and asks the process to leave (non-zero exit)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from splitserve.contracts.kit.fatal import ENGINE_FAILED_EXIT, leave_after_engine_failure
from splitserve.components.engines.torch_cpu.runner import EngineRunner

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Req:
    request_id: str
    steps: int = 2


@dataclass(frozen=True)
class Out:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


class ScriptedCore:
    """A pure core that emits one token per step per request; a request named "crash"
    makes ``step`` raise (the core's state is unknown), one named "bad" fails alone."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}

    def add_request(self, req: Req) -> None:
        if req.request_id == "refused":
            raise ValueError("token id 49152 is outside the vocabulary")
        self.left[req.request_id] = req.steps

    def abort(self, request_id: str) -> None:
        self.left.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self) -> list[Out]:
        if "crash" in self.left:
            raise RuntimeError("corrupted KV pool")
        outs = []
        for rid in list(self.left):
            if rid == "bad":
                del self.left[rid]
                outs.append(Out(rid, (), True, "error", "IndexError: out of range"))
                continue
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(Out(rid, (7,), done, "length" if done else None))
        return outs

    def drain_kv_events(self) -> list:
        return []

    def stats(self) -> dict:
        return {}


async def collect(q: asyncio.Queue) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), 5)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def test_failed_and_refused_requests_do_not_stop_the_others() -> None:
    asyncio.run(_failed_and_refused_requests_do_not_stop_the_others())


async def _failed_and_refused_requests_do_not_stop_the_others() -> None:
    fatal: list[BaseException] = []
    runner = EngineRunner(ScriptedCore(), asyncio.get_running_loop(), on_fatal=fatal.append)
    runner.start()
    try:
        good, bad, refused = (runner.submit(Req(n, 3)) for n in ("good", "bad", "refused"))
        assert (await collect(bad))[-1].finish_reason == "error"
        assert isinstance((await collect(refused))[-1], ValueError)
        assert [o.new_token_ids for o in await collect(good)] == [(7,)] * 3
        later = runner.submit(Req("later", 1))
        assert (await collect(later))[-1].finish_reason == "length"
        assert runner.alive and not fatal
    finally:
        runner.stop()


def test_a_step_that_raises_fails_everyone_and_calls_on_fatal() -> None:
    asyncio.run(_a_step_that_raises_fails_everyone_and_calls_on_fatal())


async def _a_step_that_raises_fails_everyone_and_calls_on_fatal() -> None:
    fatal: list[BaseException] = []
    runner = EngineRunner(ScriptedCore(), asyncio.get_running_loop(), on_fatal=fatal.append)
    runner.start()
    waiting = runner.submit(Req("w", 100))
    crash = runner.submit(Req("crash"))
    for q in (waiting, crash):
        assert isinstance((await collect(q))[-1], RuntimeError)
    assert len(fatal) == 1 and "corrupted" in str(fatal[0])
    assert not runner.alive
    with pytest.raises(RuntimeError, match="engine failed"):
        runner.submit(Req("after"))
    runner.stop()


def test_leaving_reports_failed_deregisters_and_exits_non_zero() -> None:
    asyncio.run(_leaving_reports_failed_deregisters_and_exits_non_zero())


async def _leaving_reports_failed_deregisters_and_exits_non_zero() -> None:
    calls: list = []

    async def deregister() -> None:
        calls.append("deregister")

    await leave_after_engine_failure(
        RuntimeError("boom"), lambda state, **kw: calls.append((state, kw["detail"])),
        deregister, exit=lambda code: calls.append(("exit", code)))
    assert calls[0][0] == "failed" and "boom" in calls[0][1]
    assert calls[1:] == ["deregister", ("exit", ENGINE_FAILED_EXIT)]
    assert ENGINE_FAILED_EXIT != 0


def test_leaving_does_not_wait_forever_on_a_hung_deregistration() -> None:
    asyncio.run(_leaving_does_not_wait_forever_on_a_hung_deregistration())


async def _leaving_does_not_wait_forever_on_a_hung_deregistration() -> None:
    codes: list[int] = []

    async def hang() -> None:
        await asyncio.sleep(60)

    await asyncio.wait_for(leave_after_engine_failure(
        RuntimeError("boom"), lambda *a, **k: None, hang, exit=codes.append, timeout_s=0.1), 5)
    assert codes == [ENGINE_FAILED_EXIT]
