"""KV offload tiers: host and disk stores, the pool's evictions going down and prefixes
coming back, and an engine whose evicted prefix is restored instead of recomputed."""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.components.engines.torch_cpu import (
    BlockRemoved,
    BlockStored,
    EngineConfig,
    KVCacheManager,
    LoadedModel,
    Request,
    hash_block,
)
from splitserve.components.engines.torch_cpu.kv_cache import block_nbytes
from splitserve.components.engines.torch_cpu.kv_tiers import (
    GIB,
    DiskTier,
    HostTier,
    TierChain,
    build_tiers,
)

pytestmark = pytest.mark.unit

BS = 4
SHAPE = (2, 2, BS, 1, 2)  # [layers, K/V, block_size, kv_heads, head_dim] of make_kv's pool
NBYTES = block_nbytes(BS, 2, 1, 2)


def block(seed: int) -> torch.Tensor:
    """Random block contents (never zeros, so a missed copy cannot pass)."""
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def kv_files(tier: DiskTier) -> list[str]:
    return sorted(os.listdir(tier.directory))


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier(str(tmp_path), 2 * NBYTES)
    yield tier
    tier.close()


# ---- the stores ------------------------------------------------------------------------
def test_host_tier_evicts_least_recently_used_within_capacity() -> None:
    host = HostTier(3 * NBYTES)
    data = {k: block(k) for k in range(1, 5)}
    for k in (1, 2, 3):
        assert host.put(k, data[k], None) == []
    assert same_bits(host.get(1), data[1])  # 1 is now the most recently used
    (evicted,) = host.put(4, data[4], "ad")
    assert evicted.key == 2 and same_bits(evicted.data, data[2])
    assert [host.contains(k) for k in range(1, 5)] == [True, False, True, True]
    assert host.get(2) is None
    s = host.stats
    assert (s.hits, s.misses, s.writes, s.evictions) == (1, 1, 4, 1)
    assert s.bytes_used == 3 * NBYTES and s.bytes_written == 4 * NBYTES


def test_host_tier_keeps_a_copy_not_the_callers_tensor() -> None:
    host = HostTier(NBYTES)
    src = block(1)
    host.put(7, src, None)
    expected = src.clone()
    src.fill_(0.0)
    assert same_bits(host.get(7), expected)


def test_host_tier_forgets_an_unloaded_adapters_blocks() -> None:
    host = HostTier(4 * NBYTES)
    host.put(1, block(1), "a")
    host.put(2, block(2), None)
    host.discard_adapter("a")
    assert (host.contains(1), host.contains(2), host.stats.bytes_used) == (False, True, NBYTES)


