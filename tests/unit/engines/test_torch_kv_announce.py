"""The torch engine announces its whole KV cache again when a router asks (a router that
starts after the workers): every cached block of the pool, each after the block before
it, and every block of each tier; applied to an empty router index they give the view
a router that saw every event from the start has; the runner delivers the announcement
in order with the engine's other events."""

from __future__ import annotations

import asyncio
import random

import pytest

from splitserve.components.engines.torch_cpu.kv_cache import KVCacheManager, block_nbytes
from splitserve.components.engines.torch_cpu.kv_tiers import DiskTier, HostTier, TierChain
from splitserve.components.engines.torch_cpu.runner import EngineRunner
from splitserve.components.router.kv_index import TierBlockIndex
from splitserve.contracts.block_events import BlockRemoved, BlockStored
from splitserve.contracts.kv_events import KvEventEncoder, event_tier
from tests.fixtures.kv_blocks import compute

pytestmark = pytest.mark.unit

BS = 4
NBYTES = block_nbytes(BS, 2, 1, 2)
WID = 7


def index_of(events) -> TierBlockIndex:
    """A router's tier index fed ``events`` as a worker publishes them."""
    idx = TierBlockIndex()
    for ev in KvEventEncoder(WID).encode(events):
        idx.apply(WID, event_tier(ev), ev["event"])
    return idx


@pytest.fixture(params=["pool only", "tiers"])
def kv(request, tmp_path):
    tiers = None
    if request.param == "tiers":
        disk = DiskTier(str(tmp_path), 6 * NBYTES)
        tiers = TierChain([HostTier(3 * NBYTES), disk])
    kv = KVCacheManager(5, BS, num_layers=2, num_kv_heads=1, head_dim=2, tiers=tiers)
    yield kv
    kv.close()


def test_the_announcement_equals_every_event_so_far(kv):
    rng = random.Random(3)
    seen = []
    prompts = [list(range(s, s + 3 * BS)) + [999] for s in (1, 100, 200, 300, 400)]
    prompts.append(prompts[0][:2 * BS] + [5] * BS)  # shares two blocks with the first
    for i, p in enumerate(prompts):
        compute(kv, f"r{i}", p, rng)
        seen += kv.drain_events()
    announced = kv.announced_events()
    assert all(isinstance(ev, BlockStored) for ev in announced)
    live, late = index_of(seen), index_of(announced)
    held = {t: {h & (2**64 - 1) for h in hs} for t, hs in kv.held_blocks().items()}
    assert late.held(WID) == live.held(WID) == {**{"host": set(), "disk": set()}, **held}
    # The pool's blocks come parents first: each one's parent is announced before it
    # (or is not in the pool).
    order = {ev.block_hashes[0]: i for i, ev in enumerate(announced) if ev.tier == "device"}
    for ev in announced:
        if ev.tier == "device" and ev.parent_hash in order:
            assert order[ev.parent_hash] < order[ev.block_hashes[0]]
    # Announcing twice changes nothing for a router that already has it.
    again = index_of(seen + announced + kv.announced_events())
    assert again.held(WID) == live.held(WID)


class Core:
    """What the runner calls for an announcement (``EngineCore.announce_kv_events``'s
    order: pending events, then the cache)."""

    def __init__(self) -> None:
        self.pending = [BlockRemoved((1,))]

    def announce_kv_events(self):
        out, self.pending = self.pending, []
        return out + [BlockStored((2,), None, (0, 1, 2, 3), (4,))]

    def has_unfinished(self) -> bool:
        return False


def test_the_engines_announcement_puts_pending_events_first(tiny_models):
    from splitserve.components.engines.torch_cpu import EngineConfig, EngineCore, load_model
    from splitserve.components.engines.torch_cpu.request import Request

    model = load_model(str(tiny_models["llama"]))
    core = EngineCore(model.weights, model.config, EngineConfig(block_size=BS, num_blocks=8))
    core.add_request(Request("a", tuple(range(1, 3 * BS + 1)), max_tokens=1))
    while core.has_unfinished():
        core.step()
    # The step's events were not drained yet when a router asked.
    events = core.announce_kv_events()
    cache = core.kv.announced_events()
    assert events[-len(cache):] == cache
    pending = events[:-len(cache)]
    assert pending and isinstance(pending[0], BlockStored)
    assert core.drain_kv_events() == []  # delivered with the announcement, not twice


def test_the_runner_delivers_one_announcement_after_the_pending_events():
    async def run():
        got: list = []
        runner = EngineRunner(Core(), asyncio.get_running_loop(), on_kv_events=got.append)
        runner.announce_cache()
        runner.announce_cache()  # queued already: one announcement answers both
        runner.start()
        try:
            for _ in range(100):
                if got:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
        finally:
            runner.stop()
        return got
    got = asyncio.run(run())
    assert len(got) == 1
    assert [type(e).__name__ for e in got[0]] == ["BlockRemoved", "BlockStored"]
