"""Config validation, overrides and the process plan."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from splitserve.contracts.config import ConfigError, apply_overrides, parse_override
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import load_plan

pytestmark = pytest.mark.unit

GRAPH = "tests.fixtures.echo_graph:EchoFront"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def plan_for(tmp_path, text, overrides=None):
    g = load_graph(GRAPH)
    return load_plan(g, GRAPH, write(tmp_path, text), overrides, g.defined)


def test_good_config_resolves_sections_and_defaults(tmp_path):
    plan = plan_for(tmp_path, """
        Common: {namespace: test-ns}
        EchoWorker: {replicas: 2, pieces: 4, env: {A: "1"}}
        """)
    assert plan.common.namespace == "test-ns"
    w = plan.component("EchoWorker")
    assert (w.replicas, w.config.pieces, w.config.env) == (2, 4, {"A": "1"})
    assert plan.component("EchoFront").replicas == 1
    assert [c.name for c in plan.components] == ["EchoWorker", "EchoFront"]


@pytest.mark.parametrize("text, expected", [
    ("EchoWorker: {replicas: -1}\n", "EchoWorker.replicas: Input should be greater than or equal to 0"),
    ("EchoWorker: {pices: 3}\n", "EchoWorker.pices: Extra inputs are not permitted"),
    ("EchoFrnt: {}\n", "EchoFrnt: unknown section"),
    ("Common: {namespace: Bad Name}\n", "Common.namespace: String should match pattern"),
    ("Common: {restart: {max_restarts: x}}\n", "Common.restart.max_restarts: Input should be a valid integer"),
    ("EchoWorker: [1, 2]\n", "EchoWorker: must be a mapping"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("EchoWorker: {replicas: 1\n", "not valid YAML: line 2, column 1: expected ',' or '}'"),
    ("EchoWorker: [1, 2\n", "(while parsing a flow sequence at line 1, column 13)"),
    ("EchoWorker:\n\treplicas: 1\n", "line 2, column 1: found character '\\t'"),
])
def test_bad_config_names_file_and_field(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        plan_for(tmp_path, text)
    msg = str(info.value)
    assert str(tmp_path / "cfg.yaml") in msg
    assert expected in msg
    assert "<unicode string>" not in msg  # where in the file, not PyYAML's name for it


def test_all_errors_reported_together(tmp_path):
    with pytest.raises(ConfigError) as info:
        plan_for(tmp_path, "EchoWorker: {replicas: -1, pieces: 0}\nEchoFront: {port: 99999}\n")
    assert len(info.value.errors) == 3


def test_missing_file_is_a_config_error(tmp_path):
    g = load_graph(GRAPH)
    with pytest.raises(ConfigError, match="file not found"):
        load_plan(g, GRAPH, tmp_path / "nope.yaml", None, g.defined)


def test_section_of_pruned_component_is_accepted_and_ignored(tmp_path):
    plan = plan_for(tmp_path, "Unused: {replicas: 3}\n")
    assert plan.ignored_sections == ["Unused"]
    assert "Unused" not in [c.name for c in plan.components]


@pytest.mark.parametrize("arg, parts, value", [
    ("--EchoWorker.replicas=2", ["EchoWorker", "replicas"], 2),
    ("--Common.namespace=abc", ["Common", "namespace"], "abc"),
    ("--EchoWorker.env.X=1.5", ["EchoWorker", "env", "X"], 1.5),
    ("--A.b=[1, 2]", ["A", "b"], [1, 2]),
    ("--A.b=true", ["A", "b"], True),
])
def test_parse_override(arg, parts, value):
    assert parse_override(arg) == (parts, value)


@pytest.mark.parametrize("arg", ["EchoWorker.replicas=2", "--replicas=2", "--A.=1", "--A.b"])
def test_bad_override(arg):
    with pytest.raises(ValueError):
        parse_override(arg)


def test_overrides_apply_over_file_and_are_validated(tmp_path):
    plan = plan_for(tmp_path, "EchoWorker: {replicas: 1}\n", ["--EchoWorker.replicas=3"])
    assert plan.component("EchoWorker").replicas == 3
    with pytest.raises(ConfigError, match="EchoWorker.replicas"):
        plan_for(tmp_path, "EchoWorker: {}\n", ["--EchoWorker.replicas=many"])


def test_apply_overrides_does_not_mutate_input():
    raw = {"EchoWorker": {"replicas": 1}}
    out = apply_overrides(raw, ["--EchoWorker.replicas=2"])
    assert raw["EchoWorker"]["replicas"] == 1 and out["EchoWorker"]["replicas"] == 2


def test_plan_argv_and_run_config(tmp_path):
    plan = plan_for(tmp_path, "EchoWorker: {pieces: 5}\n")
    comp = plan.component("EchoFront")
    argv = plan.argv(comp, tmp_path / "c.json")
    assert argv[1:3] == ["-m", "tests.fixtures.echo_front"]
    rc = plan.run_config(comp, 0, tmp_path / "s.json")
    assert rc.links == ["EchoWorker"] and rc.component == "EchoFront"
    assert plan.to_dict()["components"][0]["config"]["pieces"] == 5
