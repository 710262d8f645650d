"""The supervisor's control endpoint only obeys its operator.

A real `dynamo serve` (the small echo graph) is started; its control endpoint must refuse
requests without the per-run bearer token, with a wrong one, with a non-JSON body (the
"simple" cross-origin POST a web page can send) and with an Origin header, and still serve
the token's holder and `dynamo status`.
"""

from __future__ import annotations

import json
import socket
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.integration.serve_helpers import REPO, ServeRun, dynamo_cmd

pytestmark = [pytest.mark.security, pytest.mark.integration]

GRAPH = "tests.fixtures.echo_graph:EchoFront"
SCALE = "/v1/components/EchoWorker/replicas"


def raw_request(url: str, method: str, path: str, headers: dict[str, str],
                body: bytes = b"") -> tuple[int, dict]:
    """One HTTP/1.1 request on a plain socket, so every header is exactly what we send."""
    u = urlsplit(url)
    head = [f"{method} {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}",
            f"Content-Length: {len(body)}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"null")


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    run = ServeRun(tmp_path_factory.mktemp("control"), GRAPH)
    try:
        run.wait_ready(60)
        yield run
    finally:
        run.stop()


def workers(run: ServeRun) -> int:
    return len(run.replicas("EchoWorker"))


def test_token_file_is_private_to_the_operator(graph):
    path = Path(graph.info()["token_file"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    assert len(graph.token()) >= 32


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"},
                                     {"Authorization": "Basic Zm9vOmJhcg=="}],
                         ids=["no-token", "wrong-token", "other-scheme"])
def test_requests_without_the_token_get_401(graph, headers):
    body = json.dumps({"replicas": 0}).encode()
    code, reply = raw_request(graph.control(), "POST", SCALE,
                              {**headers, "Content-Type": "application/json"}, body)
    assert code == 401, reply
    assert raw_request(graph.control(), "GET", "/v1/status", headers)[0] == 401
    assert workers(graph) == 1


def test_a_text_plain_post_gets_415_even_with_the_token(graph):
    body = json.dumps({"replicas": 0}).encode()
    code, reply = raw_request(graph.control(), "POST", SCALE,
                              {"Authorization": f"Bearer {graph.token()}",
                               "Content-Type": "text/plain"}, body)
    assert code == 415, reply
    assert workers(graph) == 1


def test_a_browser_request_gets_403_even_with_the_token(graph):
    body = json.dumps({"replicas": 0}).encode()
    code, reply = raw_request(graph.control(), "POST", SCALE,
                              {"Authorization": f"Bearer {graph.token()}",
                               "Content-Type": "application/json",
                               "Origin": "http://attacker.example"}, body)
    assert code == 403, reply
    assert workers(graph) == 1


def test_the_token_holder_can_read_and_scale(graph):
    auth = {"Authorization": f"Bearer {graph.token()}"}
    code, status = raw_request(graph.control(), "GET", "/v1/status", auth)
    assert code == 200 and status["replicas"]
    code, reply = raw_request(graph.control(), "POST", SCALE,
                              {**auth, "Content-Type": "application/json; charset=utf-8"},
                              json.dumps({"replicas": 1}).encode())
    assert code == 200, reply
    assert reply == {"component": "EchoWorker", "replicas": 1}


def test_dynamo_status_reads_the_token_and_still_works(graph):
    out = subprocess.run([*dynamo_cmd(), "status", "--json", "--state-dir", str(graph.state)],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    report = json.loads(out.stdout)
    sup = report["supervisors"][0]
    assert sup["replicas"], out.stderr
    assert {r["component"] for r in sup["replicas"]} == {"EchoFront", "EchoWorker"}


def test_dynamo_scale_uses_the_token(graph):
    def scale(n: int) -> subprocess.CompletedProcess:
        return subprocess.run([*dynamo_cmd(), "scale", "EchoWorker", str(n), "--json",
                               "--state-dir", str(graph.state)], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)

    up = scale(2)
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout) == {"component": "EchoWorker", "replicas": 2}
    assert scale(1).returncode == 0
    missing = subprocess.run([*dynamo_cmd(), "scale", "Nope", "1", "--state-dir",
                              str(graph.state)], cwd=REPO, capture_output=True, text=True,
                             timeout=60, check=False)
    assert missing.returncode == 4 and "no component 'Nope'" in missing.stderr
