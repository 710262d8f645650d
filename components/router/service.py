"""The router process's adapter: discovery, KV events, load reports → Router core.

Handles three endpoints: ``route`` (pick a worker, or with ``explain`` only describe the
choice without recording it), ``release`` (a request finished) and ``status`` (the workers
it would route to now: the frontend's readiness follows it).  A worker that a frontend
reports unreachable (a retried request's ``failed_workers``, or a release with outcome
``unreachable``) is marked down at once instead of waiting for its lease to expire.  Everything else is
the pure core: ``FleetState`` for bookkeeping and ``Router.route`` for the decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.contracts.block_events import LOWER_TIERS
from splitserve.contracts.metrics import PREFIX, latency_buckets
from splitserve.contracts.wire import (
    ProgressBatch,
    ProgressReport,
    ReleaseCall,
    RouteCall,
    RouteReply,
    RouterStatus,
    WorkerLoad,
)
from splitserve.components.router.qos import Estimate, Verdict
from splitserve.contracts import tracing

from .admission_queue import AdmissionQueue
from .hold_queue import HELD, HeldEntry, HoldQueue
from .qos.hold import HOLD_REASONS
from .core import Router
from .explain import trace_placement
from .fleet import FleetState
from .qos_gate import QosGate
from .service_config import RouterComponentConfig
from .tracker import RecentPrefixTracker
from .types import RouteRequest

log = logging.getLogger("splitserve.router")

LORA_NOT_LOADED = "lora-not-loaded"
"""The reason of a decision for an adapter that no live worker reports loaded."""


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.decisions = Counter(f"{PREFIX}_router_decisions_total",
                                 "Routing decisions by profile, worker and reason",
                                 ["profile", "worker", "reason"], registry=r)
        self.plugin_latency = Histogram(f"{PREFIX}_router_plugin_seconds",
                                        "Time spent in each router plugin per decision",
                                        ["plugin"], buckets=latency_buckets(), registry=r)
        self.route_latency = Histogram(f"{PREFIX}_router_route_seconds",
                                       "Time to build the snapshot and decide",
                                       buckets=latency_buckets(), registry=r)
        self.overlap_blocks = Counter(f"{PREFIX}_router_overlap_blocks_total",
                                      "Prefix blocks already cached on the chosen worker",
                                      registry=r)
        self.tier_hit_blocks = Counter(f"{PREFIX}_router_tier_hit_blocks_total",
                                       "Prefix blocks the index credits the chosen worker "
                                       "with, by the KV tier holding them", ["tier"],
                                       registry=r)
        self.released = Counter(f"{PREFIX}_router_released_total",
                                "Released requests by outcome", ["outcome"], registry=r)
        self.progress = Counter(f"{PREFIX}_router_progress_reports_total",
                                "First-token and decode-progress reports the frontends "
                                "sent (the progress endpoint), by kind: first_token, "
                                "progress; skipped: stale (from a worker the request is "
                                "no longer placed on) or late (the request was released "
                                "before its report came)", ["kind"], registry=r)
        self.marked_down = Counter(f"{PREFIX}_router_workers_marked_down_total",
                                   "Workers taken out of routing because a frontend could "
                                   "not reach them", registry=r)


class RouterService:
    """Keeps fleet state current and answers route/release calls."""

    def __init__(self, cfg: RouterComponentConfig, router: Router, worker_client,
                 indexer=None, metrics: RouterMetrics | None = None,
                 hash_blocks=None, worker_endpoint: str = "") -> None:
        self.worker_endpoint = worker_endpoint
        self.cfg = cfg
        self.router = router
        self.client = worker_client
        self.indexer = indexer
        self.fleet = FleetState(cfg.inflight_ttl_s, down_ttl_s=cfg.down_ttl_s)
        self.tracker = RecentPrefixTracker(ttl_s=cfg.recent_prefix_ttl_s)
        self.metrics = metrics or RouterMetrics()
        self.hash_blocks = hash_blocks or (lambda tokens, lora=None: [])
        """``hash_blocks(token_ids, lora)``: the prompt's prefix-block hashes, keyed by the
        LoRA adapter (None: the base model), as the workers' KV events key them."""
        self.qos = QosGate(cfg.qos, self.metrics.registry, inflight_ttl_s=cfg.inflight_ttl_s)
        self.admission = AdmissionQueue(cfg.qos.queue)
        self.held = HoldQueue()
        self._pump_soon: asyncio.Handle | None = None
        self._pump_timer: asyncio.TimerHandle | None = None
        self._pump_loop: asyncio.AbstractEventLoop | None = None
        self._pump_at = 0.0  # when the armed timer fires (time.monotonic)
        self._changes = 0
        """Counts what held requests wait for (first tokens, progress, releases): the
        head is judged again before its tick only when this moved since it was."""
        self.share = None
        """The sibling frontend processes' side (``share.PlacementShare``), when this
        service routes in a frontend process beside others; None otherwise."""

    def on_load(self, payload: bytes) -> None:
        """A WorkerLoad message from NATS."""
        try:
            self.fleet.report(WorkerLoad.model_validate_json(payload), time.monotonic())
        except ValueError as exc:
            log.debug("bad load report: %s", exc)

    def mark_down(self, worker_id: int, now: float) -> None:
        """A frontend could not reach ``worker_id``: route nothing more to it for now."""
        if worker_id in self.fleet.live and self.fleet.mark_down(worker_id, now):
            self.metrics.marked_down.inc()
            log.warning("worker %x unreachable: out of routing until seen alive again",
                        worker_id)

    def _refresh_live(self) -> None:
        live = self.client.instance_ids()
        self.fleet.set_live(live)
        if self.indexer is not None and hasattr(self.indexer, "sync_workers"):
            self.indexer.sync_workers(set(live))

    def status(self) -> RouterStatus:
        """The workers a request routed now could go to (read by frontends' readiness)."""
        self._refresh_live()
        return RouterStatus(workers=self.fleet.candidates(time.monotonic()),
                            endpoint=self.worker_endpoint)

    def _prefix_hits(self, hashes: list[int]) -> tuple[dict[int, int], dict | None, dict]:
        """The device prefix per worker, and (a tier-aware index only, else None) the
        per-tier and tier-weighted prefixes, from the index's one walk."""
        if self.indexer is None or not hashes:
            return {}, None, {}
        if hasattr(self.indexer, "prefix_hits"):
            return self.indexer.prefix_hits(hashes, self.cfg.tier_weights())
        return self.indexer.overlap(hashes), None, {}

    def _with_tiers(self, snapshot, tiers: dict | None, weighted: dict):
        """``snapshot`` with the prefix hit of each live worker per KV tier and weighed by
        tier (``host_cache_hit_weight``, ``disk_cache_hit_weight``; docs/kv_tiers.md), and
        the per-tier hits; unchanged (and {}) without a tier-aware index or a hit."""
        if not tiers:
            return snapshot, {}
        live = self.fleet.live
        by_tier = {w: n for w, n in tiers.items() if w in live}
        return snapshot.model_copy(update={
            "tier_overlap_blocks": by_tier,
            "weighted_overlap_blocks": {w: x for w, x in weighted.items() if w in live}}), by_tier

    def _cached_tokens(self, overlap: dict[int, int], by_tier: dict[int, dict[str, int]]
                       ) -> tuple[dict[int, int], dict[int, float]]:
        """Prompt tokens admission counts as not to be prefilled, per worker, and the
        time restoring the lower-tier ones takes there.  A prefix block a worker holds in
        host memory or on disk is priced at the restore cost that worker measured for
        that tier (``restore_ms_per_block`` in its tier events): not prefilled, but
        copied back first.  Until a worker has measured a tier, the tier's weight stands
        in (``Router.host_cache_hit_weight`` / ``disk_cache_hit_weight``: that share of
        the block counts as cached).  Either way a lower-tier hit is neither free nor a
        miss.  A device hit from Dynamo's tree larger than all this wins, restoring
        nothing."""
        bs = self.cfg.block_size
        cached = {w: n * bs for w, n in overlap.items()}
        restore: dict[int, float] = {}
        weights = self.cfg.tier_weights()
        measured = getattr(getattr(self.indexer, "tiers", None), "restore_ms", {})
        for w, counts in by_tier.items():
            costs = measured.get(w, {})
            blocks, ms = float(counts.get("device", 0)), 0.0
            for tier in LOWER_TIERS:
                n = counts.get(tier, 0)
                if n and tier in costs:
                    blocks += n
                    ms += n * costs[tier]
                elif n:
                    blocks += n * weights[tier]
            if blocks * bs > cached.get(w, 0):
                cached[w] = int(blocks * bs)
                if ms > 0:
                    restore[w] = ms
        return cached, restore

    def decide(self, call: RouteCall, admitted: Verdict | None = None,
               waited_ms: float = 0.0, holding: bool = False,
               hashes: list[int] | None = None) -> tuple[RouteReply, Any]:
        """Build the snapshot and run the core; records the placement unless explaining.

        ``admitted``: the verdict of a request that waited in the admission queue; it is
        not judged again (the queue's deadline already decided whether it still may run).
        ``waited_ms``: how long it has been held (``qos.hold``); ``holding``: a verdict
        that holds (``HOLD_REASONS``) answers ``HELD`` and records nothing; ``hashes``:
        the prompt's block hashes when known already (a held request is judged again and
        again).
        """
        now = time.monotonic()
        waited_ms += call.waited_ms  # in the frontend before it asked: the client waited
        self._refresh_live()
        for wid in call.failed_workers:
            self.mark_down(wid, now)
        self.fleet.expire(now)
        if hashes is None:
            hashes = self.hash_blocks(call.token_ids, call.lora)
        overlap, tiers, weighted = self._prefix_hits(hashes)
        recent = self.tracker.recent_blocks(hashes, now)
        record = call.record and not call.explain
        snapshot, by_tier = self._with_tiers(self.fleet.snapshot(now, overlap, recent),
                                             tiers, weighted)
        # Route first, then judge: admission predicts on the worker the policy picked
        # (its queue, its prefix hit, its batch) and may move the request to another
        # candidate that would meet the class's targets when the pick would not.
        request = RouteRequest(request_id=call.request_id, num_tokens=len(call.token_ids),
                               num_blocks=len(hashes), priority=self.qos.resolve(call).name,
                               block_hashes=tuple(hashes), lora=call.lora)
        decision = self.router.route(request, snapshot, self.cfg.profile)
        if by_tier:
            decision = decision.model_copy(update={"tier_hits": {
                w: by_tier[w] for w in decision.candidates if w in by_tier}})
        if decision.worker_id is None and call.lora is not None and not any(
                call.lora in w.loras for w in snapshot.workers):
            decision = decision.model_copy(update={"reason": LORA_NOT_LOADED})
        cached, restore = self._cached_tokens(overlap, by_tier)
        adm = self.qos.check(call, snapshot.workers, cached, now, record=False,
                             chosen=decision.worker_id,
                             candidates=decision.candidates if decision.worker_id else (),
                             waited_ms=waited_ms, holding=holding, restore_ms=restore)
        if holding and not adm.verdict.admit and adm.verdict.reason in HOLD_REASONS:
            return RouteReply(worker_id=None, reason=HELD, class_name=adm.verdict.class_name,
                              qos=adm.verdict.model_dump(mode="json")), None
        if admitted is not None:  # held in the admission queue: its verdict stands
            adm = replace(adm, verdict=admitted)
        ticket = None
        if record and decision.worker_id is not None:
            ticket = self.qos.record(call, adm, now)
        verdict = adm.verdict
        trace_placement(decision, adm, now, record)
        qos = verdict.model_dump(mode="json")
        if not verdict.admit:
            return RouteReply(worker_id=None, reason=f"rejected-{verdict.reason}",
                              class_name=verdict.class_name,
                              retry_after_s=verdict.retry_after_s, qos=qos), None
        if adm.rerouted:
            decision = decision.model_copy(update={"worker_id": adm.worker_id,
                                                   "reason": adm.why})
        wid = decision.worker_id
        if record:
            self._commit(call, decision, hashes, overlap.get(wid, 0) if wid else 0, now)
            if wid is not None and self.share is not None:
                self.share.placed(call.request_id, wid, hashes, adm.estimate, ticket)
        detail = decision.model_dump(mode="json") if call.explain else None
        # The class's level in this router's table travels with the request, so every
        # engine schedules by the QoS classes' order (a class a reload removed while the
        # request waited in the admission queue ranks as the default class).
        level = self.qos.config.priority_table().level_of(verdict.class_name)
        return RouteReply(worker_id=wid, reason=decision.reason, decision=detail,
                          endpoint=self.worker_endpoint, class_name=verdict.class_name,
                          class_level=level,
                          max_tokens=verdict.max_tokens if verdict.degrade else None,
                          prefill_locally=verdict.prefill_locally,
                          tpot_ms=self.qos.config.class_tpot_ms(verdict.class_name),
                          qos=qos), decision

    def _commit(self, call: RouteCall, decision, hashes: list[int], overlap_blocks: int,
                now: float) -> None:
        """Record a decision that takes effect: its metrics and, with a worker, the
        placement (in flight on it, its prefix recently sent there)."""
        wid = decision.worker_id
        self.metrics.route_latency.observe(time.monotonic() - now)
        for plugin, ns in decision.elapsed_ns.items():
            self.metrics.plugin_latency.labels(plugin).observe(ns / 1e9)
        self.metrics.decisions.labels(decision.profile, f"{wid:x}" if wid else "none",
                                      decision.reason).inc()
        if wid is not None:
            self.fleet.place(call.request_id, wid, now)
            self.tracker.record(wid, hashes, now)
            self.metrics.overlap_blocks.inc(overlap_blocks)
            for tier, blocks in (decision.tier_hits or {}).get(wid, {}).items():
                self.metrics.tier_hit_blocks.labels(tier).inc(blocks)

    async def route(self, request: dict, context=None):
        """Endpoint handler: one RouteReply."""
        try:
            call = RouteCall.model_validate(request)
        except ValueError as exc:
            yield RouteReply(worker_id=None, reason=f"bad-request: {exc}").model_dump()
            return
        with tracing.active(tracing.from_dynamo(context)):  # the caller's trace, if any
            reply = await self.place(call)
        yield reply.model_dump(mode="json")

    async def explain(self, request: dict, context=None):
        """Endpoint handler for ``dynamo route explain`` against a frontend that routes in
        its own process: ``route`` with explain forced on, so whatever the caller sends
        nothing is recorded, no admission slot is taken and no worker is placed on."""
        if isinstance(request, dict):
            request = {**request, "explain": True, "record": False}
        async for reply in self.route(request, context):  # anything else: bad-request
            yield reply

    async def place(self, call: RouteCall) -> RouteReply:
        """Admit (waiting in the admission queue when it is on) and route one request.

        Called by the ``route`` endpoint and, with ``Frontend.routing: in_process``, by the
        frontend directly.  Returns the reply: a worker, or why none / a rejection."""
        if self._holds(call):
            return await self._place_or_hold(call)
        shed, admitted = await self._wait_for_slot(call)
        if shed is not None:
            return shed
        try:
            reply, _ = self.decide(call, admitted)
        finally:
            if admitted is not None:  # it held a slot: hand it on if it was not used
                self.admission.placed_one()
                now = time.monotonic()
                self.admission.dispatch(now, len(self.fleet.placed),
                                        len(self.fleet.candidates(now)))
        return reply

    def _holds(self, call: RouteCall) -> bool:
        """Whether ``call`` may be held (``qos.hold``) instead of refused for its batch."""
        qos = self.qos.config
        return (qos.hold.enabled and qos.mode == "enforce" and call.record
                and not call.explain and not self.admission.enabled)

    async def _place_or_hold(self, call: RouteCall) -> RouteReply:
        """Place ``call`` now, refuse it now, or hold it until its workers' batches let
        it in or its slack is spent (``qos.hold``).  The requests already held are judged
        first; one that would wait longer than its slack for the batches ahead to drain
        is refused at once (Retry-After: its worker's predicted drain)."""
        hold = self.qos.config.hold
        if len(self.held):
            self._pump()
        now = time.monotonic()
        hashes = self.hash_blocks(call.token_ids, call.lora)
        reply, _ = self.decide(call, holding=True, hashes=hashes)
        if reply.reason != HELD:
            return reply
        verdict = reply.qos or {}
        reason = verdict.get("reason") or HELD
        cls = self.qos.config.class_named(reply.class_name or "")
        target_s = (cls.ttft_ms if cls is not None else 0.0) / 1000.0
        slack_s = self._slack_s(verdict, target_s)
        rate = self.qos.predictor.completion_rate()
        drain_s = (len(self.held) + 1) / rate if rate else None
        if len(self.held) >= hold.max_held or slack_s <= 0 or (
                reason == "tpot-slo-risk" and drain_s is not None and drain_s > slack_s):
            return self._end_hold(call, reply, 0.0, hashes)  # at once: refused, or placed
        entry = self.held.push(call, now, deadline=now + target_s,
                               expires=now + min(hold.max_wait_s, slack_s), reason=reason,
                               hashes=hashes, judged_after=self._changes)
        self.qos.metrics.holding.set(len(self.held))
        self._pump()
        return await entry.future

    def _slack_s(self, verdict: dict, target_s: float) -> float:
        """How much longer a held request may wait and still meet its TTFT limit: its
        limit less its prediction (the wait so far included) and a tick; half its target
        while the TTFT fit is a guess (no limit judged)."""
        if verdict.get("limit_ms") is None or verdict.get("est_ttft_ms") is None:
            return target_s / 2
        return (verdict["limit_ms"] - verdict["est_ttft_ms"]) / 1000.0 \
            - self.qos.config.hold.tick_s

    def _judge_held(self, entry: HeldEntry, now: float, final: bool):
        """The head of the held requests: its reply, or HELD.  When its hold has ended
        it is placed or refused by what it is still held for (``HOLD_REASONS``).

        A head judged less than a tick ago, with nothing it waits for changed since,
        stays held unjudged: arrivals pump the queue (the held go first), and under
        overload they come far more often than what lets a held request in.  Time
        alone (its wait, the decay of the workers' busy share) is judged every tick."""
        if (not final and entry.judged_after == self._changes
                and now - entry.judged_at < self.qos.config.hold.tick_s - 1e-3):
            self.qos.metrics.hold_judgments.labels("unchanged").inc()
            return HELD
        self.qos.metrics.hold_judgments.labels("judged").inc()
        entry.judged_at, entry.judged_after = now, self._changes
        # A hold that ended is judged as of its end (a tick may come a little later).
        waited_ms = ((min(now, entry.expires) if final else now) - entry.arrival) * 1000.0
        reply, _ = self.decide(entry.call, waited_ms=waited_ms, holding=True,
                               hashes=entry.hashes)
        if reply.reason != HELD:
            return reply
        if final:
            return self._end_hold(entry.call, reply, waited_ms, entry.hashes)
        slack_s = self._slack_s(reply.qos or {}, entry.deadline - entry.arrival)
        entry.expires = min(entry.expires, now + max(0.0, slack_s))
        return HELD

    def _end_hold(self, call: RouteCall, held: RouteReply, waited_ms: float,
                  hashes: list[int] | None = None) -> RouteReply:
        """A request that is not held (any more) although its verdict ``held`` would hold
        it: placed as without holding when a guess held it ('place'), else refused with
        that verdict's reason and Retry-After (the answers running came first)."""
        verdict = held.qos or {}
        reason = verdict.get("reason") or HELD
        if HOLD_REASONS.get(reason) == "place":
            return self.decide(call, waited_ms=waited_ms, hashes=hashes)[0]
        cls = held.class_name or self.qos.resolve(call).name
        self.qos.refused(cls, reason)
        return RouteReply(worker_id=None, reason=f"rejected-{reason}", class_name=cls,
                          retry_after_s=verdict.get("retry_after_s") or 1,
                          qos={**verdict, "admit": False})

    def _hold_ended(self, entry: HeldEntry, outcome: str, now: float) -> None:
        if outcome == "answered":
            reply = entry.future.result()
            outcome = "placed" if reply.worker_id is not None else "refused"
        elif outcome == "failed":
            log.error("judging held request %s failed: %s", entry.call.request_id,
                      entry.future.exception())
        cls = self.qos.resolve(entry.call).name
        self.qos.metrics.held.labels(cls, entry.reason, outcome).inc()
        self.qos.metrics.hold_seconds.labels(outcome).observe(now - entry.arrival)

    def _pump(self) -> None:
        """Judge the held requests again now, and on time alone while any is held: the
        head ``tick_s`` after its last judgement (first tokens and releases judge it
        far more often under load), and when its hold ends."""
        self._pump_soon = None
        if len(self.held):
            self.held.pump(time.monotonic(), self._judge_held, self._hold_ended)
            self.qos.metrics.holding.set(len(self.held))
        loop = asyncio.get_running_loop()
        timer = self._pump_timer
        due = self.held.next_due(self.qos.config.hold.tick_s)
        if due is None:
            if timer is not None:
                timer.cancel()
                self._pump_timer = None
            return
        if timer is not None and self._pump_loop is loop and self._pump_at <= due + 1e-3:
            return  # armed soon enough
        if timer is not None:
            timer.cancel()

        def tick() -> None:
            self._pump_timer = None
            self._pump()
        self._pump_loop = loop
        self._pump_at = due
        # (uvloop answers a delay of 0 with a plain handle, which has no ``when``.)
        self._pump_timer = loop.call_later(max(0.0, due - time.monotonic()), tick)

    def _wake_held(self) -> None:
        """Something held requests wait for changed: judge them again soon (coalesced)."""
        self._changes += 1
        if not len(self.held):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous caller: the next tick will do
            return
        if self._pump_soon is None or self._pump_loop is not loop:
            self._pump_loop = loop
            self._pump_soon = loop.call_soon(self._pump)

    async def _wait_for_slot(self, call: RouteCall
                             ) -> tuple[RouteReply | None, Verdict | None]:
        """With the admission queue on (``qos.queue``), hold an admitted request until a
        worker has a slot.  Returns (the rejection, None) if it was shed, (None, its
        verdict) once it holds a slot, (None, None) when the queue does not apply."""
        self.admission.reconfigure(self.qos.config.queue)
        if (not self.admission.enabled or call.explain or not call.record
                or self.qos.config.mode == "shadow"):  # shadow mode never holds
            return None, None
        now = time.monotonic()
        self._refresh_live()
        workers = self.fleet.workers(now)
        routable = len(self.fleet.candidates(now))
        # Requests it would wait behind: those queued, plus one release when every slot
        # is taken.
        held = len(self.admission.queue) + (
            self.admission.free_slots(len(self.fleet.placed), routable) <= 0)
        verdict = self.qos.check(call, workers, {}, now, record=False, held=held,
                                 slots=self.admission.config.max_inflight_per_worker
                                 * max(1, routable), waited_ms=call.waited_ms).verdict
        if not verdict.admit:
            return None, None  # decide() judges it again, rejects it and records why
        cls = self.qos.config.class_named(verdict.class_name)
        sheddable = (cls is not None and cls.may_reject
                     and self.qos.config.enable_early_rejection)
        deadline = now + (cls.ttft_ms / 1000.0 if cls is not None else 0.0)
        outcome = await self.admission.wait(deadline, sheddable, now, len(self.fleet.placed),
                                            len(self.fleet.candidates(now)))
        if outcome == "go":
            return None, verdict
        reason = "deadline-passed" if outcome == "doomed" else "queue-full"
        self.qos.refused(verdict.class_name, reason)
        return RouteReply(worker_id=None, reason=f"rejected-{reason}",
                          class_name=verdict.class_name, retry_after_s=1,
                          qos={"admit": False, "reason": reason,
                               "class_name": verdict.class_name}), None

    async def release(self, request: dict, context=None):
        """Endpoint handler: forget a placement."""
        try:
            call = ReleaseCall.model_validate(request)
        except ValueError as exc:
            yield {"ok": False, "error": str(exc)}
            return
        self.complete(call)
        yield {"ok": True}

    def complete(self, call: ReleaseCall) -> None:
        """A placed request is over: free its slot, learn from it, and mark its worker
        down if it was unreachable.  Called by the ``release`` endpoint and, in process,
        by the frontend."""
        if self.share is not None:
            self.share.released(call)
        stale = self.fleet.placed_elsewhere(call.request_id, call.worker_id)
        self._free(call, time.monotonic())
        self.metrics.released.labels(call.outcome).inc()
        if not stale:  # a stale one would finish the new placement's ticket
            self.qos.observe(call, time.monotonic())

    def _free(self, call: ReleaseCall, now: float) -> None:
        """A request's load leaves its worker (this process's or a sibling's): its
        admission slot goes to the next, held requests are judged again, and a worker
        the request could not reach is marked down."""
        self.fleet.release(call.request_id, call.worker_id)
        self.admission.dispatch(now, len(self.fleet.placed), len(self.fleet.candidates(now)))
        self._wake_held()
        if call.outcome == "unreachable":
            self._refresh_live()
            self.mark_down(call.worker_id, now)

    def first_token(self, request_id: str) -> None:
        """A placed request's first token reached the frontend: called in process by the
        frontend (a Router process gets the frontends' reports in batches:
        ``apply_progress``)."""
        self.qos.first_token(request_id, time.monotonic())
        if self.share is not None:
            self.share.first_token(request_id)
        self._wake_held()

    def decode_progress(self, request_id: str, tokens: int, wake: bool = True) -> None:
        """A placed request has streamed ``tokens`` output tokens: called in process by
        the frontend every few tokens, so TPOT is learned before long answers end and
        the answers' measured pace is known; ``wake``: judge the held requests again
        now."""
        self.qos.decode_progress(request_id, tokens, time.monotonic())
        if self.share is not None:
            self.share.progress(request_id, tokens)
        if wake:
            self._wake_held()

    async def progress(self, request: dict, context=None):
        """Endpoint handler: a frontend's batch of first tokens and decode progress of
        requests this router placed (``ProgressBatch``)."""
        try:
            batch = ProgressBatch.model_validate(request)
        except ValueError as exc:
            yield {"ok": False, "error": str(exc)}
            return
        yield {"ok": True, "applied": self.apply_progress(batch.reports, time.monotonic())}

    def apply_progress(self, reports: Sequence[ProgressReport], now: float) -> int:
        """Apply a batch of reports received at ``now``, each dated ``now`` less its age;
        one from a worker its request is no longer placed on (it migrated), or one for a
        request already released, is skipped.  Returns how many were applied."""
        applied = 0
        wake = False
        counts = self.metrics.progress
        for r in reports:
            if r.request_id not in self.fleet.placed:
                counts.labels("late").inc()
                continue
            if self.fleet.placed_elsewhere(r.request_id, r.worker_id):
                counts.labels("stale").inc()
                continue
            at = now - r.age_s
            if r.first_token:
                self.qos.first_token(r.request_id, at)
                counts.labels("first_token").inc()
                if self.share is not None:
                    self.share.first_token(r.request_id)
            if r.progress:
                self.qos.decode_progress(r.request_id, r.tokens, at)
                counts.labels("progress").inc()
                if self.share is not None:
                    self.share.progress(r.request_id, r.tokens)
            wake = wake or r.first_token or r.wake
            applied += 1
        if wake:
            self._wake_held()
        return applied

    # -- a sibling frontend process's requests (``share.PlacementShare``) ---------------

    def adopt(self, request_id: str, worker_id: int, hashes: Sequence[int],
              estimate: dict | None, ticket: dict | None, now: float) -> bool:
        """Follow a request a sibling frontend process placed on ``worker_id``: in flight
        there, its prefix recently sent there, and (``ticket``) followed by admission
        like one's own, though never counted in this process's verdicts.  False when it
        is followed already (sent again to a sibling that started)."""
        placed = self.fleet.placed.get(request_id)
        if placed is not None and placed.worker_id == worker_id:
            return False
        self.fleet.place(request_id, worker_id, now)
        if hashes:
            self.tracker.record(worker_id, list(hashes), now)
        if ticket is not None and estimate is not None:
            self.qos.predictor.place(request_id, f"{worker_id:x}",
                                     Estimate.model_validate(estimate), now, **ticket)
        return True

    def _follows(self, request_id: str, worker_id: int) -> bool:
        return (request_id in self.fleet.placed
                and not self.fleet.placed_elsewhere(request_id, worker_id))

    def adopt_first(self, request_id: str, worker_id: int, now: float) -> bool:
        """A sibling's request got its first token (its prompt left the queue)."""
        if not self._follows(request_id, worker_id):
            return False
        self.qos.first_token(request_id, now)
        self._wake_held()
        return True

    def adopt_progress(self, request_id: str, worker_id: int, tokens: int,
                       now: float) -> bool:
        """A sibling's request has streamed ``tokens`` output tokens."""
        if not self._follows(request_id, worker_id):
            return False
        self.qos.decode_progress(request_id, tokens, now)
        return True

    def adopt_release(self, call: ReleaseCall, now: float) -> bool:
        """A sibling's request is over: its load leaves the worker and its timings teach
        the fits (this process's calibration counts only its own)."""
        if not self._follows(call.request_id, call.worker_id):
            return False
        self._free(call, now)
        self.qos.predictor.finish(call.request_id, now, ok=call.outcome == "ok",
                                  ttft_s=call.ttft_s, duration_s=call.duration_s,
                                  output_tokens=call.output_tokens)
        return True

    def drop_foreign(self, request_ids, now: float) -> int:
        """Forget a gone sibling's requests (``request_ids``); returns how many were
        still followed."""
        dropped = 0
        for rid in request_ids:
            if self.fleet.release(rid) is not None:
                dropped += 1
                self.qos.predictor.finish(rid, now, ok=False, ttft_s=None,
                                          duration_s=None, output_tokens=0)
        if dropped:
            self._wake_held()
        return dropped

    async def status_handler(self, request: dict, context=None):
        """Endpoint handler: one RouterStatus."""
        yield self.status().model_dump(mode="json")


async def watch_loads(nats_url: str, subject: str, service: RouterService,
                      stopping: asyncio.Event) -> None:
    """Subscribe to WorkerLoad reports until stopping; reconnects are nats-py's job."""
    from splitserve.contracts.kit.connect import close_nats, connect_nats

    nc = await connect_nats(nats_url, name="splitserve-router", max_reconnect_attempts=-1)

    async def on_msg(msg) -> None:
        service.on_load(msg.data)

    await nc.subscribe(subject, cb=on_msg)
    try:
        await stopping.wait()
    finally:
        await close_nats(nc, "load-report")
