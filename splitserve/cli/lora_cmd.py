"""`dynamo lora load|unload|list`: LoRA adapters of a running local graph.

Talks to the graph's frontend (its adapter endpoints, docs/lora.md) with the run's
control token, read from the run directory as `dynamo scale` reads it: only the user who
started the graph can change its adapters.  The frontend's address comes from the
supervisor's status.  Exit codes: 0 done; 1 no graph, or it did not answer or failed;
2 bad input (a name, a path, a flag); 4 no such adapter (unload).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import typer
from rich.console import Console
from rich.table import Table

from splitserve.cli.console import cli_console
from splitserve.cli.paths import state_root
from splitserve.cli.status_cmd import local_supervisors
from splitserve.contracts.kit.credentials import read_secret
from splitserve.contracts.kit.loras import ADAPTER_CONFIG, lora_name_problem
from splitserve.serve.control import supervisor_status

app = typer.Typer(help="Load, unload and list the LoRA adapters of a running graph.",
                  no_args_is_help=True)

RUN_HELP = ("The `dynamo serve` to talk to: its pid or its run directory (default: the "
            "only local one).")
STATE_HELP = "Root for local state."
WILDCARDS = ("0.0.0.0", "::", "")
READY_WAIT_S = 60.0
"""How long a command waits for a frontend that is still starting (`dynamo serve ... &`
then `dynamo lora load` at once: a frontend with several models imports its parsers
for about 15 s on 2 cores before it is ready)."""
STARTING = ("starting", "loading")
READY_POLL_S = 0.5


def _fail(message: str, code: int = 1) -> typer.Exit:
    Console(stderr=True, soft_wrap=True).print(f"error: {message}", markup=False,
                                               highlight=False)
    return typer.Exit(code)


def _supervisor(run: str | None, state_dir: str | None) -> dict:
    sups = local_supervisors(state_root(state_dir))
    if run is not None:
        sups = [s for s in sups if run in (str(s.get("pid")), s.get("run_dir"))
                or (Path(run).exists() and str(Path(run).resolve()) == s.get("run_dir"))]
    if len(sups) == 1:
        return sups[0]
    if not sups:
        raise _fail(f"no local `dynamo serve` matches --run {run}" if run else
                    "no local `dynamo serve` found")
    raise _fail("several local graphs; choose one with --run (pids: "
                + ", ".join(str(s["pid"]) for s in sups) + ")")


def _frontend_url(info: dict, wait_s: float | None = None) -> str:
    """The ready frontend's base URL from the supervisor's status (a wildcard bind
    address is reached on loopback: the token never leaves the machine).  A frontend
    still starting or loading is waited for, up to ``wait_s`` (``READY_WAIT_S``)."""
    wait_s = READY_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    while True:
        status = supervisor_status(info, timeout_s=5.0)
        if status is None:
            raise _fail(f"the supervisor (pid {info['pid']}) did not answer")
        frontends = [r for r in status.get("replicas", []) if r.get("component") == "Frontend"]
        rows = [r for r in frontends if r.get("state") == "ready" and r.get("endpoint")]
        if rows:
            break
        states = sorted({str(r.get("state")) for r in frontends}) or ["none running"]
        starting = any(s in STARTING for s in states)
        if not starting or time.monotonic() >= deadline:
            waited = f" after {wait_s:g} s" if starting else ""
            raise _fail(f"the graph's frontend is not ready{waited} ({', '.join(states)}; "
                        "see `dynamo status`)")
        time.sleep(READY_POLL_S)
    parts = urlsplit(rows[0]["endpoint"])
    if parts.hostname in WILDCARDS:
        parts = parts._replace(netloc=f"127.0.0.1:{parts.port}")
    return urlunsplit(parts).rstrip("/")


def _call(run: str | None, state_dir: str | None, method: str, path: str,
          body: dict | None, timeout_s: float) -> tuple[int, Any]:
    """One authenticated call to the graph's frontend; (status, JSON reply)."""
    info = _supervisor(run, state_dir)
    try:
        token = read_secret(info["token_file"])
    except (KeyError, OSError, ValueError) as exc:
        raise _fail(f"cannot read the run's control token: {exc}") from None
    url = _frontend_url(info) + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (OSError, ValueError) as exc:
        raise _fail(f"the frontend at {url} did not answer: {exc}") from None


