"""etcd/NATS health: the tracker's states, the probes against real sockets, the
frontend's readiness and error type during an outage, and `dynamo status`'s verdict."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn

import pytest
from starlette.testclient import TestClient

from splitserve.cli.status_cmd import dependencies_down
from splitserve.components.frontend.app import FrontendState, build_app
from splitserve.components.frontend.errors import overloaded
from splitserve.contracts.kit.health import (
    DependencyMonitor,
    DependencyTracker,
    Prober,
    probe_etcd,
    probe_nats,
)
from splitserve.contracts.kit.procs import free_port

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rounds, down_after, expect_down, expect_changes", [
    ([{"etcd": True, "nats": True}], 1, [], [[]]),
    ([{"etcd": True, "nats": False}], 1, ["nats"], [["nats"]]),
    ([{"nats": False}, {"nats": True}], 1, [], [["nats"], ["nats"]]),
    ([{"etcd": False}, {"etcd": False}], 2, ["etcd"], [[], ["etcd"]]),
    ([{"etcd": False}, {"etcd": True}, {"etcd": False}], 2, [], [[], [], []]),
    ([{"etcd": False, "nats": False}], 1, ["etcd", "nats"], [["etcd", "nats"]]),
])
def test_tracker_states(rounds, down_after, expect_down, expect_changes):
    t = DependencyTracker(down_after=down_after, now=0.0)
    changes = [t.update(r, now=float(i + 1)) for i, r in enumerate(rounds)]
    assert changes == expect_changes
    assert t.down() == expect_down


def test_tracker_mark_down_records_since_once():
    t = DependencyTracker(now=0.0)
    assert t.mark_down("nats", now=5.0) is True
    assert t.mark_down("nats", now=6.0) is False
    rows = {r["name"]: r for r in t.rows(now=8.0)}
    assert rows["nats"] == {"name": "nats", "state": "down", "for_s": 3.0, "restarts": 0}
    assert rows["etcd"]["state"] == "up"


class _Greeter:
    """A TCP listener that greets like a NATS server (or says something else)."""

    def __init__(self, greeting: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.greeting = greeting
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.greeting)


def _etcd_like(body: bytes) -> HTTPServer:
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_probe_nats_needs_the_info_greeting():
    good, other = _Greeter(b'INFO {"server_id":"x"}\r\n'), _Greeter(b"HTTP/1.1 400\r\n")
    try:
        assert probe_nats(f"nats://127.0.0.1:{good.port}")
        assert probe_nats(f"127.0.0.1:{good.port},nats://127.0.0.1:1")  # first of a list
        assert not probe_nats(f"nats://127.0.0.1:{other.port}")
        assert not probe_nats(f"nats://127.0.0.1:{free_port()}", timeout_s=0.3)
    finally:
        good.sock.close()
        other.sock.close()


def test_probe_etcd_reads_health():
    healthy, sick = _etcd_like(b'{"health":"true"}'), _etcd_like(b'{"health":"false"}')
    try:
        assert probe_etcd(f"http://127.0.0.1:{healthy.server_port}")
        assert not probe_etcd(f"http://127.0.0.1:{sick.server_port}")
        assert not probe_etcd(f"http://127.0.0.1:{free_port()}", timeout_s=0.3)
    finally:
        for srv in (healthy, sick):
            srv.shutdown()
            srv.server_close()


class _KeptAlive(ThreadingMixIn, HTTPServer):
    """An etcd-like /health over HTTP/1.1 keep-alive that counts its connections; it
    can drop every open connection (as a restarted etcd would)."""

    daemon_threads = True

    def __init__(self, body: bytes) -> None:
        self.connections = 0
        self.open: list[socket.socket] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                outer.connections += 1
                outer.open.append(self.request)
                super().setup()

            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def drop_connections(self) -> None:
        for conn in self.open:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.open.clear()


def test_prober_asks_etcd_over_one_kept_connection_and_survives_its_loss():
    srv = _KeptAlive(b'{"health":"true"}')
    prober = Prober()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        assert all(prober.etcd(url) for _ in range(20))
        assert srv.connections == 1
        srv.drop_connections()  # the kept connection is gone: asked again on a new one
        assert prober.etcd(url)
        assert srv.connections == 2
    finally:
        prober.close()
        srv.shutdown()
        srv.server_close()
    assert not prober.etcd(url, timeout_s=0.3)  # nothing listens: a failed probe


def test_prober_reads_health_as_the_one_shot_probe_does():
    healthy, sick = _etcd_like(b'{"health":"true"}'), _etcd_like(b'{"health":"false"}')
    prober = Prober()
    try:  # HTTP/1.0 servers close each connection: a new one per probe
        assert prober.etcd(f"http://127.0.0.1:{healthy.server_port}")
        assert prober.etcd(f"127.0.0.1:{healthy.server_port}")
        assert not prober.etcd(f"http://127.0.0.1:{sick.server_port}")
        assert prober.etcd(f"http://127.0.0.1:{healthy.server_port}")  # another address
        assert prober(f"http://127.0.0.1:{healthy.server_port}", f"127.0.0.1:{free_port()}",
                      0.3) == {"etcd": True, "nats": False}
    finally:
        prober.close()
        for srv in (healthy, sick):
            srv.shutdown()
            srv.server_close()


def test_monitor_reports_what_the_probe_says():
    results = {"etcd": True, "nats": True}
    mon = DependencyMonitor("e", "n", prober=lambda e, n: dict(results))

    async def scenario():
        assert await mon.poll_once() == [] and mon.down() == []
        results["nats"] = False
        assert await mon.poll_once() == ["nats"] and mon.down() == ["nats"]
        results["nats"] = True
        await mon.poll_once()
        return mon.down()

    assert asyncio.run(scenario()) == []


def test_status_names_dependencies_down_by_report_or_probe():
    sup = {"etcd": f"http://127.0.0.1:{free_port()}", "nats": f"nats://127.0.0.1:{free_port()}"}
    assert dependencies_down(sup, None) == ["etcd", "nats"]
    assert dependencies_down({}, [{"name": "nats", "state": "down"},
                                  {"name": "etcd", "state": "up"}]) == ["nats"]
    assert dependencies_down({}, None) == []


class _Backend:
    """Refuses like a router with no eligible worker (the defect's `all-filtered`)."""

    def __init__(self) -> None:
        self.up = True

    def ready(self) -> bool:
        return self.up

    async def stream(self, call, meta, context):
        raise overloaded("no worker can take the request (all-filtered)", retry_after_s=2,
                         code="all-filtered")
        yield  # pragma: no cover - makes this an async generator


@pytest.fixture(scope="module")
def codec(smollm2_dir):
    from splitserve.components.frontend.textcodec import TextCodec

    return TextCodec.from_dir(smollm2_dir)


@pytest.mark.parametrize("stream", [False, True])
def test_frontend_during_an_outage(codec, stream):
    down: list[str] = []
    state = FrontendState(model_name="SmolLM2-135M-Instruct", codec=codec, backend=_Backend(),
                          dependencies_down=lambda: list(down))
    c = TestClient(build_app(state))
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 4, "stream": stream}
    assert c.get("/ready").status_code == 200
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_overloaded"

    down.append("nats")
    ready = c.get("/ready")
    assert ready.status_code == 503 and ready.json()["detail"] == "nats down"
    r = c.post("/v1/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 503 and err["type"] == "service_unavailable", err
    assert "nats is down" in err["message"] and int(r.headers["Retry-After"]) >= 2

    down.clear()
    assert c.get("/ready").status_code == 200


def test_free_port_binds_the_family_of_the_host_and_refuses_a_foreign_address():
    import socket

    assert free_port() > 0
    if socket.has_ipv6:
        try:
            port = free_port("::1")
        except OSError:  # a machine with IPv6 off has no ::1 to bind
            pytest.skip("no IPv6 loopback here")
        assert port > 0 and free_port("[::1]") > 0
    with pytest.raises(OSError):
        free_port("192.0.2.1")  # TEST-NET-1: never an address of this machine
