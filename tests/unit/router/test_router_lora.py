"""LoRA adapters in the router: prefix hashes keyed by adapter, the ``lora-loaded``
filter (built by name, and applied even by a profile that lacks it), a clear refusal
when no worker has the adapter, and ``route explain`` naming it."""

from __future__ import annotations

import json

import pytest

from splitserve.components.router import format_decision
from splitserve.components.router.feeds import block_hasher
from splitserve.components.router.plugins import lora_loaded
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import RouterComponentConfig, load_policy
from splitserve.contracts.wire import RouteCall, WorkerLoad

from .router_factories import config, request, router, snapshot, worker

pytestmark = pytest.mark.unit


# ---- the filter -------------------------------------------------------------------------

FILTER = {
    "base model: every worker": (None, {1: {"sql"}, 2: set()}, [1, 2], {}),
    "adapter: its holders": ("sql", {1: {"sql"}, 2: {"chat"}, 3: {"sql", "chat"}}, [1, 3],
                             {2: "adapter 'sql' not loaded"}),
    "nobody has it: nobody left": ("sql", {1: set(), 2: {"chat"}}, [],
                                   {1: "adapter 'sql' not loaded",
                                    2: "adapter 'sql' not loaded"}),
}


@pytest.mark.parametrize(("lora", "holds", "kept", "removed"), FILTER.values(),
                         ids=FILTER.keys())
def test_lora_loaded_filter(lora, holds, kept, removed):
    workers = [worker(w, loras=frozenset(names)) for w, names in holds.items()]
    result = lora_loaded.LoraLoadedFilter(lora_loaded.Params()).filter(
        request(lora=lora), snapshot(*workers), workers)
    assert [w.worker_id for w in result.kept] == kept
    assert result.removed == removed


def test_the_filter_is_built_by_name_and_takes_no_parameters():
    from pydantic import ValidationError

    doc = config([{"name": "a", "type": "lora-loaded"},
                  {"name": "pick", "type": "max-score"}],
                 [{"pluginRef": "a"}, {"pluginRef": "pick"}])
    r = router(doc)
    workers = (worker(1), worker(2, loras=frozenset({"sql"})))
    assert r.route(request(lora="sql"), snapshot(*workers)).worker_id == 2
    doc["plugins"][0]["parameters"] = {"strict": True}
    with pytest.raises(ValidationError, match="strict"):
        router(doc)


def test_a_profile_without_the_filter_still_routes_adapters_only_to_their_holders():
    doc = config([{"name": "load", "type": "least-requests"},
                  {"name": "pick", "type": "max-score",
                   "parameters": {"tie_break": "lowest-id"}}],
                 [{"pluginRef": "load"}, {"pluginRef": "pick"}])
    workers = (worker(1), worker(2, active_requests=5, loras=frozenset({"sql"})))
    d = router(doc).route(request(lora="sql"), snapshot(*workers))
    assert d.worker_id == 2 and d.lora == "sql"
    assert [(r.plugin, r.worker_id) for r in d.removed] == [("lora-loaded", 1)]
    assert router(doc).route(request(), snapshot(*workers)).worker_id == 1


# ---- hashing ----------------------------------------------------------------------------

def test_block_hashes_are_keyed_by_adapter():
    hashes = block_hasher(16)
    tokens = list(range(40))
    base, sql, chat = hashes(tokens), hashes(tokens, "sql"), hashes(tokens, "chat")
    assert len(base) == len(sql) == len(chat) == 2
    assert not set(base) & set(sql) and not set(sql) & set(chat)
    assert hashes(tokens, None) == base and hashes(tokens, "sql") == sql


def test_the_prefix_index_credits_a_prefix_only_to_requests_of_its_adapter():
    """Blocks a worker stored under an adapter (its KV event's local hashes carry the
    adapter, as Dynamo's publisher computes them when given ``lora_name``) match that
    adapter's requests only."""
    from dynamo.llm import RadixTree

    hashes, tokens, tree = block_hasher(16), list(range(32)), RadixTree()
    stored = {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 100 + i, "tokens_hash": h}
        for i, h in enumerate(hashes(tokens, "sql"))]}}}
    tree.apply_event(7, json.dumps(stored).encode())
    assert tree.find_matches(hashes(tokens, "sql")).scores == {(7, 0): 2}
    assert tree.find_matches(hashes(tokens)).scores == {}
    assert tree.find_matches(hashes(tokens, "chat")).scores == {}


# ---- the service --------------------------------------------------------------------------

class Discovery:
    def __init__(self, ids):
        self.ids = list(ids)

    def instance_ids(self):
        return list(self.ids)


class Index:
    """Overlap by the hashes asked: worker 1 caches the base prefix, worker 2 the
    adapter's."""

    def __init__(self, base, sql):
        self.base, self.sql = set(base), set(sql)

    def overlap(self, hashes):
        return {1: sum(h in self.base for h in hashes), 2: sum(h in self.sql for h in hashes)}


def service(loads: dict[int, set[str]]):
    hashes = block_hasher(16)
    tokens = list(range(64))
    cfg = RouterComponentConfig(policy="kv_aware")
    svc = RouterService(cfg, load_policy(cfg), Discovery(loads),
                        Index(hashes(tokens), hashes(tokens, "sql")), hash_blocks=hashes)
    for w, names in loads.items():  # as the load reports arrive from NATS
        svc.on_load(WorkerLoad(worker_id=w, kv_total_blocks=100,
                               loras=sorted(names)).model_dump_json().encode())
    return svc, tokens


def test_an_adapter_request_is_matched_against_the_adapters_prefix():
    svc, tokens = service({1: {"sql"}, 2: {"sql"}})
    base = svc.decide(RouteCall(request_id="b", token_ids=tokens, explain=True))[0]
    adapted = svc.decide(RouteCall(request_id="a", token_ids=tokens, lora="sql",
                                   explain=True))[0]
    assert base.worker_id == 1 and adapted.worker_id == 2
    assert adapted.decision["lora"] == "sql"
    overlap = next(s for s in adapted.decision["scorers"] if s["plugin"] == "overlap")
    assert overlap["raw"] == {"1": 0.0, "2": 1.0}


def test_an_adapter_no_worker_has_loaded_is_refused_with_its_own_reason():
    svc, tokens = service({1: set(), 2: {"chat"}})
    reply, decision = svc.decide(RouteCall(request_id="a", token_ids=tokens, lora="sql"))
    assert reply.worker_id is None and reply.reason == "lora-not-loaded"
    assert svc.fleet.placed == {}
    reply, _ = svc.decide(RouteCall(request_id="c", token_ids=tokens, lora="chat"))
    assert reply.worker_id == 2


def test_explain_names_the_adapter():
    svc, tokens = service({1: {"sql"}, 2: set()})
    _, decision = svc.decide(RouteCall(request_id="a", token_ids=tokens, lora="sql",
                                       explain=True))
    text = format_decision(decision)
    assert "adapter sql" in text and "adapter 'sql' not loaded" in text
