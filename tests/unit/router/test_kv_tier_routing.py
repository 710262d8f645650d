"""KV tiers in routing: the tier weights of the Router section (defaults, bounds, errors
naming file and field), the KV scorers crediting a block by the tier holding it, the
tier-event feed (sequence gaps, capacity, pool events ignored there), and per-tier hits
in `dynamo route explain`."""

from __future__ import annotations

import msgspec
import pytest
from dynamo.llm import compute_block_hash_for_seq
from typer.testing import CliRunner

from splitserve.cli.main import app
from splitserve.contracts.kit.tier_events import TierEnvelopes
from splitserve.components.router import Decision, format_decision
from splitserve.components.router.kv_index import KvEventIndex
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import (
    RouterComponentConfig,
    load_policy,
)
from splitserve.contracts.block_events import BlockRemoved, BlockStored, hash_block
from splitserve.contracts.config import ConfigError
from splitserve.contracts.kv_events import KvEventEncoder
from splitserve.contracts.wire import RouteCall
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import load_plan
from tests.unit.router.fakes import FakeClient

pytestmark = pytest.mark.unit

BS = 16
PROMPT = list(range(1, 4 * BS + 1))  # four full blocks
DISAGG = "graphs.disagg:Frontend"
A, B = 0xA, 0xB


def chain(tokens: list[int]) -> list[int]:
    out: list[int] = []
    for i in range(len(tokens) // BS):
        out.append(hash_block(out[-1] if out else None, tokens[i * BS:(i + 1) * BS]))
    return out


H = chain(PROMPT)


def stored(first: int, last: int, tier: str) -> BlockStored:
    return BlockStored(block_hashes=tuple(H[first:last + 1]),
                       parent_hash=H[first - 1] if first else None,
                       token_ids=tuple(PROMPT[first * BS:(last + 1) * BS]),
                       num_block_tokens=(BS,) * (last + 1 - first), tier=tier)


def service(policy: str = "kv_aware", **weights) -> tuple[RouterService, KvEventIndex]:
    cfg = RouterComponentConfig(policy=policy, block_size=BS, **weights)
    index = KvEventIndex("ns", "Worker")
    svc = RouterService(cfg, load_policy(cfg), FakeClient([A, B]), index,
                        hash_blocks=lambda tokens, lora=None: compute_block_hash_for_seq(
                            tokens, BS, lora_name=lora))
    return svc, index


def hold(index: KvEventIndex, worker: int, *tiers: str) -> None:
    """``worker`` holds PROMPT's blocks, block i in ``tiers[i]``, as its events say."""
    enc = KvEventEncoder(worker)
    for i, tier in enumerate(tiers):
        index.apply(enc.encode([stored(i, i, tier)]))


def explain(svc: RouterService) -> Decision:
    _, decision = svc.decide(RouteCall(request_id="q", token_ids=PROMPT, explain=True,
                                       record=False))
    return decision


# ---- weights in the Router section -----------------------------------------------------
def test_tier_weights_default_to_dynamos():
    cfg = RouterComponentConfig()
    assert (cfg.host_cache_hit_weight, cfg.disk_cache_hit_weight) == (0.75, 0.25)
    assert cfg.tier_weights() == {"device": 1.0, "host": 0.75, "disk": 0.25}


@pytest.mark.parametrize("field,value", [("host_cache_hit_weight", 1.5),
                                         ("disk_cache_hit_weight", -0.1),
                                         ("disk_cache_hit_weight", "nan")])
def test_a_weight_outside_0_1_is_refused_naming_file_and_field(tmp_path, field, value):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"Router: {{{field}: {value}}}\n")
    g = load_graph(DISAGG)
    with pytest.raises(ConfigError) as exc:
        load_plan(g, DISAGG, cfg, [], g.defined)
    assert exc.value.source == str(cfg)
    assert any(e.startswith(f"Router.{field}") for e in exc.value.errors), exc.value.errors


