"""The policy file's routing sections (cache, split_policy, hotspot prevention) change
which worker the router picks."""

from __future__ import annotations

import pytest

from splitserve.components.router import build_router, default_registry
from splitserve.components.router.builtin import builtin_config
from splitserve.components.router.seed_policy import SeedRouting, SplitWeights, hot_workers
from splitserve.components.policy.schema import parse_policy

from .router_factories import request, snapshot, worker

pytestmark = pytest.mark.unit


def kv_aware(seed: SeedRouting | None = None):
    registry = default_registry()
    base = build_router(builtin_config("kv_aware", registry), registry)
    return base if seed is None else base.with_seed(seed)


# Worker 1 holds 6 of the prompt's 10 blocks but is busier; worker 2 is idle, no cache.
BUSY_HOLDER = snapshot(worker(1, active_requests=3), worker(2, active_requests=0),
                       overlap={1: 6})


@pytest.mark.parametrize("seed,expected", [
    (None, 1),                                                   # no policy: cache wins
    (SeedRouting(), 1),                                          # neutral sections
    (SeedRouting(reuse_prefix=False), 2),                        # overlap ignored: by load
    (SeedRouting(min_cache_hit_ratio=0.5), 1),                   # 0.6 >= 0.5: holder
    (SeedRouting(min_cache_hit_ratio=0.75), 2),                  # 0.6 < 0.75: by load
])
def test_cache_sections_decide_between_holder_and_idle_worker(seed, expected):
    decision = kv_aware(seed).route(request(10), BUSY_HOLDER)
    assert decision.worker_id == expected


def test_hotspot_prevention_caps_a_much_busier_cache_holder():
    # Worker 1 holds the whole prompt but runs 12 requests while the others run 1 each.
    snap = snapshot(worker(1, active_requests=12), worker(2, active_requests=1),
                    worker(3, active_requests=1), overlap={1: 10})
    assert kv_aware().route(request(10), snap).worker_id == 1
    decision = kv_aware(SeedRouting(hotspot_prevention=True)).route(request(10), snap)
    assert decision.worker_id in (2, 3)
    assert [r.worker_id for r in decision.removed] == [1]
    assert decision.removed[0].plugin == "seed-policy"


@pytest.mark.parametrize("loads,hot", [
    ((0, 0), set()),
    ((4, 1), set()),          # 4 <= 2*1 + 2
    ((5, 1), {1}),            # 5 > 2*1 + 2
    ((9, 9, 0), set()),       # 9 <= 2*4.5 + 2 against the other two
    ((30, 1, 1), {1}),
    ((3,), set()),            # a lone worker is never removed
])
def test_hot_workers_table(loads, hot):
    workers = [worker(i + 1, active_requests=n) for i, n in enumerate(loads)]
    assert set(hot_workers(workers)) == hot


def split(threshold=0, cache=10.0, queue=1.5, decode=0.5) -> SeedRouting:
    return SeedRouting(split=SplitWeights(prompt_length_threshold=threshold,
                                          prefix_cache_weight=cache,
                                          queue_length_weight=queue, decode_load_weight=decode))


def round_robin(seed: SeedRouting):
    registry = default_registry()
    return build_router(builtin_config("round_robin", registry), registry).with_seed(seed)


@pytest.mark.parametrize("seed,expected", [
    # Worker 1: 2 waiting, 4 cached blocks; worker 2: 6 active, nothing cached.
    (split(cache=10.0, queue=1.5, decode=0.5), 1),   # 3 - 40 < 3: cache wins
    (split(cache=0.0, queue=5.0, decode=0.5), 2),    # 10 > 3: queue weighs most
    (split(cache=0.0, queue=0.1, decode=5.0), 1),    # 0.2 < 30: decode load weighs most
    (split(threshold=1000, cache=10.0, queue=5.0), 2),  # short prompt: cache not counted
])
def test_split_policy_weights_change_the_choice(seed, expected):
    snap = snapshot(worker(1, waiting_requests=2), worker(2, active_requests=6),
                    overlap={1: 4})
    # Round robin alone scores every worker the same way per call; the split-policy
    # scorer (weight 1, min-max to [0, 1]) is what separates them.
    decision = round_robin(seed).route(request(10), snap)
    names = [s.plugin for s in decision.scorers]
    assert "split-policy" in names
    breakdown = decision.scorers[names.index("split-policy")]
    assert breakdown.raw[expected] == 1.0 and breakdown.raw[3 - expected] == 0.0


def test_policy_file_sections_reach_the_router():
    policy = parse_policy({
        "split_policy": {"prompt_length_threshold": 256, "prefix_cache_weight": 10.0,
                         "queue_length_weight": 1.5, "decode_load_weight": 0.5},
        "enable_hotspot_prevention": True,
        "cache": {"reuse_prefix": True, "min_cache_hit_ratio": 0.75}})
    seed = SeedRouting.from_policy(policy)
    assert seed == SeedRouting(reuse_prefix=True, min_cache_hit_ratio=0.75,
                               hotspot_prevention=True,
                               split=SplitWeights(256, 10.0, 1.5, 0.5))
    assert not seed.neutral
    assert SeedRouting.from_policy(parse_policy({"enable_hotspot_prevention": False})).neutral
    router = kv_aware(seed)
    assert router.route(request(10), BUSY_HOLDER).worker_id == 2  # 0.6 < 0.75
