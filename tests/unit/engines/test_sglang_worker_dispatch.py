"""The aggregated Worker runs ``engine: sglang`` / ``engine: trtllm`` sections with the
in-process engine shell (not the torch worker, not an 'unknown engine' error)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from splitserve.components.engines import agg_worker
from splitserve.components.worker import main as worker_main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("engine", "section"), [("sglang", "SglangWorkerSection"),
                                                 ("trtllm", "TrtllmWorkerSection")])
def test_worker_main_dispatches_gpu_engines(monkeypatch, engine, section):
    seen = []

    async def fake_run(ctx, cfg):
        seen.append(type(cfg).__name__)

    monkeypatch.setattr(agg_worker, f"run_{engine}_worker", fake_run)
    raw = {"engine": engine}
    ctx = SimpleNamespace(run=SimpleNamespace(config=raw),
                          config=lambda model: model.model_validate(raw))
    asyncio.run(worker_main.main(ctx))
    assert seen == [section]