def test_a_bad_weight_on_the_command_line_exits_2_naming_file_and_field():
    res = CliRunner().invoke(app, ["serve", DISAGG, "-f", "configs/disagg.yaml",
                                   "--Router.host_cache_hit_weight=2", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert "configs/disagg.yaml" in res.output and "Router.host_cache_hit_weight" in res.output


# ---- the KV scorers ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["kv_aware", "latency_cost"])
def test_a_device_hit_beats_the_same_blocks_on_disk(policy):
    svc, index = service(policy)
    hold(index, A, "disk", "disk", "disk", "disk")
    hold(index, B, "device", "device", "device", "device")
    d = explain(svc)
    assert d.worker_id == B, format_decision(d)
    assert d.tier_hits == {A: {"device": 0, "host": 0, "disk": 4},
                           B: {"device": 4, "host": 0, "disk": 0}}


@pytest.mark.parametrize("policy", ["kv_aware", "latency_cost"])
def test_a_host_hit_beats_a_disk_hit_and_any_hit_beats_none(policy):
    svc, index = service(policy)
    hold(index, A, "host", "host", "host")
    hold(index, B, "disk", "disk", "disk")
    assert explain(svc).worker_id == A
    svc, index = service(policy)
    hold(index, B, "disk")  # one block on disk, A nothing
    assert explain(svc).worker_id == B


def test_the_overlap_score_is_the_weighted_fraction():
    svc, index = service()
    hold(index, A, "device", "host", "disk")  # 1 + 0.75 + 0.25 of 4 blocks
    hold(index, B, "host", "host", "host", "host")  # 3 of 4
    d = explain(svc)
    raw = next(b.raw for b in d.scorers if b.plugin == "overlap")
    assert raw[A] == pytest.approx(0.5) and raw[B] == pytest.approx(0.75)
    svc, index = service(host_cache_hit_weight=0.0, disk_cache_hit_weight=1.0)
    hold(index, A, "device", "host", "disk")
    hold(index, B, "host", "host", "host", "host")
    raw = next(b.raw for b in explain(svc).scorers if b.plugin == "overlap")
    assert raw[A] == pytest.approx(0.5) and raw[B] == 0.0


def test_weights_of_zero_credit_the_pool_alone():
    svc, index = service(host_cache_hit_weight=0.0, disk_cache_hit_weight=0.0)
    hold(index, A, "device")
    hold(index, B, "host", "host", "host", "host")
    assert explain(svc).worker_id == A


# ---- the tier-event feed -------------------------------------------------------------------
def message(env: TierEnvelopes, *events) -> bytes:
    data = env.envelope(events)
    assert data is not None
    return data


def test_tier_messages_carry_lower_tiers_and_capacity_and_skip_the_pools():
    index = KvEventIndex("ns", "Worker")
    env = TierEnvelopes(A, {"host": 6, "disk": 9})
    assert env.envelope([stored(0, 1, "device")]) is None  # the pool's go through Dynamo's
    assert index.apply_tier_message(message(env, stored(0, 1, "device"),
                                            stored(0, 1, "host"))) == 1
    assert index.tiers.capacity[A] == {"host": 6, "disk": 9}
    held = index.tiers.held(A)
    assert held["device"] == set() and held["host"] == {h & (2**64 - 1) for h in H[:2]}
    assert index.tiers.occupancy(A) == {"device": (0, None), "host": (2, 6), "disk": (0, 9)}


def test_a_lost_tier_message_drops_the_workers_lower_tiers_and_is_counted():
    index = KvEventIndex("ns", "Worker")
    index.apply(KvEventEncoder(A).encode([stored(0, 0, "device")]))
    env = TierEnvelopes(A, {"host": 8})
    index.apply_tier_message(message(env, stored(1, 1, "host")))
    lost = message(env, BlockRemoved((H[1],), tier="host"))  # never arrives
    assert lost
    index.apply_tier_message(message(env, stored(2, 2, "host")))
    assert index.tier_gaps == 1
    # Block 1 (stale: it was removed) is gone, block 2 arrived after the gap, the pool's
    # block 0 stays.
    hashes = compute_block_hash_for_seq(PROMPT, BS)
    assert index.overlap_by_tier(hashes)[A] == {"device": 1, "host": 0, "disk": 0}
    assert index.tiers.held(A)["host"] == {H[2] & (2**64 - 1)}
    # In order again: no new gap.
    index.apply_tier_message(message(env, stored(1, 1, "host")))
    assert index.tier_gaps == 1
    assert index.overlap_by_tier(hashes)[A] == {"device": 1, "host": 2, "disk": 0}


def test_another_topic_on_the_subject_is_ignored():
    index = KvEventIndex("ns", "Worker")
    data = msgspec.msgpack.encode({"publisher_id": A, "sequence": 0, "topic": "other",
                                   "payload": b""})
    assert index.apply_tier_message(data) == 0 and index.tier_messages == 0


# ---- explain ---------------------------------------------------------------------------
def test_explain_shows_hits_per_tier_for_each_candidate():
    svc, index = service()
    hold(index, A, "device", "host", "disk")
    hold(index, B, "disk", "disk")
    text = format_decision(explain(svc), width=200)
    assert "hit blocks device/host/disk" in text
    row = {line.split("│")[1].strip(): line for line in text.splitlines()
           if line.count("│") > 3 and line.split("│")[1].strip() in (f"{A:x}", f"{B:x}")}
    assert "1 / 1 / 1" in row[f"{A:x}"] and "0 / 0 / 2" in row[f"{B:x}"]
    # the decision travels as JSON (`dynamo route explain` renders it from the reply)
    again = Decision.model_validate_json(explain(svc).to_json())
    assert again.tier_hits == {A: {"device": 1, "host": 1, "disk": 1},
                               B: {"device": 0, "host": 0, "disk": 2}}


def test_explain_without_tier_data_has_no_tier_column():
    svc, _ = service()
    text = format_decision(explain(svc))
    assert "device/host/disk" not in text


def test_the_feed_metrics_count_messages_and_gaps():
    from prometheus_client import CollectorRegistry, generate_latest

    from splitserve.components.router.feeds import TierFeedMetrics

    index = KvEventIndex("ns", "Worker")
    env = TierEnvelopes(A, {"host": 8})
    index.apply_tier_message(message(env, stored(0, 0, "host")))
    message(env, stored(1, 1, "host"))  # lost
    index.apply_tier_message(message(env, stored(2, 2, "host")))
    registry = CollectorRegistry()
    registry.register(TierFeedMetrics(index))
    text = generate_latest(registry).decode()
    assert "splitserve_router_kv_tier_event_messages_total 2.0" in text
    assert "splitserve_router_kv_tier_event_gaps_total 1.0" in text
    assert index._gapped == {A}  # asked to announce again on the next message's return
    assert "splitserve_router_kv_announce_requests_total 0.0" in text


def test_route_explain_cli_is_unchanged_by_the_decisions_new_field():
    # `dynamo route explain` validates the reply's decision: a reply from a router of
    # before tiers (no tier_hits) still reads.
    d = Decision(request_id="r", profile="p", worker_id=None, reason="no-workers",
                 candidates=(), totals={})
    data = d.model_dump(mode="json")
    data.pop("tier_hits")
    assert Decision.model_validate(data).tier_hits == {}



# ---- admission prices a lower-tier hit ---------------------------------------------------
def test_admission_prices_a_lower_tier_hit_by_its_weight_neither_free_nor_a_miss():
    svc, index = service()
    hold(index, A, "host", "host", "host", "host")  # 4 blocks in host memory
    hold(index, B, "disk", "disk")
    cached, restore = svc._cached_tokens({}, by_tier(svc))
    assert cached[A] == int(4 * BS * 0.75)  # a host block saves 3/4 of a recompute
    assert cached[B] == int(2 * BS * 0.25)
    assert restore == {}  # nothing measured: the weights stand in
    cached, restore = svc._cached_tokens({A: 4}, by_tier(svc))
    assert cached[A] == 4 * BS and A not in restore  # a device hit stays whole


def by_tier(svc: RouterService) -> dict[int, dict[str, int]]:
    svc._refresh_live()
    _, tiers, weighted = svc._prefix_hits(svc.hash_blocks(PROMPT))
    return svc._with_tiers(svc.fleet.snapshot(0.0, {}, {}), tiers, weighted)[1]


def report_costs(index: KvEventIndex, worker: int, sequence: int, **costs: float) -> None:
    """``worker``'s tier events say what restoring a block from each tier took there."""
    env = TierEnvelopes(worker, {"host": 8, "disk": 8})
    env.sequence = sequence
    index.apply_tier_message(env.envelope([], costs))


def test_admission_prices_a_lower_tier_hit_at_the_restore_cost_its_worker_measured():
    svc, index = service()
    hold(index, A, "device", "host", "host", "disk")
    report_costs(index, A, 0, host=0.4, disk=3.0)
    cached, restore = svc._cached_tokens({A: 1}, by_tier(svc))
    # Every block it holds is not prefilled; the three below the pool are copied back.
    assert cached[A] == 4 * BS
    assert restore[A] == pytest.approx(2 * 0.4 + 3.0)


def test_an_unmeasured_tier_is_still_priced_by_its_weight_beside_a_measured_one():
    svc, index = service()
    hold(index, A, "host", "host", "disk", "disk")
    report_costs(index, A, 0, host=0.5)  # nothing restored from disk there yet
    cached, restore = svc._cached_tokens({}, by_tier(svc))
    assert cached[A] == int((2 + 2 * 0.25) * BS)
    assert restore[A] == pytest.approx(1.0)


def test_the_predicted_ttft_carries_the_measured_restore_time():
    svc, index = service()
    hold(index, A, "host", "host", "host", "host")
    hold(index, B, "host", "host", "host", "host")
    report_costs(index, A, 0, host=50.0)  # a slow host tier: 200 ms for the prefix
    report_costs(index, B, 0, host=0.5)
    call = RouteCall(request_id="q", token_ids=PROMPT, explain=True, record=False)
    svc._refresh_live()
    cached, restore = svc._cached_tokens({}, by_tier(svc))
    a = svc.qos._estimate(call, A, cached[A], 0.0, 0.0, "default", restore_ms=restore[A])
    b = svc.qos._estimate(call, B, cached[B], 0.0, 0.0, "default", restore_ms=restore[B])
    assert a.restore_ms == pytest.approx(200.0) and b.restore_ms == pytest.approx(2.0)
    assert a.request_tokens == b.request_tokens == 0  # neither prefills the prefix
    assert a.est_ttft_ms - b.est_ttft_ms == pytest.approx(198.0)
    assert a.unloaded_ttft_ms - b.unloaded_ttft_ms == pytest.approx(198.0)


def test_a_workers_restore_costs_are_kept_until_reported_again_and_dropped_when_it_leaves():
    _, index = service()
    report_costs(index, A, 0, host=0.4)
    index.apply_tier_message(TierEnvelopes(A, {"host": 8}).envelope(
        [stored(0, 0, "host")]) or b"")  # an older publisher: no costs in its envelope
    assert index.tiers.restore_ms[A] == {"host": 0.4}
    report_costs(index, A, 1, host=float("nan"), disk=-1.0)  # not a cost: ignored
    assert index.tiers.restore_ms[A] == {"host": 0.4}
    index.sync_workers({A})
    index.sync_workers(set())
    assert A not in index.tiers.restore_ms


def test_the_router_counts_the_blocks_it_credits_the_chosen_worker_per_tier():
    svc, index = service()
    hold(index, A, "device", "host", "host")
    reply, _ = svc.decide(RouteCall(request_id="r", token_ids=PROMPT))
    assert reply.worker_id == A
    counted = {s.labels["tier"]: s.value for m in svc.metrics.tier_hit_blocks.collect()
               for s in m.samples if s.name.endswith("_total")}
    assert counted == {"device": 1, "host": 2, "disk": 0}
