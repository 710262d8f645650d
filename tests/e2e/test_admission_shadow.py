"""Shadow (advisory) admission on the mocker fleet with routing in the frontend: under
overload nothing is refused, the requests admission would have refused are counted, and
each admitted request ends in the confusion table, read back by `dynamo qos calibration`.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.graphs import start_graph
from tests.e2e.helpers import by_label, dynamo, one

pytestmark = [pytest.mark.e2e, pytest.mark.quiet]

# The one-line admission form, in shadow mode, with a TTFT target the overload misses.
SHADOW = (
    "--Frontend.router.qos.mode=shadow",
    "--Frontend.router.qos.classes=[{name: default, ttft_ms: 500, tpot_ms: 250, "
    "may_reject: true}]",
    "--Frontend.router.qos.low_priority_threshold_ms=0",
    "--Worker.replicas=2",
    "--Worker.engine_args.max_num_seqs=1",  # ~7 req/s for the two workers
)
OFFERED_RPS = 20
SECONDS = 6


async def overload(url: str) -> list[dict]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=90)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = []
        start = asyncio.get_running_loop().time()
        for i in range(OFFERED_RPS * SECONDS):
            delay = start + i / OFFERED_RPS - asyncio.get_running_loop().time()
            await asyncio.sleep(max(0.0, delay))
            tasks.append(asyncio.create_task(one(s, url, i)))
        return await asyncio.gather(*tasks)


def test_shadow_mode_refuses_nothing_and_records_what_it_would_refuse(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg:Frontend", "configs/mocker_agg_inproc.yaml",
                           "--Frontend.replicas=1",  # one process's counters on /metrics
                           *SHADOW)
    try:
        results = asyncio.run(overload(url))
        verdicts = by_label(f"{url}/metrics", "splitserve_qos_admissions_total", "outcome")
        cells = by_label(f"{url}/metrics", "splitserve_qos_confusion_total", "outcome")
        shown = dynamo(run, "qos", "calibration", "--json")  # finds the frontend itself
    finally:
        assert run.stop() == 0, run.output()[-3000:]
    assert [r for r in results if r["status"] != 200] == []  # shadow refuses nothing
    would = verdicts.get("shadow-rejected", 0)
    assert would > 0, verdicts
    assert "rejected" not in verdicts, verdicts
    assert "refused" not in cells, cells
    assert cells.get("would-refuse-met", 0) + cells.get("would-refuse-missed", 0) == would
    assert sum(cells.values()) == len(results), cells
    assert shown.returncode == 0, shown.stderr
    out = json.loads(shown.stdout)
    assert out["confusion"]["refused"] == 0
    assert out["calibration"]["ttft"]["p50"] is not None
    print(json.dumps({"sent": len(results), "would_refuse": would, "cells": cells,
                      "calibration": out["calibration"]}))