def _check(code: int, reply: Any) -> Any:
    if code == 200:
        return reply
    err = reply.get("error") if isinstance(reply, dict) else None
    message = err.get("message") if isinstance(err, dict) else reply
    raise _fail(f"HTTP {code}: {message}", {400: 2, 404: 4}.get(code, 1))


def _adapter_dir(path: Path) -> str:
    """The adapter directory as an absolute path (relative to where the command runs);
    exit 2 naming what is wrong."""
    full = path.expanduser().resolve()
    if not full.is_dir():
        raise _fail(f"{path}: no such directory", 2)
    if not (full / ADAPTER_CONFIG).is_file():
        raise _fail(f"{path}: not a LoRA adapter directory (no {ADAPTER_CONFIG})", 2)
    return str(full)


def _name(name: str) -> str:
    problem = lora_name_problem(name)
    if problem:
        raise _fail(problem, 2)
    return name


@app.command()
def load(
    name: str = typer.Argument(..., help="The adapter's name: clients send it as `model`."),
    path: Path = typer.Argument(..., help="The PEFT adapter directory (adapter_config.json "
                                "and its weights), as the workers can read it."),
    base_model: str | None = typer.Option(None, "--base-model", help="The served model it "
                                          "adapts (default: the one whose directory or id "
                                          "the adapter's config names as its base, else "
                                          "the graph's first model)."),
    run: str | None = typer.Option(None, "--run", help=RUN_HELP),
    timeout_s: float = typer.Option(90.0, "--timeout", help="Seconds to wait for the "
                                    "answer (the frontend waits Frontend.lora_load_timeout_s "
                                    "for a worker to load it)."),
    json_out: bool = typer.Option(False, "--json", help="Print the reply as JSON."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help=STATE_HELP),
) -> None:
    """Load a LoRA adapter on every worker of its base model and serve it under NAME."""
    body = {"lora_name": _name(name), "lora_path": _adapter_dir(path)}
    if base_model is not None:
        body["base_model"] = base_model
    reply = _check(*_call(run, state_dir, "POST", "/v1/load_lora_adapter", body, timeout_s))
    if json_out:
        typer.echo(json.dumps(reply))
        return
    workers = ", ".join(w for w, s in reply.get("workers", {}).items()
                        if s.get("state") == "loaded")
    typer.echo(f"{name}: loaded on {reply.get('base_model')} (workers {workers or '-'})")


@app.command()
def unload(
    name: str = typer.Argument(..., help="The adapter's name."),
    force: bool = typer.Option(False, "--force", help="Also an adapter a worker section "
                               "lists (a record the config no longer has; replicas that "
                               "start with it in their config write it again)."),
    run: str | None = typer.Option(None, "--run", help=RUN_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print the reply as JSON."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help=STATE_HELP),
) -> None:
    """Stop serving a LoRA adapter; workers unload it once its requests are done."""
    body = {"lora_name": _name(name), **({"force": True} if force else {})}
    reply = _check(*_call(run, state_dir, "POST", "/v1/unload_lora_adapter", body, 30.0))
    if json_out:
        typer.echo(json.dumps(reply))
        return
    still = reply.get("still_loaded_on") or []
    tail = f" (still in use on workers {', '.join(still)})" if still else ""
    typer.echo(f"{name}: unloaded{tail}")


@app.command("list")
def list_(
    run: str | None = typer.Option(None, "--run", help=RUN_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print the list as JSON."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help=STATE_HELP),
) -> None:
    """List the graph's LoRA adapters and how each worker stands with them."""
    reply = _check(*_call(run, state_dir, "GET", "/v1/lora_adapters", None, 10.0))
    if json_out:
        typer.echo(json.dumps(reply, indent=2))
        return
    rows = reply.get("data", [])
    if not rows:
        typer.echo("no LoRA adapters")
        return
    t = Table(title="LoRA adapters")
    for col in ("name", "base model", "served", "source", "path", "workers"):
        t.add_column(col, overflow="fold")  # a path or worker id wraps, never cut
    for a in rows:
        workers = "; ".join(f"{w}{' (prefill)' if s.get('role') == 'prefill' else ''} "
                            f"{s['state']}" + (f": {s['error']}" if s.get("error") else "")
                            for w, s in a.get("workers", {}).items())
        t.add_row(a["id"], a["base_model"], "yes" if a.get("served") else "no", a["source"],
                  a["path"], workers or "-")
    cli_console().print(t)
