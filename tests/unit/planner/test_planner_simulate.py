"""The simulator: a synthetic burst, the first minutes of the real traces, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splitserve.cli.main import app
from splitserve.planner import Move, Scale
from splitserve.planner.fleet import FleetModel
from splitserve.planner.simulate import render_table, simulate
from splitserve.planner.traces import load_trace

from .planner_factories import policy, pool
from .test_planner_loop import budget_fleet, budget_policy, burst_trace

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
TRACES = REPO.parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_fast25_conversation_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_code.csv"


def test_burst_scales_prefill_up_then_down():
    p = policy(prefill=pool(min_replicas=1, max_replicas=8,
                            up={"queue_length": 4, "gpu_utilization": 85},
                            down={"queue_length": 1, "gpu_utilization": 40}),
               cooldown={"scale_up_s": 20, "scale_down_s": 40},
               hysteresis={"scale_up_intervals": 1, "scale_down_intervals": 2})
    sim = simulate(burst_trace(), p, FleetModel(prefill_tokens_per_s=12000, startup_s=10),
                   interval_s=10)
    ups = [(o.time_s, a) for o, d in zip(sim.observations, sim.decisions, strict=True)
           for a in d.changes() if isinstance(a, Scale) and a.delta > 0]
    downs = [(o.time_s, a) for o, d in zip(sim.observations, sim.decisions, strict=True)
             for a in d.changes() if isinstance(a, Scale) and a.delta < 0]
    assert ups and 60 < ups[0][0] <= 90          # reacts within the burst's first intervals
    assert downs and downs[0][0] > 180           # and shrinks only after it
    peak = max(o.prefill.replicas for o in sim.observations)
    assert 3 <= peak <= 8 and sim.observations[-1].prefill.replicas < peak
    summary = sim.summary()
    assert summary["scale_up"] == len(ups) and summary["prefill_replicas"]["max"] == peak


def test_budget_policy_moves_between_roles():
    sim = simulate(burst_trace(), budget_policy(), budget_fleet(), interval_s=10)
    moves = [a for d in sim.decisions for a in d.changes() if isinstance(a, Move)]
    assert moves and moves[0].source == "decode" and moves[0].dest == "prefill"
    for o in sim.observations:  # never over the 6-GPU budget
        assert o.prefill.replicas + o.decode.replicas <= 6


def test_table_lists_actions_with_reasons():
    sim = simulate(burst_trace(), budget_policy(), budget_fleet(), interval_s=10,
                   duration_s=120)
    table = render_table(sim, changes_only=True)
    header, rule, *lines = table.splitlines()
    assert header.split()[:3] == ["t(s)", "P", "rep"] and set(rule) == {"-"}
    assert lines and all("->" in line for line in lines)
    assert len(render_table(sim).splitlines()) == 2 + 12


@pytest.mark.parametrize("path", [MOONCAKE, AZURE], ids=["mooncake", "azure"])
def test_first_minutes_of_a_real_trace(path):
    if not path.exists():
        pytest.skip(f"trace not present: {path.name}")
    requests = load_trace(path, duration_s=300)
    assert requests and requests[0].arrival_s == 0 and requests[-1].arrival_s < 300
    p = policy(seed=True, hysteresis={"scale_up_intervals": 1, "scale_down_intervals": 3})
    sim = simulate(requests, p, FleetModel(), interval_s=10, duration_s=300)
    assert len(sim.decisions) == 30
    for o in sim.observations:
        assert 4 <= o.prefill.replicas <= 12 and 8 <= o.decode.replicas <= 24


def test_trace_formats_and_window(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"timestamp": 1000, "input_length": 10, "output_length": 2, '
                     '"hash_ids": [0]}\n{"timestamp": 4000, "input_length": 20, '
                     '"output_length": 3, "hash_ids": [0]}\n')
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.4799600,31,8\n")
    assert [(r.arrival_s, r.input_tokens) for r in load_trace(jsonl)] == [(0, 10), (3, 20)]
    assert [r.arrival_s for r in load_trace(jsonl, start_s=1)] == [2.0]
    assert [r.arrival_s for r in load_trace(csv)] == pytest.approx([0.0, 1.5])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a Mooncake trace row"):
        load_trace(bad)


def test_cli_simulate_json_and_table(tmp_path):
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": int(r.arrival_s * 1000),
                                         "input_length": r.input_tokens,
                                         "output_length": r.output_tokens, "hash_ids": []})
                             + "\n" for r in burst_trace()))
    pol = REPO / "configs" / "planner" / "budget.yaml"
    fleet = REPO / "configs" / "planner" / "fleet.yaml"
    runner = CliRunner()
    out = runner.invoke(app, ["planner", "simulate", "--trace", str(trace), "--policy",
                              str(pol), "--fleet", str(fleet), "--interval-s", "10", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert len(doc["rows"]) == 42 and doc["summary"]["intervals"] == 42
    assert {"time_s", "observation", "actions"} <= set(doc["rows"][0])
    out = runner.invoke(app, ["planner", "simulate", "--trace", str(trace), "--policy",
                              str(pol), "--changes-only"])
    assert out.exit_code == 0 and "intervals of 10s" in out.output
    out = runner.invoke(app, ["planner", "simulate", "--trace", str(trace), "--policy",
                              str(tmp_path / "missing.yaml")])
    assert out.exit_code == 1 and "cannot read" in out.output
