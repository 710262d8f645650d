"""`dynamo route explain`: how the live router would place a request, without sending it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import typer
from rich.console import Console

from splitserve.cli.console import cli_console
from splitserve.cli.paths import state_root
from splitserve.cli.status_cmd import local_supervisors
from splitserve.cli.stderr_filter import without_request_spans
from splitserve.contracts.kit.connect import EtcdAccess, NatsAccess, split_credentials

app = typer.Typer(help="Inspect routing decisions of a running graph.", no_args_is_help=True)


def _messages(prompt: str | None, messages: Path | None) -> list[dict] | None:
    if messages is not None:
        try:
            data = json.loads(messages.read_text())
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"{messages}: {exc}", param_hint="--messages") from None
        if isinstance(data, dict):
            data = data.get("messages")
        if not isinstance(data, list) or not data:
            raise typer.BadParameter(f"{messages}: expected a JSON list of chat messages "
                                     "(or an object with 'messages')", param_hint="--messages")
        return data
    if prompt is not None:
        return [{"role": "user", "content": prompt}]
    return None


def runtime_env(etcd: str, nats: str | None) -> dict[str, str]:
    """Variables for Dynamo's runtime in this process: credentials written into the URLs
    become the ETCD_AUTH_* / NATS_AUTH_* variables it reads (never part of the URL)."""
    env = EtcdAccess.from_env(os.environ, etcd).env()
    if nats:
        env.update(NatsAccess.from_env(os.environ, nats).env())
    return env


# How long a registered router (and the decode worker it picks) may take to answer.
ANSWER_S = 30.0


class NoAnswer(RuntimeError):
    """A router was found but its explanation did not come."""


async def _explain(etcd: str, nats: str | None, namespace: str, token_ids: list[int],
                   priority: str, timeout_s: float, lora: str | None = None) -> dict:
    os.environ.update(runtime_env(etcd, nats))
    os.environ.setdefault("DYN_LOG", "error")
    from dynamo.runtime.logging import configure_dynamo_logging

    configure_dynamo_logging()
    from splitserve.contracts.wire import RouteCall, RouteReply, chunk_data
    from splitserve.contracts.kit.component import endpoint_path, make_runtime

    rt = make_runtime(asyncio.get_running_loop(), "tcp")
    try:
        # A Router process serves `route`; a frontend that routes in its own process
        # serves `explain` (the same decision, read-only).  Whichever appears first.
        client = await _first_serving(
            [await rt.endpoint(endpoint_path(namespace, component, name)).client()
             for component, name in (("Router", "route"), ("Frontend", "explain"))],
            timeout_s)
        call = RouteCall(request_id="explain", token_ids=token_ids, priority=priority,
                         explain=True, record=False, lora=lora)
        reply = None
        answer_s = max(ANSWER_S, timeout_s)
        try:
            async with asyncio.timeout(answer_s):
                reply = await _ask_any(client, call.model_dump(mode="json"), RouteReply,
                                       chunk_data)
                if reply is not None:
                    reply["offload"] = await _offload(rt, reply, token_ids, priority, lora)
        except TimeoutError:
            raise NoAnswer(f"the router registered in namespace {namespace!r} did not "
                           f"answer within {answer_s:.0f}s") from None
        if reply is None:
            raise NoAnswer("the router returned nothing")
        return reply
    finally:
        rt.shutdown()


async def _ask_any(client, payload: dict, reply_type, chunk_data) -> dict | None:
    """The reply of the first registered instance that answers: one that died is still
    registered until its lease runs out (a router that restarted leaves its old instance
    behind for seconds), so a refused connection moves on to the next."""
    failed: list[str] = []
    for iid in sorted(client.instance_ids()):
        try:
            reply = None
            async for item in await client.direct(payload, iid):
                reply = reply_type.model_validate(chunk_data(item)).model_dump()
            return reply
        except Exception as exc:  # noqa: BLE001 - gone instance: try the next one
            failed.append(f"{iid:x}: {exc}")
    raise NoAnswer("no registered router answered (" + "; ".join(failed) + ")")


def _served_models(sups: list[dict]) -> dict[str, dict]:
    """Served model name -> its namespace and model, over the local graphs (a graph
    from before ``models`` was recorded: its one model)."""
    out: dict[str, dict] = {}
    for s in sups:
        models = s.get("models") or {s.get("served_model_name") or s.get("model", ""): {
            "namespace": s.get("namespace"), "model": s.get("model")}}
        out.update(models)
    return out


def _target(served: dict[str, dict], sups: list[dict], model: str | None,
            namespace: str | None, model_dir: Path | None, err: Console
            ) -> tuple[str | None, Path]:
    """The namespace to ask (``--model``'s pool's, else the local graph's) and the
    tokenizer directory of the model served there."""
    if model is not None and model not in served:
        known = ", ".join(served) or "none found locally"
        err.print(f"[red]error:[/] --model {model!r}: no local graph serves it (served: "
                  f"{known}; for a LoRA adapter: --model <its base> --lora {model})",
                  highlight=False)
        raise typer.Exit(1)
    pool = served.get(model) if model is not None else None
    if namespace is None:
        namespace = pool["namespace"] if pool else (sups[0]["namespace"] if sups else None)
    if model_dir is None:
        from splitserve.contracts import model_files

        if pool is None:
            pool = next((m for m in served.values() if m["namespace"] == namespace), {})
        model_dir = model_files.model_dir(pool.get("model", model_files.PACKAGED_MODEL))
    return namespace, model_dir


async def _first_serving(clients: list, timeout_s: float):
    """The first of ``clients`` whose endpoint has an instance; TimeoutError if none
    has one within ``timeout_s``."""
    waits = {asyncio.ensure_future(c.wait_for_instances()): c for c in clients}
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
    ready = [waits[t] for t in done if not t.cancelled() and t.exception() is None]
    if not ready:
        raise TimeoutError
    return ready[0]


async def _offload(rt, reply: dict, token_ids: list[int], priority: str,
                   lora: str | None = None) -> dict | None:
    """Ask the chosen decode worker how it would prefill (only disaggregated graphs)."""
    if reply.get("worker_id") is None or not reply.get("endpoint"):
        return None
    from splitserve.contracts.wire import chunk_data

    path = reply["endpoint"].rsplit(".", 1)[0] + ".explain"
    client = await rt.endpoint(path).client()
    try:
        await asyncio.wait_for(client.wait_for_instances(), 1.0)
    except TimeoutError:
        return None  # an aggregated worker: it has no offload decision
    try:
        ask = {"token_ids": token_ids, "priority": priority, "lora": lora}
        async for item in await client.direct(ask, reply["worker_id"]):
            return chunk_data(item)
    except Exception:  # noqa: BLE001 - the decision is extra information
        return None
    return None


@app.command()
def explain(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="User message to route."),
    messages: Path | None = typer.Option(None, "--messages", "-m", help="JSON file with a "
                                         "list of chat messages (or {\"messages\": [...]})."),
    priority: str = typer.Option("default", "--priority", help="Priority class of the request."),
    model: str | None = typer.Option(None, "--model", help="Served model name: the pool "
                                     "whose router to ask in a graph serving several "
                                     "(default: the graph's first model)."),
    namespace: str | None = typer.Option(None, "--namespace", "-n", help="Dynamo namespace "
                                         "(default: the local graph's, or --model's pool's)."),
    etcd: str | None = typer.Option(None, "--etcd", envvar="ETCD_ENDPOINTS",
                                    help="etcd endpoints (default: the local graph's)."),
    nats: str | None = typer.Option(None, "--nats", envvar="NATS_SERVER",
                                    help="NATS URL (default: the local graph's)."),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="Tokenizer directory "
                                          "(default: the local graph's model, else the "
                                          "packaged default)."),
    lora: str | None = typer.Option(None, "--lora", help="A LoRA adapter of --model: "
                                    "prefix hits are counted under it and only workers "
                                    "that report it loaded are candidates."),
    json_out: bool = typer.Option(False, "--json", help="Print the decision as JSON."),
    timeout_s: float = typer.Option(10.0, "--timeout", help="Seconds to wait for a router."),
    state_dir: str | None = typer.Option(None, "--state-dir", envvar="SPLITSERVE_HOME",
                                         help="Root for local state."),
) -> None:
    """Print the per-scorer breakdown the live router computes for a prompt.

    The request is tokenised exactly as the frontend would (chat template included) and
    sent to the router with explain=true (or, where the frontend routes in its own
    process, to the frontend's explain endpoint): nothing is recorded and no worker is
    called.
    """
    msgs = _messages(prompt, messages)
    if msgs is None:
        raise typer.BadParameter("give --prompt or --messages")
    err = Console(stderr=True)
    sups: list[dict] = []
    if not etcd or not namespace or model_dir is None:
        sups = local_supervisors(state_root(state_dir))
        if not sups and not etcd:
            err.print("[red]error:[/] no local `dynamo serve` found; pass --etcd and --namespace")
            raise typer.Exit(1)
        if sups:
            etcd = etcd or sups[0]["etcd"]
            nats = nats or sups[0]["nats"]
    served = _served_models(sups)
    namespace, model_dir = _target(served, sups, model, namespace, model_dir, err)
    from splitserve.components.frontend.textcodec import TextCodec

    codec = TextCodec.from_dir(model_dir)
    ids = codec.chat_ids([{"role": m.get("role", "user"), "content": m.get("content", "")}
                          for m in msgs])
    try:
        with without_request_spans():
            reply = asyncio.run(_explain(etcd, nats, namespace or "dynamo", ids, priority,
                                         timeout_s, lora))
    except NoAnswer as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except TimeoutError:
        where = split_credentials(etcd.split(",")[0])[0]
        err.print("[red]error:[/] ", end="")
        err.print(f"no router (nor a frontend routing in process) registered in namespace "
                  f"{namespace!r} at {where}", markup=False,
                  highlight=False)
        raise typer.Exit(1) from None
    name = next((n for n, m in served.items() if m["namespace"] == namespace), None)
    if json_out:
        typer.echo(json.dumps({"model": name, "lora": lora, "namespace": namespace,
                               "prompt_tokens": len(ids), **reply}, indent=2))
        return
    from splitserve.components.router import Decision, format_decision, worker_label

    console = cli_console()
    adapter = f", adapter {lora}" if lora else ""
    picked = "none" if reply["worker_id"] is None else worker_label(reply["worker_id"])
    console.print(f"model {name or '?'}{adapter} (namespace {namespace})  prompt tokens: "
                  f"{len(ids)}  →  worker {picked}  ({reply['reason']})", highlight=False)
    if reply.get("decision"):
        typer.echo(format_decision(Decision.model_validate(reply["decision"]),
                                   width=max(120, console.width)))
    off = reply.get("offload")
    if off:
        for line in offload_lines(off):
            console.print(line, highlight=False)


GUARD_FIELDS = ("stall_ms", "answers_harmed")
"""What the decode worker's stall guard adds to a decision it sent remote."""


def offload_lines(off: dict) -> list[str]:
    """The decode worker's offload decision (its ``explain`` answer) as lines: where and
    why, the load it saw, each rule's contribution, and where the stall guard sent a
    local verdict remote, the stall and the answers it would have harmed."""
    d, r, snap = off["decision"], off["request"], off["snapshot"]
    where = "REMOTE prefill" if d["remote"] else "LOCAL prefill"
    score = f", score {d['score']:.2f}" if d.get("score") is not None else ""
    lines = [f"offload decision on the decode worker: {where} ({d['reason']}{score})",
             f"  prompt {r['prompt_length']} tokens, cached on worker "
             f"{r['prefix_cached_length']}, prefill queue {snap['prefill_queue_depth']}"
             f", decode active {snap['decode_active_requests']}, kv usage "
             f"{snap['decode_kv_usage']:.0%}, prefill workers "
             f"{snap['live_prefill_workers']}"]
    parts = d.get("contributions") or {}
    lines += [f"  {metric}: {value:+.2f}" for metric, value in parts.items()
              if metric not in GUARD_FIELDS]
    if "stall_ms" in parts:
        harmed = int(parts.get("answers_harmed", 0))
        whose = "answer past its TPOT target" if harmed == 1 else (
            "answers past their TPOT targets")
        lines.append(f"  stall guard: prefilling here would stall the batch "
                     f"{parts['stall_ms']:.0f} ms and push {harmed} {whose}")
    return lines
