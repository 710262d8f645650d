"""`dynamo route explain` against a router that is registered but never answers: the
command ends with an error naming the namespace and the wait, instead of hanging; a
router that died but is still registered is skipped for one that answers."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.cli import route_cmd

pytestmark = pytest.mark.unit


class _Silent:
    """A client whose router was found and accepted the call, then sent nothing."""

    def instance_ids(self):
        return [1]

    async def direct(self, _request, _iid):
        async def never():
            await asyncio.Event().wait()
            yield {}
        return never()


class _OneGone:
    """Two routers registered: the first died (its lease has not run out yet)."""

    def instance_ids(self):
        return [2, 1]

    async def direct(self, _request, iid):
        if iid == 1:
            raise ConnectionError("TCP connection to 127.0.0.1:36635 failed")

        async def answer():
            yield {"worker_id": 7, "reason": "kv overlap", "decision": None}
        return answer()


class _Endpoint:
    async def client(self):
        return None  # handed to _first_serving, which is replaced


class _Runtime:
    shut = False

    def endpoint(self, _path):
        return _Endpoint()

    def shutdown(self) -> None:
        _Runtime.shut = True


def fake_runtime(monkeypatch, client):
    async def first_serving(_clients, _timeout_s):
        return client

    monkeypatch.setattr(route_cmd, "_first_serving", first_serving)
    monkeypatch.setattr(route_cmd, "ANSWER_S", 0.2)
    monkeypatch.setattr("splitserve.contracts.kit.component.make_runtime",
                        lambda _loop, _transport: _Runtime())
    monkeypatch.setattr("dynamo.runtime.logging.configure_dynamo_logging", lambda: None)
    monkeypatch.setattr(route_cmd.os, "environ", dict(route_cmd.os.environ))  # a copy


def test_a_router_that_never_answers_is_an_error_not_a_hang(monkeypatch):
    fake_runtime(monkeypatch, _Silent())

    async def explain():
        return await route_cmd._explain("http://127.0.0.1:1", None, "ns", [1, 2], "default",
                                        0.1)

    with pytest.raises(route_cmd.NoAnswer, match=r"namespace 'ns' did not answer within 0s"):
        asyncio.run(asyncio.wait_for(explain(), 10))
    assert _Runtime.shut


def test_a_dead_router_still_registered_is_skipped(monkeypatch):
    fake_runtime(monkeypatch, _OneGone())

    async def no_offload(*_args):
        return None
    monkeypatch.setattr(route_cmd, "_offload", no_offload)
    reply = asyncio.run(asyncio.wait_for(route_cmd._explain(
        "http://127.0.0.1:1", None, "ns", [1, 2], "default", 0.1), 10))
    assert reply["worker_id"] == 7
