"""Mocker engines owned by a disaggregated worker: start, stream from, watch, stop.

A DecodeWorker or PrefillWorker replica with ``engine: mocker`` is a wrapper process that
serves our own endpoint and keeps one mocker child per role, registered under a private
component name (``<component>_<role>``, e.g. ``decodeworker_local``) so the router and
frontend never see the children, only the wrapper.  Each child is addressed by the
instance id it registered (matched by its listening port, like the Worker component).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from splitserve.components.engines.mocker.config import MockerEngineArgs
from splitserve.components.engines.mocker.process import (
    ENDPOINT,
    MockerExited,
    kv_geometry,
    mocker_argv,
    mocker_env,
    model_dir_for,
    wait_registered,
)
from splitserve.contracts.kit.procs import spawn, terminate
from splitserve.contracts.kit.component import ComponentContext, endpoint_path

log = logging.getLogger("splitserve.mocker_disagg")

# Grace for the engine children of a disaggregated mocker worker: the worker has drained
# its requests before it stops them.
ENGINE_STOP_GRACE_S = 10.0


class EngineStalled(RuntimeError):
    """An engine stream produced nothing for longer than the idle timeout."""


@dataclass
class EngineChild:
    """One running mocker process and the client that reaches exactly its instance."""

    role: str
    mode: str
    proc: subprocess.Popen
    endpoint: str
    instance_id: int = 0
    client: Any = None

    async def stream(self, request: dict, idle_timeout_s: float) -> AsyncIterator[dict]:
        """Send one request to this engine; yields its chunks as dicts.

        Raises EngineStalled when no chunk arrives within ``idle_timeout_s`` (a mocker
        stream whose request it cannot read never ends by itself).  Closing the generator
        drops the stream, which cancels the request inside the engine.
        """
        stream = await asyncio.wait_for(self.client.direct(request, self.instance_id),
                                        idle_timeout_s)
        it = stream.__aiter__()
        while True:
            try:
                item = await asyncio.wait_for(it.__anext__(), idle_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise EngineStalled(f"{self.role} engine sent nothing for "
                                    f"{idle_timeout_s}s") from None
            yield item.data() if callable(item.data) else item.data


async def start_engines(ctx: ComponentContext, args: MockerEngineArgs,
                        roles: dict[str, str]) -> list[EngineChild] | None:
    """Start one mocker per ``role -> disaggregation mode``; called once at start-up.

    Returns the children once every one has registered and has a connected client, or
    None if the component was asked to stop first (the children are then stopped).
    Raises MockerExited / TimeoutError if a child dies or does not register in time.
    """
    component = ctx.run.component.lower()
    ctx.report("loading", progress="exporting model directory")
    model_dir = await asyncio.to_thread(model_dir_for, args, ctx.run.common.model)
    children: list[EngineChild] = []
    try:
        for role, mode in roles.items():
            name = f"{component}_{role}"
            argv = mocker_argv(args.model_copy(update={"disaggregation_mode": mode}),
                               namespace=ctx.namespace, component=name, model_dir=model_dir,
                               model_name=ctx.run.common.served_model_name,
                               request_plane=ctx.run.common.request_plane,
                               max_model_len=ctx.run.common.context_length,
                               kv_bytes_per_token=kv_geometry(model_dir))
            log.info("starting %s engine: %s", role, " ".join(argv[1:]))
            proc = spawn(argv, env=mocker_env(dict(os.environ)))
            children.append(EngineChild(role, mode, proc,
                                        endpoint_path(ctx.namespace, name, ENDPOINT)))
        ctx.report("loading", progress="waiting for engine registration",
                   engine_pids=[c.proc.pid for c in children])
        ready = asyncio.ensure_future(asyncio.gather(*(_register(ctx, c, args)
                                                       for c in children)))
        stop = asyncio.ensure_future(ctx.stopping.wait())
        await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await asyncio.gather(ready, return_exceptions=True)
            await stop_engines(children, args.stop_grace_s(ENGINE_STOP_GRACE_S))
            return None
        stop.cancel()
        ready.result()
        return children
    except BaseException:
        await stop_engines(children, args.stop_grace_s(ENGINE_STOP_GRACE_S))
        raise


async def _register(ctx: ComponentContext, child: EngineChild, args: MockerEngineArgs) -> None:
    ns, component, endpoint = child.endpoint.split(".")
    prefix = f"v1/instances/{ns}/{component}/{endpoint}/"
    ids = await wait_registered(os.environ["ETCD_ENDPOINTS"], prefix, child.proc,
                                args.ready_timeout_s)
    child.instance_id = ids[0]
    child.client = await ctx.runtime.endpoint(child.endpoint).client()
    await asyncio.wait_for(child.client.wait_for_instances(), args.ready_timeout_s)


async def first_exit(children: list[EngineChild]) -> MockerExited:
    """Wait until any child exits; returns the error for the component to raise."""
    while True:
        for child in children:
            code = child.proc.poll()
            if code is not None:
                log.error("%s engine (pid %d) exited with code %s", child.role,
                          child.proc.pid, code)
                return MockerExited(code)
        await asyncio.sleep(0.2)


async def stop_engines(children: list[EngineChild], grace_s: float) -> None:
    """SIGTERM every child (each deregisters on its own), SIGKILL after ``grace_s``."""
    codes = await asyncio.gather(*(asyncio.to_thread(terminate, c.proc, grace_s)
                                   for c in children))
    for child, code in zip(children, codes, strict=True):
        log.info("%s engine pid %d stopped with code %s", child.role, child.proc.pid, code)
