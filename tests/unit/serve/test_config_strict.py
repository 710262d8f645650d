"""Config problems that must stop `dynamo serve` before anything starts (exit 2)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splitserve.cli.main import app
from splitserve.contracts.config import CommonConfig, ConfigError, read_yaml
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import load_plan

pytestmark = pytest.mark.unit

GRAPH = "tests.fixtures.echo_graph:EchoFront"
DISAGG = "graphs.disagg:Frontend"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def dry_run(*args: str):
    return CliRunner().invoke(app, ["serve", *args, "--dry-run"])


def test_duplicate_keys_are_refused_with_file_and_lines(tmp_path):
    p = write(tmp_path, """
        Common:
          namespace: a
        EchoWorker: {replicas: 1}
        Common:
          namespace: b
        """)
    with pytest.raises(ConfigError) as exc:
        read_yaml(p)
    assert exc.value.source == str(p)
    assert "key 'Common' given twice (lines 2 and 5)" in str(exc.value)


def test_duplicate_nested_keys_are_refused(tmp_path):
    p = write(tmp_path, """
        EchoWorker:
          replicas: 1
          replicas: 3
        """)
    with pytest.raises(ConfigError, match="key 'replicas' given twice"):
        read_yaml(p)


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match="file is empty") as exc:
        read_yaml(p)
    assert exc.value.source == str(p)


@pytest.mark.parametrize("host,ok", [("127.0.0.1", True), ("::1", True), ("10.1.2.3", True),
                                     ("0.0.0.0", False), ("::", False), ("localhost", False),
                                     ("10.1.2", False)])
def test_bind_host_must_be_a_specific_address(host, ok):
    if ok:
        assert CommonConfig(bind_host=host).bind_host == host
    else:
        with pytest.raises(ValueError, match="bind_host"):
            CommonConfig(bind_host=host)


def test_bind_host_defaults_to_loopback():
    assert CommonConfig().bind_host == "127.0.0.1"


def test_a_missing_router_policy_file_fails_the_plan(tmp_path):
    g = load_graph(DISAGG)
    cfg = write(tmp_path, "Router: {policy: /missing/policy.yaml}\n")
    with pytest.raises(ConfigError) as exc:
        load_plan(g, DISAGG, cfg, [], g.defined)
    assert exc.value.source == str(cfg)
    assert any(e.startswith("Router.policy: '/missing/policy.yaml'") for e in exc.value.errors)


def test_an_invalid_router_policy_file_fails_the_plan(tmp_path):
    bad = write(tmp_path, "plugins: [{name: x, type: no-such-plugin}]\n", "router.yaml")
    g = load_graph(DISAGG)
    with pytest.raises(ConfigError) as exc:
        load_plan(g, DISAGG, None, [f"--Router.policy={bad}"], g.defined)
    assert any(e.startswith("Router.policy:") and str(bad) in e for e in exc.value.errors)


def test_built_in_router_policies_still_pass(tmp_path):
    g = load_graph(DISAGG)
    plan = load_plan(g, DISAGG, Path("configs/disagg.yaml"),
                     ["--Router.policy=kv_aware", "--Frontend.port=0"], g.defined)
    assert plan.component("Router").config.policy == "kv_aware"


@pytest.mark.parametrize("override,field", [
    ("--Router.policy=/missing.yaml", "Router.policy"),
    ("--Common.model=not-a-model", "Common.model"),
])
def test_dry_run_exits_2_naming_file_and_field(override, field):
    res = dry_run(DISAGG, "-f", "configs/disagg.yaml", override)
    assert res.exit_code == 2, res.output
    assert "configs/disagg.yaml" in res.output and field in res.output


def test_dry_run_refuses_duplicate_keys_and_empty_files(tmp_path):
    dup = write(tmp_path, "Common: {namespace: a}\nCommon: {namespace: b}\n", "dup.yaml")
    empty = write(tmp_path, "", "empty.yaml")
    for path in (dup, empty):
        res = dry_run(GRAPH, "-f", str(path))
        assert res.exit_code == 2, res.output
        assert str(path) in res.output


def test_error_messages_keep_their_brackets():
    res = dry_run(GRAPH, "--Common.namespace=Bad")
    assert res.exit_code == 2
    assert "^[a-z][a-z0-9_-]{0,62}$" in res.output


def test_an_unusable_policy_key_file_stops_serve(tmp_path):
    key = tmp_path / "policy.key"
    key.write_text("s" * 40)
    key.chmod(0o644)
    res = dry_run(GRAPH, "--policy-key-file", str(key))
    assert res.exit_code == 2 and "chmod 600" in res.output
    missing = dry_run(GRAPH, "--policy-key-file", str(tmp_path / "nope"))
    assert missing.exit_code == 2


def test_credentials_that_conflict_stop_serve(monkeypatch):
    monkeypatch.setenv("ETCD_AUTH_USERNAME", "a")
    monkeypatch.setenv("ETCD_AUTH_PASSWORD", "b")
    res = dry_run(GRAPH, "--etcd", "https://c:d@etcd:2379", "--nats", "nats://n:4222")
    assert res.exit_code == 2 and "two different credentials" in res.output
    assert "c:d" not in res.output


def test_credentials_without_external_servers_stop_serve(monkeypatch):
    for name in ("ETCD_ENDPOINTS", "NATS_SERVER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NATS_AUTH_TOKEN", "t")
    res = dry_run(GRAPH)
    assert res.exit_code == 2 and "NATS_AUTH_TOKEN set, but no external" in res.output


def test_an_unquoted_number_in_env_is_its_text_and_a_boolean_is_refused(tmp_path):
    """``DYN_X: 1`` in YAML reads as a number; it is passed as the text "1".  A boolean
    would be ambiguous ("true"? "True"? "1"?) and is refused naming the variable."""
    from splitserve.contracts.config import ComponentConfig

    assert ComponentConfig.model_validate(
        {"env": {"A": 1, "B": 0.5, "C": "x"}}).env == {"A": "1", "B": "0.5", "C": "x"}
    cfg = write(tmp_path, """
        EchoFront:
          env: {FLAG: true}
    """)
    res = dry_run(GRAPH, "-f", str(cfg))
    assert res.exit_code == 2
    assert "EchoFront.env" in res.output and "FLAG: True is not text" in res.output
    ok = write(tmp_path, """
        EchoFront:
          env: {THREADS: 1}
    """, "ok.yaml")
    assert dry_run(GRAPH, "-f", str(ok)).exit_code == 0


def test_an_invalid_worker_section_is_the_only_error_named():
    # the frontend's check that it has a worker to route to waits for a valid one
    res = dry_run("graphs.disagg_inproc:Frontend", "-f", "configs/mocker_disagg_inproc.yaml",
                  "--DecodeWorker.disaggregated_router.protect_tpot_ms=-5")
    assert res.exit_code == 2, res.output
    assert "DecodeWorker.disaggregated_router.protect_tpot_ms" in res.output
    assert "Frontend.routing" not in res.output
