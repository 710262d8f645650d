"""`dynamo lora load|unload|list`: argument errors named before anything is contacted,
and a round trip through a supervisor's control endpoint and a frontend (both real
servers on loopback, with the run's token file) whose workers are played by the
frontend tests' ``Fleet``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splitserve.cli.main import app
from splitserve.components.frontend.http_server import HttpLimits
from splitserve.contracts.kit.credentials import write_secret
from splitserve.serve.control import ControlServer
from tests.unit.frontend.live_server import serve
from tests.unit.frontend.test_lora_lanes import app as frontend_app
from tests.unit.worker.lora_engine import adapter_dir

pytestmark = pytest.mark.unit


def run(*args: str, home: Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["lora", *args, "--state-dir", str(home)])
    return result.exit_code, result.output


@pytest.mark.parametrize(("args", "code", "phrase"), [
    (["load", "a/b", "."], 2, "'a/b' is not a valid adapter name"),
    (["load", "sql", "/no/such/dir"], 2, "/no/such/dir: no such directory"),
    (["load", "sql", "."], 2, "not a LoRA adapter directory (no adapter_config.json)"),
    (["unload", "bad!"], 2, "'bad!' is not a valid adapter name"),
    (["list"], 1, "no local `dynamo serve` found"),
    (["load", "sql", "ADAPTER"], 1, "no local `dynamo serve` found"),
    (["unload", "sql", "--run", "12345"], 1, "no local `dynamo serve` matches --run 12345"),
])
def test_argument_errors_are_named(tmp_path, monkeypatch, args, code, phrase):
    monkeypatch.chdir(tmp_path)
    adapter_dir(tmp_path, "ADAPTER")
    got, out = run(*args, home=tmp_path / "home")
    assert got == code, out
    assert phrase in " ".join(out.split())


@contextlib.contextmanager
def supervisor(home: Path, frontend: str, states=()):
    """A control endpoint that reports one ready frontend at ``frontend`` (after the
    states of ``states``, one per status asked, when given), registered in ``home`` as a
    live `dynamo serve` (this process's pid) with its token file."""
    run_dir = home / "runs" / "r1"
    run_dir.mkdir(parents=True)
    token = write_secret(run_dir / "control.token")

    before = list(states)

    async def handler(method, path, body):
        state = before.pop(0) if before else "ready"
        return 200, {"replicas": [{"component": "Frontend", "state": state,
                                   "endpoint": frontend}]}

    loop = asyncio.new_event_loop()
    control = ControlServer(handler, token)
    loop.run_until_complete(control.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    (home / "supervisors").mkdir(parents=True)
    (home / "supervisors" / f"{os.getpid()}.json").write_text(json.dumps({
        "pid": os.getpid(), "control": control.url, "run_dir": str(run_dir),
        "token_file": str(run_dir / "control.token")}))
    try:
        yield token
    finally:
        asyncio.run_coroutine_threadsafe(control.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_load_list_unload_through_the_graphs_frontend(codec, tmp_path, monkeypatch):
    home = tmp_path / "home"
    _, fleet, store, state = frontend_app(codec, token=None)
    with serve(state, HttpLimits()) as (host, port):
        with supervisor(home, f"http://0.0.0.0:{port}") as token:
            state.control_token = token
            adapter_dir(tmp_path, "sql")
            monkeypatch.chdir(tmp_path)  # a relative path is the caller's
            code, out = run("load", "sql", "sql", home=home)
            assert code == 0, out
            assert out.strip() == "sql: loaded on base-model (workers a, b)"
            assert json.loads(store.items["splitserve/dynamo/loras/adapters/sql"])["path"] \
                == str(tmp_path / "sql")
            code, out = run("list", "--json", home=home)
            assert code == 0 and json.loads(out)["data"][0]["id"] == "sql"
            code, out = run("list", home=home)
            assert code == 0 and "sql" in out and "a loaded" in out
            code, out = run("load", "sql", "sql", "--base-model", "nope", home=home)
            assert code == 2 and "base_model: 'nope' is not served here" in out
            code, out = run("unload", "sql", home=home)
            assert code == 0 and out.strip() == "sql: unloaded"
            code, out = run("unload", "sql", home=home)
            assert code == 4 and "HTTP 404" in out and "'sql' is not loaded" in out
            state.control_token = "another-token-of-enough-length"
            code, out = run("list", home=home)
            assert code == 1 and "HTTP 401" in out


def test_a_frontend_still_loading_is_waited_for_and_a_failed_one_is_not(
        codec, tmp_path, monkeypatch):
    """`dynamo serve ... &` then `dynamo lora list` at once: the frontend is loading (its
    parsers) for seconds; the command waits for it, bounded, and names the state when it
    gives up."""
    from splitserve.cli import lora_cmd

    monkeypatch.setattr(lora_cmd, "READY_POLL_S", 0.05)
    _, _, _, state = frontend_app(codec, token=None)
    with serve(state, HttpLimits()) as (host, port):
        home = tmp_path / "a"
        with supervisor(home, f"http://127.0.0.1:{port}",
                        ["starting", "loading", "loading"]) as token:
            state.control_token = token
            code, out = run("list", home=home)
            assert code == 0 and out.strip() == "no LoRA adapters", out
        home = tmp_path / "b"
        with supervisor(home, f"http://127.0.0.1:{port}", ["failed"]):
            code, out = run("list", home=home)
            assert code == 1 and "frontend is not ready (failed;" in out, out
        monkeypatch.setattr(lora_cmd, "READY_WAIT_S", 0.3)
        home = tmp_path / "c"
        with supervisor(home, f"http://127.0.0.1:{port}", ["loading"] * 1000):
            code, out = run("list", home=home)
            assert code == 1 and "not ready after 0.3 s (loading;" in out, out
