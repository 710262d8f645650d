"""Dynamo's mocker as a child process: its command line, its environment, and the
aggregated Worker replica it serves alone (``run_mocker``, the registry's aggregated main
for ``engine: mocker``, through ``host.serve_aggregated``).

By default one replica is one mocker process serving one simulated engine (``--num-workers 1``), so the
supervisor's replica count is the worker count and a crashed engine is restarted on its
own; ``workers_per_process`` packs several engines into one process for big fleets.

Lifecycle: find the model's directory (or export the packaged default's), start ``python -m dynamo.mocker``,
wait until the instance it owns appears under ``v1/instances/<ns>/<component>/generate/``
in etcd, report "ready"; on SIGTERM stop the child (SIGTERM, bounded wait, SIGKILL);
if the child exits on its own, exit non-zero so the supervisor restarts this replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from splitserve.contracts.kit.etcd import get_prefix
from splitserve.contracts.kit.waiting import poll_until
from splitserve.contracts.model_files import (
    PACKAGED_MODEL,
    export_model_dir,
    locate,
    model_cache_dir,
    read_model_info,
)
from splitserve.components.engines.mocker.config import MockerEngineArgs
from splitserve.contracts.kit.procs import spawn, terminate
from splitserve.contracts.kit.component import ComponentContext, endpoint_path

log = logging.getLogger("splitserve.mocker")

ENDPOINT = "generate"


class MockerExited(RuntimeError):
    """The mocker child ended while this replica was meant to be serving."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"mocker exited on its own with code {code}")
        self.code = code


def model_dir_for(cfg: MockerEngineArgs, model: str) -> Path:
    """The directory the mocker reads ``model``'s config.json and tokenizer from (its
    simulated KV geometry: layers, KV heads, head dimension, dtype): the model's own
    directory or cached snapshot, or the packaged default's weight-less export (in
    ``model_cache_dir`` when configured; the first export on a machine takes about
    30 s).  Called in a thread at start."""
    found = locate(model)  # None only for the packaged default
    if found is not None:
        return found
    dst = (Path(cfg.model_cache_dir) / PACKAGED_MODEL if cfg.model_cache_dir
           else model_cache_dir(PACKAGED_MODEL))
    return export_model_dir(dst)