def test_disk_tier_renames_complete_files_into_place(disk, monkeypatch) -> None:
    renames: list[tuple[str, str, int, bool]] = []
    real_replace = os.replace

    def replace(src, dst):
        renames.append((src, dst, os.path.getsize(src), os.path.exists(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    data = block(3)
    disk.put(-5, data, None)
    disk.flush()
    ((src, dst, size, existed),) = renames
    assert src == dst + ".tmp" and dst.endswith(".kv")
    assert (size, existed) == (NBYTES, False)  # whole block written before it gets its name
    assert kv_files(disk) == [os.path.basename(dst)]
    with open(dst, "rb") as f:
        assert f.read() == data.numpy().tobytes()
    assert same_bits(disk.get(-5), data)
    s = disk.stats
    assert (s.writes, s.hits, s.bytes_written, s.bytes_read) == (1, 1, NBYTES, NBYTES)


def test_disk_tier_removes_files_on_eviction_and_close(disk) -> None:
    data = {k: block(k) for k in range(3)}
    for k in range(3):
        disk.put(k, data[k], None)
    disk.flush()
    assert not disk.contains(0) and disk.get(0) is None
    assert kv_files(disk) == [f"{k:016x}.kv" for k in (1, 2)]
    assert same_bits(disk.get(1), data[1]) and same_bits(disk.get(2), data[2])
    assert (disk.stats.evictions, disk.stats.bytes_used) == (1, 2 * NBYTES)
    folder = disk.directory
    disk.close()
    assert not os.path.exists(folder)


def test_disk_tier_serves_a_block_whether_or_not_its_file_is_done(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), 64 * NBYTES, queue_depth=2)
    try:
        for k in range(32):
            src = block(k)
            disk.put(k, src, None)
            expected = src.clone()
            src.fill_(float("nan"))  # the caller reuses its buffer at once
            assert same_bits(disk.get(k), expected), k
        disk.flush()
        assert len(kv_files(disk)) == 32
        assert all(same_bits(disk.get(k), block(k)) for k in range(32))
    finally:
        disk.close()


def test_chain_writes_host_evictions_to_disk(disk) -> None:
    chain = TierChain([HostTier(2 * NBYTES), disk])
    data = {k: block(k) for k in range(5)}
    for k in range(5):
        chain.put(k, data[k], None)
    host = chain.tiers[0]
    assert [host.contains(k) for k in range(5)] == [False, False, False, True, True]
    assert [disk.contains(k) for k in range(5)] == [False, True, True, False, False]
    disk.flush()
    for k in range(1, 5):
        assert same_bits(chain.get(k), data[k]), k
    assert chain.get(0) is None
    stats = chain.stats()
    assert (stats["host"].hits, stats["disk"].hits, stats["disk"].evictions) == (2, 2, 1)
    assert stats["host"].misses == 3 and stats["disk"].misses == 1


# ---- the pool over tiers ---------------------------------------------------------------
def make_kv(num_blocks: int, tiers: TierChain | None) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, num_layers=2, num_kv_heads=1, head_dim=2, tiers=tiers)


def compute(kv: KVCacheManager, seq_id: str, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """Admit and 'compute' ``tokens`` (random KV into each new block), as the engine
    would; return a copy of every block of the sequence."""
    cached = kv.open_sequence(seq_id, tokens)
    assert kv.allocate(seq_id, len(tokens))
    for i, b in enumerate(kv.block_table(seq_id)[cached // BS :]):
        kv.pool()[b] = block(seed * 100 + i)
    kv.commit(seq_id, tokens, len(tokens))
    return [kv.pool()[b].clone() for b in kv.block_table(seq_id)]


PROMPT = list(range(1, 10))  # two full blocks and one token
OTHER = list(range(100, 116))  # four blocks: takes the whole pool


def evict_prompt(kv: KVCacheManager) -> list[torch.Tensor]:
    """Compute PROMPT, then OTHER in a pool of four blocks; PROMPT's blocks are evicted."""
    blocks = compute(kv, "a", PROMPT, seed=1)
    kv.free("a")
    compute(kv, "b", OTHER, seed=2)
    kv.free("b")
    assert kv.cached_prefix_tokens(OTHER) == 12  # OTHER holds the pool now
    return blocks


def make_tiers(kind: str, directory: str) -> TierChain | None:
    host = [HostTier(8 * NBYTES if kind == "host" else NBYTES)] if "host" in kind else []
    disk = [DiskTier(directory, 8 * NBYTES)] if "disk" in kind else []
    return TierChain(host + disk) if kind != "none" else None


@pytest.mark.parametrize(("tiers", "expected_cached"),
                         [("none", 0), ("host", 8), ("disk", 8), ("host+disk", 8)])
def test_an_evicted_prefix_comes_back_from_a_lower_tier(tmp_path, tiers, expected_cached
                                                        ) -> None:
    chain = make_tiers(tiers, str(tmp_path))
    kv = make_kv(4, chain)
    evict_prompt(kv)
    # PROMPT's two hashed blocks went down (not its tail, which has no hash).
    assert kv.num_offloaded_blocks == (2 if chain else 0)
    assert kv.cached_prefix_tokens(PROMPT) == expected_cached
    assert kv.open_sequence("c", PROMPT) == expected_cached  # not recomputed
    assert kv.num_restored_blocks == expected_cached // BS
    if chain is not None:
        assert sum(s.hits for s in kv.tier_stats().values()) == 2
        chain.close()


def test_a_block_through_host_and_disk_is_restored_bit_identical(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), 8 * NBYTES)
    kv = make_kv(4, TierChain([HostTier(NBYTES), disk]))
    original = evict_prompt(kv)
    disk.flush()
    assert len(kv_files(disk)) == 1  # the first evicted block went on down to disk
    kv.drain_events()
    assert kv.open_sequence("c", PROMPT) == 8
    for i, b in enumerate(kv.block_table("c")):
        assert same_bits(kv.pool()[b], original[i]), i
    stats = kv.tier_stats()
    assert (stats["host"].hits, stats["disk"].hits) == (1, 1)
    h0 = hash_block(None, PROMPT[:4])
    h1 = hash_block(h0, PROMPT[4:8])
    events = [e for e in kv.drain_events() if e.tier == "device"]  # the pool's
    # Taking two blocks evicts OTHER's; the restored ones are announced as stored again.
    assert [e for e in events if isinstance(e, BlockStored)] == [BlockStored(
        block_hashes=(h0, h1), parent_hash=None, token_ids=tuple(PROMPT[:8]),
        num_block_tokens=(BS, BS))]
    assert sum(isinstance(e, BlockRemoved) for e in events) == 2
    kv.close()
    assert not os.path.exists(disk.directory)


def test_a_prefix_partly_in_the_pool_goes_on_in_the_tiers() -> None:
    kv = make_kv(4, TierChain([HostTier(8 * NBYTES)]))
    original = compute(kv, "a", PROMPT, seed=1)
    kv.free("a")  # evicted in this order: the unhashed tail, block 1, block 0
    kv.open_sequence("b", [200])
    assert kv.allocate("b", 3 * BS)  # the tail, the one never used, and block 1
    kv.free("b")
    assert kv.open_sequence("c", PROMPT) == 8
    for i, b in enumerate(kv.block_table("c")):
        assert same_bits(kv.pool()[b], original[i]), i
    assert (kv.num_offloaded_blocks, kv.num_restored_blocks) == (1, 1)


def test_unloading_an_adapter_forgets_its_blocks_in_the_tiers() -> None:
    kv = make_kv(4, TierChain([HostTier(8 * NBYTES)]))
    assert kv.open_sequence("a", PROMPT, lora_name="ad") == 0
    assert kv.allocate("a", len(PROMPT))
    kv.commit("a", PROMPT, len(PROMPT))
    kv.free("a")
    compute(kv, "b", OTHER, seed=2)
    kv.free("b")
    assert kv.cached_prefix_tokens(PROMPT, "ad") == 8
    kv.forget_lora("ad")
    assert kv.cached_prefix_tokens(PROMPT, "ad") == 0
    assert kv.open_sequence("c", PROMPT, lora_name="ad") == 0


# ---- configuration -----------------------------------------------------------------------
@pytest.mark.parametrize(("settings", "names"), [
    ({"host_kv_cache_gib": -1}, ["host_kv_cache_gib"]),
    ({"disk_kv_cache_gib": -0.5, "disk_kv_cache_dir": "/x"}, ["disk_kv_cache_gib"]),
    ({"host_kv_cache_gib": float("inf")}, ["host_kv_cache_gib"]),
    ({"disk_kv_cache_gib": 1.0}, ["disk_kv_cache_gib", "disk_kv_cache_dir"]),
    ({"disk_kv_cache_dir": "/x"}, ["disk_kv_cache_dir", "disk_kv_cache_gib"]),
])
def test_config_errors_name_the_fields(settings, names) -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(**settings)
    for name in names:
        assert name in str(err.value)


def test_no_tiers_by_default() -> None:
    assert build_tiers(EngineConfig(), NBYTES) is None


@pytest.mark.parametrize(("field", "message"), [
    ("host_kv_cache_gib", "of memory is available"),
    ("disk_kv_cache_gib", "is free in"),
])
def test_start_refuses_more_than_the_machine_has(tmp_path, field, message) -> None:
    cfg = EngineConfig(**{field: 1e9, "disk_kv_cache_dir": str(tmp_path)}
                       if field.startswith("disk") else {field: 1e9})
    with pytest.raises(ValueError, match=rf"engine_args\.{field}=1000000000\.0: only .* {message}"):
        build_tiers(cfg, NBYTES)


def test_start_refuses_a_tier_smaller_than_one_block() -> None:
    with pytest.raises(ValueError, match=r"engine_args\.host_kv_cache_gib=.*holds no KV block"):
        build_tiers(EngineConfig(host_kv_cache_gib=(NBYTES - 1) / GIB), NBYTES)


# ---- an engine ---------------------------------------------------------------------------
def test_engine_restores_an_evicted_prefix_with_identical_output(
    make_engine, smollm2: LoadedModel, tmp_path
) -> None:
    cfg = smollm2.config
    nbytes = block_nbytes(4, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    tiny = {"num_blocks": 12, "block_size": 4, "attention_tile": 8}
    tiered = make_engine(**tiny, host_kv_cache_gib=2 * nbytes / GIB,
                         disk_kv_cache_dir=str(tmp_path), disk_kv_cache_gib=64 * nbytes / GIB)
    plain = make_engine(**tiny)
    tok = smollm2.tokenizer
    shared = tuple(tok("In 1492, Columbus sailed across the Atlantic Ocean and reached the "
                       "islands of the Caribbean, which")["input_ids"])
    other = tuple(tok("List the planets of the solar system in order from the sun, then "
                      "write a haiku about the sea and a recipe for pancakes with flour, "
                      "eggs, milk and butter, and then translate all of it to French, "
                      "please.")["input_ids"])[:44]
    assert len(other) == 44  # with 4 new tokens: all 12 blocks, so every cached one goes
    results = {}
    for name, engine in (("tiered", tiered), ("plain", plain)):
        outs = []
        for rid, prompt in (("a", shared), ("b", other), ("c", shared)):
            engine.add_request(Request(rid, prompt, max_tokens=4))
            while engine.has_unfinished():
                outs += engine.step()
        results[name] = {rid: ([t for o in outs if o.request_id == rid for t in o.new_token_ids],
                               next(o.num_cached_tokens for o in outs
                                    if o.request_id == rid and o.finished))
                         for rid in "abc"}
    full_prefix = (len(shared) - 1) // 4 * 4
    assert results["plain"]["c"][1] == 0  # without tiers the prefix was evicted
    assert results["tiered"]["c"][1] == full_prefix > 0
    for rid in "abc":
        assert results["tiered"][rid][0] == results["plain"][rid][0], rid
    assert results["tiered"]["c"][0] == results["tiered"]["a"][0]
    assert tiered.kv.num_restored_blocks == full_prefix // 4
    stats = tiered.kv.tier_stats()
    assert stats["host"].hits + stats["disk"].hits == full_prefix // 4
    assert stats["disk"].hits > 0  # a two-block host tier sent most of them down
    assert tiered.stats().prefix_hit_tokens == full_prefix
    tiered.close()
    assert os.listdir(tmp_path) == []


def test_the_worker_sections_take_the_tiers_and_refuse_a_disk_size_without_a_directory():
    from pydantic import ValidationError

    from splitserve.components.engines.torch_cpu.sections import TorchEngineArgs

    args = TorchEngineArgs(host_kv_cache_gib=0.5, disk_kv_cache_dir="/var/tmp/kv",
                           disk_kv_cache_gib=2)
    assert (args.host_kv_cache_gib, args.disk_kv_cache_gib) == (0.5, 2)
    with pytest.raises(ValidationError, match="disk_kv_cache_dir"):
        TorchEngineArgs(disk_kv_cache_gib=1)
    with pytest.raises(ValidationError, match="host_kv_cache_gib"):
        TorchEngineArgs(host_kv_cache_gib=-1)


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_restoring_measures_the_cost_of_a_block_per_tier(tmp_path, tiers) -> None:
    chain = make_tiers(tiers, str(tmp_path))
    kv = make_kv(4, chain)
    assert kv.restore_costs() == {}
    evict_prompt(kv)
    if tiers == "disk":
        chain.tiers[0].flush()  # read back from its file, not the write queue
    assert kv.open_sequence("c", PROMPT) == 8
    costs = kv.restore_costs()
    assert list(costs) == [tiers] and 0 < costs[tiers] < 1000.0
    kv.close()
