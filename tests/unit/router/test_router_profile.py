"""Profile composition: filter order, clamping, weights, normalisation, timing, explain."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import Field
from splitserve.components.router import (
    Decision,
    PluginKind,
    build_router,
    default_registry,
    format_decision,
    parse_router_config,
)

from splitserve.contracts.models import StrictModel

from .router_factories import config, request, router, snapshot, worker

pytestmark = pytest.mark.unit


class FixedParams(StrictModel):
    """Parameters of the test-only ``fixed`` scorer."""

    scores: dict[int, float] = Field(description="Score per worker id, returned as is.")


class FixedScorer:
    """Returns whatever it was configured with, out-of-range values included."""

    def __init__(self, params: FixedParams) -> None:
        self._scores = params.scores

    def score(self, request, snapshot, workers):
        return dict(self._scores)


def fixed_router(scorers: dict[str, tuple[dict[int, float], float | None]],
                 normalize: bool = False, picker: str = "max-score"):
    """A router whose profile holds 'fixed' scorers: name -> (scores, weight)."""
    registry = default_registry()
    registry.register("fixed", PluginKind.SCORER, FixedParams, FixedScorer)
    plugins = [{"name": name, "type": "fixed", "parameters": {"scores": scores}}
               for name, (scores, _) in scorers.items()]
    plugins.append({"name": "pick", "type": picker, "parameters": {"seed": 0}})
    refs = [{"pluginRef": name} | ({} if weight is None else {"weight": weight})
            for name, (_, weight) in scorers.items()]
    document = config(plugins, refs + [{"pluginRef": "pick"}], normalizeWeights=normalize)
    return build_router(parse_router_config(document, registry), registry)


WORKERS = snapshot(worker(1), worker(2), worker(3))

COMPOSITION = {
    "weights multiply and sum": (
        {"a": ({1: 1.0, 2: 0.0, 3: 0.5}, 2.0), "b": ({1: 0.0, 2: 1.0, 3: 0.5}, 1.0)}, False,
        {1: 2.0, 2: 1.0, 3: 1.5}, 1),
    "missing weight is 1": (
        {"a": ({1: 0.25, 2: 0.5, 3: 0.75}, None)}, False, {1: 0.25, 2: 0.5, 3: 0.75}, 3),
    "out-of-range scores are clamped": (
        {"a": ({1: 7.0, 2: -3.0, 3: 0.5}, 1.0)}, False, {1: 1.0, 2: 0.0, 3: 0.5}, 1),
    "NaN counts as zero": (
        {"a": ({1: math.nan, 2: 0.1, 3: 0.0}, 1.0)}, False, {1: 0.0, 2: 0.1, 3: 0.0}, 2),
    "missing worker counts as zero, strangers ignored": (
        {"a": ({2: 0.4, 99: 1.0}, 1.0)}, False, {1: 0.0, 2: 0.4, 3: 0.0}, 2),
    "normalised by total weight": (
        {"a": ({1: 1.0, 2: 0.0, 3: 0.5}, 3.0), "b": ({1: 0.0, 2: 1.0, 3: 0.5}, 1.0)}, True,
        {1: 0.75, 2: 0.25, 3: 0.5}, 1),
    "zero weight silences a scorer": (
        {"a": ({1: 1.0, 2: 0.0, 3: 0.0}, 0.0), "b": ({1: 0.0, 2: 0.0, 3: 1.0}, 1.0)}, True,
        {1: 0.0, 2: 0.0, 3: 1.0}, 3),
}


@pytest.mark.parametrize("case", COMPOSITION.values(), ids=COMPOSITION.keys())
def test_profile_composition(case):
    scorers, normalize, totals, chosen = case
    decision = fixed_router(scorers, normalize).route(request(), WORKERS)
    assert decision.totals == pytest.approx(totals)
    assert decision.worker_id == chosen
    assert decision.reason == "picked"
    for breakdown in decision.scorers:
        assert all(0.0 <= value <= 1.0 for value in breakdown.raw.values())


def test_decision_records_filters_scorers_and_timings():
    document = config(
        [{"name": "alive", "type": "healthy"},
         {"name": "room", "type": "kv-headroom", "parameters": {"max_kv_usage": 0.5}},
         {"name": "overlap", "type": "kv-overlap"}, {"name": "load", "type": "least-requests"},
         {"name": "pick", "type": "max-score", "parameters": {"tie_break": "lowest-id"}}],
        [{"pluginRef": "alive"}, {"pluginRef": "room"}, {"pluginRef": "overlap", "weight": 2},
         {"pluginRef": "load", "weight": 1}, {"pluginRef": "pick"}])
    snap = snapshot(worker(1, healthy=False), worker(2, kv_blocks_used=90),
                    worker(3, active_requests=4), worker(4, active_requests=2),
                    overlap={3: 10, 4: 5})
    decision = router(document).route(request(10), snap)
    assert decision.worker_id == 3                     # 2 x 1.0 + 0 ties 2 x 0.5 + 1; lowest id
    assert decision.candidates == (3, 4)
    assert [(r.plugin, r.worker_id) for r in decision.removed] == [("alive", 1), ("room", 2)]
    assert decision.totals == pytest.approx({3: 2.0, 4: 2.0})
    assert [b.plugin for b in decision.scorers] == ["overlap", "load"]
    assert decision.scorers[0].weighted == pytest.approx({3: 2.0, 4: 1.0})
    assert list(decision.elapsed_ns) == ["alive", "room", "overlap", "load", "pick"]
    assert all(ns >= 0 for ns in decision.elapsed_ns.values())


@pytest.mark.parametrize(("workers", "reason"), [
    ((), "no-workers"),
    ((worker(1, draining=True), worker(2, healthy=False)), "all-filtered"),
])
def test_no_worker_left(workers, reason):
    document = config([{"name": "alive", "type": "healthy"},
                       {"name": "pick", "type": "max-score"}],
                      [{"pluginRef": "alive"}, {"pluginRef": "pick"}])
    decision = router(document).route(request(), snapshot(*workers))
    assert (decision.worker_id, decision.reason, decision.candidates) == (None, reason, ())
    assert "pick" not in decision.elapsed_ns
    assert "chosen: none (" + reason + ")" in format_decision(decision)


def test_kv_headroom_waiver_is_noted_in_the_decision():
    document = config([{"name": "room", "type": "kv-headroom", "parameters": {"max_kv_usage": 0.5}},
                       {"name": "pick", "type": "max-score"}],
                      [{"pluginRef": "room"}, {"pluginRef": "pick"}])
    decision = router(document).route(request(), snapshot(worker(1, kv_blocks_used=90)))
    assert decision.worker_id == 1
    assert decision.notes == {"room": "all 1 workers above KV usage 0.5; kept all"}


def test_decision_json_round_trip_and_explain_text():
    decision = fixed_router({"a": ({1: 0.2, 2: 0.9, 3: 0.1}, 2.0)}).route(request(), WORKERS)
    as_json = json.loads(decision.to_json())
    assert as_json["worker_id"] == 2 and as_json["totals"]["2"] == pytest.approx(1.8)
    assert Decision.model_validate_json(decision.to_json()) == decision
    text = format_decision(decision)
    assert "a (w=2)" in text and "0.900 -> 1.800" in text and "chosen: 2 (picked)" in text


def test_same_seed_same_decisions():
    snap = snapshot(worker(1), worker(2), worker(3))
    runs = []
    for _ in range(2):
        rt = fixed_router({"a": ({1: 0.5, 2: 0.5, 3: 0.5}, 1.0)}, picker="weighted-random")
        runs.append([rt.route(request(), snap).worker_id for _ in range(30)])
    assert runs[0] == runs[1] and set(runs[0]) == {1, 2, 3}


def test_router_profile_selection():
    document = {
        "plugins": [{"name": "rr", "type": "round-robin"},
                    {"name": "load", "type": "least-requests"},
                    {"name": "pick", "type": "max-score",
                     "parameters": {"tie_break": "lowest-id"}}],
        "schedulingProfiles": [
            {"name": "spread", "plugins": [{"pluginRef": "rr"}, {"pluginRef": "pick"}]},
            {"name": "light", "plugins": [{"pluginRef": "load"}, {"pluginRef": "pick"}]}],
        "defaultProfile": "light",
    }
    rt = router(document)
    snap = snapshot(worker(1, active_requests=5), worker(2))
    assert rt.profile_names == ["spread", "light"]
    assert rt.route(request(), snap).profile == "light"
    assert rt.route(request(), snap, profile="spread").worker_id == 1
    with pytest.raises(KeyError):
        rt.route(request(), snap, profile="missing")


class WrongPicker:
    """Returns a worker that is not a candidate."""

    def __init__(self, params: StrictModel) -> None:
        pass

    def pick(self, scored):
        return max(scored) + 1


def test_picker_answer_outside_candidates_is_an_error():
    registry = default_registry()
    registry.register("wrong", PluginKind.PICKER, StrictModel, WrongPicker)
    document = config([{"name": "pick", "type": "wrong"}], [{"pluginRef": "pick"}])
    rt = build_router(parse_router_config(document, registry), registry)
    with pytest.raises(ValueError, match="not a candidate"):
        rt.route(request(), snapshot(worker(1)))
