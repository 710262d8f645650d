"""Dynamo's own frontend in front of this project's torch workers: with
``Worker.dynamo_model_card`` each replica registers a Dynamo model card, Dynamo's
frontend (kv mode) discovers it, lists the model and drives the worker with its own
preprocessed requests; a greedy completion of the same token ids equals the one this
project's frontend gets from the same worker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.graphs import start_graph
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
PROMPT = [1, 504, 3437, 1083, 260, 1183, 28, 1060, 253, 2118]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def complete(url: str, model: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(300)
def test_dynamos_frontend_drives_the_torch_workers(tmp_path, tiny_models):
    run, url = start_graph(
        tmp_path, "graphs.agg_router:Frontend", "configs/agg_router.yaml",
        f"--Common.model={tiny_models['llama']}", "--Common.served_model_name=tiny",
        "--Worker.replicas=1", "--Worker.dynamo_model_card=true", timeout_s=240)
    infra = json.loads((Path(run.info()["run_dir"]) / "infra" / "infra.json").read_text())
    port = free_port()
    env = {**os.environ, "ETCD_ENDPOINTS": infra["endpoints"]["etcd"],
           "NATS_SERVER": infra["endpoints"]["nats"], "DYN_LOG": "error",
           "DYN_TCP_RPC_HOST": HOST, "DYN_HTTP_RPC_HOST": HOST, "DYN_SYSTEM_HOST": HOST}
    log = open(tmp_path / "dynamo-frontend.log", "wb")  # noqa: SIM115 - closed below
    fe = subprocess.Popen(
        [sys.executable, "-m", "dynamo.frontend", "--http-host", HOST, "--http-port",
         str(port), "--router-mode", "kv", "--namespace", "dynamo", "--discovery-backend",
         "etcd", "--request-plane", "tcp", "--event-plane", "nats"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run.seen_pids.add(fe.pid)
    dyn = f"http://{HOST}:{port}"
    try:
        def listed() -> list[str]:
            try:
                r = httpx.get(f"{dyn}/v1/models", timeout=5)
                return [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 \
                    else []
            except (httpx.HTTPError, ValueError):
                assert fe.poll() is None, (tmp_path / "dynamo-frontend.log").read_text()
                return []
        wait_until(lambda: listed() == ["tiny"], 120, interval_s=0.5,
                   what="Dynamo's frontend listing the worker's model")
        theirs, ours = complete(dyn, "tiny"), complete(url, "tiny")
        assert theirs["choices"][0]["text"] == ours["choices"][0]["text"]
        assert theirs["choices"][0]["finish_reason"] == "length"
        assert theirs["usage"]["completion_tokens"] == 8
    finally:
        if fe.poll() is None:
            os.killpg(fe.pid, signal.SIGTERM)
            try:
                fe.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(fe.pid, signal.SIGKILL)
                fe.wait(5)
        log.close()
        time.sleep(0.2)
        assert run.stop() == 0, run.output()[-3000:]