def mocker_argv(cfg: MockerEngineArgs, *, namespace: str, component: str, model_dir: Path,
                model_name: str, request_plane: str,
                max_model_len: int | None = None,
                kv_bytes_per_token: int | None = None) -> list[str]:
    """The full ``python -m dynamo.mocker`` command line for one replica (pure).

    ``max_model_len`` is ``Common.context_length`` when configured (the mocker then
    refuses longer sequences like a real engine); None leaves the mocker unbounded, the
    frontend's check against the model's own window being the limit.
    ``kv_bytes_per_token`` (``kv_geometry``) sizes the simulated KV transfers unless
    ``extra_args`` sets it.
    """
    argv = [
        sys.executable, "-m", "dynamo.mocker",
        "--model-path", str(model_dir), "--model-name", model_name,
        "--endpoint", f"dyn://{endpoint_path(namespace, component, ENDPOINT)}",
        "--engine-type", cfg.engine_type, "--disaggregation-mode", cfg.disaggregation_mode,
        "--num-workers", str(cfg.workers_per_process), "--block-size", str(cfg.block_size),
        "--num-gpu-blocks-override", str(cfg.num_gpu_blocks),
        "--speedup-ratio", str(cfg.speedup_ratio),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
        # etcd discovery and the NATS event plane keep everything on loopback (the ZMQ
        # event plane binds 0.0.0.0) and let routers in other processes see KV events.
        "--discovery-backend", "etcd", "--event-plane", "nats",
        "--request-plane", request_plane,
    ]
    argv.append("--enable-prefix-caching" if cfg.enable_prefix_caching
                else "--no-enable-prefix-caching")
    if cfg.kv_transfer_bandwidth is not None:
        argv += ["--kv-transfer-bandwidth", str(cfg.kv_transfer_bandwidth)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    given = {a.split("=", 1)[0] for a in cfg.extra_args}
    if kv_bytes_per_token is not None and "--kv-bytes-per-token" not in given:
        argv += ["--kv-bytes-per-token", str(kv_bytes_per_token)]
    return argv + list(cfg.extra_args)


def kv_geometry(model_dir: Path) -> int | None:
    """KV bytes per token of the model in ``model_dir``, from its config.json (layers x
    K and V x KV heads x head dimension x the dtype's bytes).  Dynamo's mocker computes
    it too, but takes the head dimension as hidden size / heads, which is wrong for
    models whose config.json names a head dimension of its own."""
    return read_model_info(model_dir).kv_bytes_per_token()


def mocker_env(base: dict[str, str]) -> dict[str, str]:
    """The child's environment: ours, with every listener the runtime opens on loopback."""
    env = dict(base)
    env.setdefault("DYN_TCP_RPC_HOST", "127.0.0.1")
    env.setdefault("DYN_SYSTEM_HOST", "127.0.0.1")
    env.setdefault("DYN_HTTP_RPC_HOST", "127.0.0.1")
    return env


def listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on, read from /proc (Linux).

    Used to tell which registered instance belongs to our child when several replicas
    start at once: the instance record carries the TCP address of its request server.
    """
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def instance_port(record: dict) -> int | None:
    """Port of an instance's TCP request server, e.g. from ``127.0.0.1:46145/<id>/ns/..``."""
    tcp = (record.get("transport") or {}).get("tcp")
    if not tcp:
        return None
    try:
        return int(tcp.split("/", 1)[0].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


async def wait_registered(etcd: str, prefix: str, proc: subprocess.Popen,
                          timeout_s: float, count: int = 1) -> list[int]:
    """Poll etcd until ``count`` instances of the child are registered; return their ids.

    With the TCP request plane an instance is matched by the child's listening ports;
    with the NATS request plane (no port) instances not seen before are taken.
    Raises MockerExited if the child dies, TimeoutError after ``timeout_s``.
    """
    before = {json.loads(v).get("instance_id") for _, v in await get_prefix(etcd, prefix)}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise MockerExited(proc.returncode)
        records = [json.loads(v) for _, v in await get_prefix(etcd, prefix)]
        ports = listening_ports(proc.pid)
        ours = sorted(int(rec["instance_id"]) for rec in records
                      if ((instance_port(rec) in ports) if instance_port(rec) is not None
                          else rec.get("instance_id") not in before))
        if len(ours) >= count:
            return ours
        await asyncio.sleep(0.1)
    raise TimeoutError(f"mocker did not register under {prefix} within {timeout_s}s")


async def _wait_exit(proc: subprocess.Popen) -> int:
    await poll_until(lambda: proc.poll() is not None, poll_s=0.2)
    return proc.returncode


async def run_mocker(ctx: ComponentContext, cfg: MockerEngineArgs,
                     drain_timeout_s: float = 30.0) -> None:
    """Component body: start the mocker, report ready, and stop it on SIGTERM.

    Registers under this component's own name (``Worker`` → ``worker``), so the router
    and frontend find the mocker exactly where they would find a torch worker.  On stop
    the mocker deregisters and finishes its streams for ``cfg.stop_timeout_s`` (default
    the worker's ``drain_timeout_s``); what it has not finished then is killed, and the
    frontend resumes those requests on another worker.
    """
    component = ctx.run.component.lower()
    ctx.report("loading", progress="exporting model directory")
    model_dir = await asyncio.to_thread(model_dir_for, cfg, ctx.run.common.model)
    argv = mocker_argv(cfg, namespace=ctx.namespace, component=component, model_dir=model_dir,
                       model_name=ctx.run.common.served_model_name,
                       request_plane=ctx.run.common.request_plane,
                       max_model_len=ctx.run.common.context_length,
                       kv_bytes_per_token=kv_geometry(model_dir))
    log.info("starting mocker: %s", " ".join(argv[1:]))
    # Own session so a terminal's Ctrl-C reaches only the supervisor; parent-death
    # signal so a SIGKILLed replica cannot leave an engine registered behind it.
    proc = spawn(argv, env=mocker_env(dict(os.environ)))
    endpoint = endpoint_path(ctx.namespace, component, ENDPOINT)
    try:
        ctx.report("loading", progress="waiting for engine registration", engine_pid=proc.pid)
        prefix = f"v1/instances/{ctx.namespace}/{component}/{ENDPOINT}/"
        registration = asyncio.create_task(
            wait_registered(os.environ["ETCD_ENDPOINTS"], prefix, proc, cfg.ready_timeout_s,
                            cfg.workers_per_process))
        stop = asyncio.create_task(ctx.stopping.wait())
        await asyncio.wait({registration, stop}, return_when=asyncio.FIRST_COMPLETED)
        if stop.done():
            registration.cancel()
            return
        stop.cancel()
        instance_ids = registration.result()
        ctx.report("ready", endpoint=endpoint, instance_id=instance_ids[0],
                   instance_ids=instance_ids, engine_pid=proc.pid,
                   engine_type=cfg.engine_type, disaggregation_mode=cfg.disaggregation_mode,
                   block_size=cfg.block_size)
        log.info("mocker ready: %s instances %s (pid %d)", endpoint,
                 ",".join(f"{i:x}" for i in instance_ids), proc.pid)
        exited = asyncio.create_task(_wait_exit(proc))
        stop = asyncio.create_task(ctx.stopping.wait())
        await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            raise MockerExited(exited.result())
        exited.cancel()
        ctx.report("stopping", endpoint=endpoint)
    finally:
        # The mocker deregisters (revokes its lease) on SIGTERM before exiting.
        code = await asyncio.to_thread(terminate, proc, cfg.stop_grace_s(drain_timeout_s))
        log.info("mocker pid %d stopped with code %s", proc.pid, code)


