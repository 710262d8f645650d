"""The Kubernetes connector against a fake API server on 127.0.0.1.

The fake serves only the Deployment scale subresource and records every call, so the
test checks what the official client really sends: method, path, content type, body.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from splitserve.planner import Hold, Move, Scale
from splitserve.planner.connectors.kubernetes import KubernetesConnector

pytestmark = pytest.mark.integration

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")


class FakeApiServer:
    """Deployments ``prefill-worker`` and ``decode-worker`` in namespace ``llm``."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.replicas = {("llm", "prefill-worker"): 2, ("llm", "decode-worker"): 3}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _reply(self, status: int, doc: dict) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _scale(self, ns: str, name: str) -> dict:
                n = fake.replicas[(ns, name)]
                return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                        "metadata": {"name": name, "namespace": ns},
                        "spec": {"replicas": n}, "status": {"replicas": n}}

            def _handle(self) -> None:
                m = SCALE_PATH.match(self.path.split("?")[0])
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.calls.append({"method": self.command, "path": self.path, "body": body,
                                   "content_type": self.headers.get("Content-Type")})
                if not m or (m.group(1), m.group(2)) not in fake.replicas:
                    self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "reason": "NotFound", "code": 404})
                    return
                key = (m.group(1), m.group(2))
                if self.command == "PATCH":
                    for op in body:  # JSON Patch: only what the connector sends
                        assert op["op"] == "add" and op["path"] == "/spec/replicas"
                        fake.replicas[key] = op["value"]
                self._reply(200, self._scale(*key))

            do_GET = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    fake.thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()
        fake.thread.join(5)


@pytest.fixture
def apps_api(fake_api: FakeApiServer):
    from kubernetes import client

    config = client.Configuration()
    config.host = fake_api.url
    api_client = client.ApiClient(config)
    try:
        yield client.AppsV1Api(api_client)
    finally:
        api_client.close()


def test_connector_patches_deployment_scales(fake_api, apps_api):
    conn = KubernetesConnector(apps_api, "llm")
    actions = [Move("decode", "prefill", 1, 2, 3, "move", "budget spent"),
               Hold("decode", "steady", "")]
    results = asyncio.run(conn.apply(actions))
    assert [(r.pool, r.replicas, r.ok) for r in results] == [("decode", 2, True),
                                                              ("prefill", 3, True)]
    assert results[1].detail == "deployment/prefill-worker: spec.replicas=3"
    assert [(c["method"], c["path"], c["body"]) for c in fake_api.calls] == [
        ("PATCH", "/apis/apps/v1/namespaces/llm/deployments/decode-worker/scale",
         [{"op": "add", "path": "/spec/replicas", "value": 2}]),
        ("PATCH", "/apis/apps/v1/namespaces/llm/deployments/prefill-worker/scale",
         [{"op": "add", "path": "/spec/replicas", "value": 3}]),
    ]
    assert {c["content_type"] for c in fake_api.calls} == {"application/json-patch+json"}
    assert asyncio.run(conn.replicas("prefill")) == 3
    assert fake_api.replicas == {("llm", "prefill-worker"): 3, ("llm", "decode-worker"): 2}


def test_missing_deployment_is_reported_not_raised(fake_api, apps_api):
    conn = KubernetesConnector(apps_api, "llm", prefix="other-graph")
    (result,) = asyncio.run(conn.apply([Scale("prefill", 1, 3, "scale-up", "queue")]))
    assert not result.ok and "404" in result.detail
    assert fake_api.calls[0]["path"].endswith("/deployments/other-graph-prefill-worker/scale")
