"""`engine: mocker` — a Worker whose engine is Dynamo's mocker (a simulated SGLang,
TensorRT-LLM or vLLM engine), run as a child process.  See docs/mocker.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from splitserve.components.mocker_worker.config import MockerEngineArgs
from splitserve.serve.component import ComponentContext

from .config import WorkerCommon


class MockerWorkerSection(WorkerCommon):
    """A worker running Dynamo's mocker."""

    engine: Literal["mocker"] = "mocker"
    engine_args: MockerEngineArgs = Field(default_factory=MockerEngineArgs)


async def run_mocker_worker(ctx: ComponentContext, cfg: MockerWorkerSection) -> None:
    """Component main for ``engine: mocker``; exits non-zero if the engine dies."""
    from splitserve.components.mocker_worker.main import run_mocker

    await run_mocker(ctx, cfg.engine_args, drain_timeout_s=cfg.drain_timeout_s)
