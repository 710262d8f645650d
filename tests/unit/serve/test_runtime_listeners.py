"""A component process started without the supervisor (a Kubernetes pod) binds Dynamo's
listeners and UCX to its ``--bind-host``; loopback stays the default and a variable
already in the environment wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.contracts.kit import component
from splitserve.contracts.kit.listeners import DYNAMO_HOST_VARS, missing_listener_env
from tests.run_configs import run_config_file

pytestmark = pytest.mark.unit

GRAPH = "graphs.disagg:Frontend"
VARS = (*DYNAMO_HOST_VARS, "UCX_NET_DEVICES")


class RecordingRuntime:
    """Stands in for Dynamo's DistributedRuntime: records the listener variables it
    would read when created."""

    created: list[dict[str, str | None]] = []

    def __init__(self, loop, discovery, request_plane, event_plane) -> None:
        import os

        RecordingRuntime.created.append({k: os.environ.get(k) for k in VARS})

    def shutdown(self) -> None:
        pass


@pytest.fixture
def runtime_env(monkeypatch):
    """No listener variable set; returns the environments runtimes were created with."""
    import dynamo.runtime

    for name in (*VARS, "ETCD_ENDPOINTS", "NATS_SERVER"):
        # setenv first, so that undoing restores "unset" after run() has set it
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    RecordingRuntime.created = []
    monkeypatch.setattr(dynamo.runtime, "DistributedRuntime", RecordingRuntime)
    # run() would reconfigure the whole process's logging (Dynamo's and the root logger).
    monkeypatch.setattr(component, "configure_logging", lambda *args: None)
    return RecordingRuntime.created


STAND_IN: list[str] = []  # --Common.model=<a tiny model>, set by the fixture below


@pytest.fixture(autouse=True)
def model_stand_in(tiny_models):
    """The config's model (/models/Llama-3.1-8B-Instruct) is not on this machine and the
    plan checks it is there: a tiny model directory stands in."""
    STAND_IN[:] = [f"--Common.model={tiny_models['llama']}"]


def config_file(tmp_path: Path) -> Path:
    """A prefill worker's resolved config, as a manifest mounts it (bind host loopback)."""
    return run_config_file(tmp_path, GRAPH, "trtllm_disagg.yaml", "PrefillWorker", STAND_IN)


def start(tmp_path: Path, *flags: str) -> None:
    """Run a component process whose main returns at once."""
    async def main(ctx):
        pass

    component.run(main, ["--config", str(config_file(tmp_path)), *flags])


def test_a_pod_binds_its_listeners_to_the_bind_host_given_on_the_command_line(
        runtime_env, tmp_path):
    start(tmp_path, "--bind-host", "10.1.2.3", "--advertise-host", "10.1.2.3")
    [env] = runtime_env
    assert {k: env[k] for k in DYNAMO_HOST_VARS} == dict.fromkeys(DYNAMO_HOST_VARS,
                                                                  "10.1.2.3")
    assert env["UCX_NET_DEVICES"] == "all"   # not "lo": the peers are other pods


def test_every_listener_stays_on_loopback_by_default(runtime_env, tmp_path):
    start(tmp_path)
    [env] = runtime_env
    assert {k: env[k] for k in DYNAMO_HOST_VARS} == dict.fromkeys(DYNAMO_HOST_VARS,
                                                                  "127.0.0.1")
    assert env["UCX_NET_DEVICES"] == "lo"


def test_a_variable_already_set_wins(runtime_env, monkeypatch, tmp_path):
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    monkeypatch.setenv("DYN_SYSTEM_HOST", "127.0.0.1")
    start(tmp_path, "--bind-host", "10.1.2.3")
    [env] = runtime_env
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert env["DYN_SYSTEM_HOST"] == "127.0.0.1"
    assert env["DYN_TCP_RPC_HOST"] == env["DYN_TCP_RESPONSE_STREAM_HOST"] == "10.1.2.3"


@pytest.mark.parametrize("bind_host,environ,expected", [
    ("127.0.0.1", {}, {**dict.fromkeys(DYNAMO_HOST_VARS, "127.0.0.1"),
                       "UCX_NET_DEVICES": "lo"}),
    ("fd00::7", {}, {**dict.fromkeys(DYNAMO_HOST_VARS, "fd00::7"), "UCX_NET_DEVICES": "all"}),
    ("10.0.0.5", dict.fromkeys(VARS, "x"), {}),
    ("10.0.0.5", {"UCX_NET_DEVICES": "lo"}, dict.fromkeys(DYNAMO_HOST_VARS, "10.0.0.5")),
])
def test_missing_listener_env(bind_host, environ, expected):
    assert missing_listener_env(bind_host, environ) == expected
