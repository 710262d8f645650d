"""The torch engine's KV offload tiers on a worker's /metrics.

A collector, read at each scrape: every figure comes from the tiers' own counters
(``TierStats``) and the cache manager's, so nothing is counted twice and the engine's
thread never waits for Prometheus.  Names are documented in docs/kv_tiers.md.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from splitserve.contracts.metrics import PREFIX

from .kv_tiers import LATENCY_BUCKETS_S

NAME = f"{PREFIX}_worker_kv_tier"


class TierMetrics(Collector):
    """Per-tier occupancy, hits, write-backs, restores and latencies of one engine's
    tiers; ``publisher`` (a ``TierEventPublisher``, or None) adds its message counts."""

    def __init__(self, kv, publisher=None) -> None:
        self.kv = kv
        self.publisher = publisher

    def collect(self) -> Iterator:
        stats = dict(self.kv.tier_stats())
        capacity = self.kv.tier_capacity_blocks()
        nbytes = self.kv.block_nbytes

        def family(kind, suffix: str, doc: str, value, labels=("tier",)):
            fam = kind(f"{NAME}_{suffix}", doc, labels=list(labels))
            for tier, s in stats.items():
                fam.add_metric([tier], value(tier, s))
            return fam

        yield family(GaugeMetricFamily, "blocks", "KV blocks held in each offload tier",
                     lambda t, s: s.bytes_used // nbytes)
        yield family(GaugeMetricFamily, "bytes", "Bytes held in each offload tier",
                     lambda t, s: s.bytes_used)
        yield family(GaugeMetricFamily, "capacity_blocks",
                     "KV blocks each offload tier can hold", lambda t, s: capacity.get(t, 0))
        yield family(GaugeMetricFamily, "capacity_bytes",
                     "Bytes each offload tier can hold", lambda t, s: capacity.get(t, 0) * nbytes)
        yield family(CounterMetricFamily, "hits", "Prefix blocks found in the tier and "
                     "restored into the pool", lambda t, s: s.hits)
        yield family(CounterMetricFamily, "misses", "Prefix blocks looked up in the tier "
                     "and not found there", lambda t, s: s.misses)
        yield family(CounterMetricFamily, "writes", "Blocks written back into the tier "
                     "(for disk: files completed)", lambda t, s: s.writes)
        yield family(CounterMetricFamily, "evictions", "Blocks the tier pushed out to make "
                     "room (to the next tier, or dropped)", lambda t, s: s.evictions)
        yield family(CounterMetricFamily, "errors", "Disk writes or reads that failed "
                     "(the block is dropped)", lambda t, s: s.errors)
        yield family(CounterMetricFamily, "read_bytes", "Bytes read back from the tier",
                     lambda t, s: s.bytes_read)
        yield family(CounterMetricFamily, "written_bytes", "Bytes written into the tier",
                     lambda t, s: s.bytes_written)
        moves = CounterMetricFamily(f"{NAME}_moved_blocks", "Blocks moved between the "
                                    "pool and the tiers: offloaded on eviction, restored "
                                    "on a prefix hit", labels=["direction"])
        moves.add_metric(["offloaded"], self.kv.num_offloaded_blocks)
        moves.add_metric(["restored"], self.kv.num_restored_blocks)
        yield moves
        for op, doc in (("write", "Time to write one block into the tier (a copy into "
                                  "host memory, a file on disk)"),
                        ("read", "Time to read one block back from the tier")):
            hist = HistogramMetricFamily(f"{NAME}_{op}_seconds", doc, labels=["tier"])
            for tier, s in stats.items():
                counts = list(getattr(s, f"{op}_buckets"))
                bounds = [*(str(b) for b in LATENCY_BUCKETS_S), "+Inf"]
                hist.add_metric([tier], list(zip(bounds, counts, strict=True)),
                                getattr(s, f"{op}_seconds"))
            yield hist
        if self.publisher is not None:
            sent = CounterMetricFamily(f"{NAME}_event_messages", "Lower-tier KV event "
                                       "messages sent to the routers, by outcome",
                                       labels=["outcome"])
            sent.add_metric(["published"], self.publisher.published)
            sent.add_metric(["failed"], self.publisher.failures)
            yield sent
