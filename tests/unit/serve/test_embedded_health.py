"""The embedded servers' health probe on a port that another server answers (a port race
between graphs starting together): not healthy, not a crash of the start."""

from __future__ import annotations

import socket
import threading

import pytest

from splitserve.infra.embedded import _Server

pytestmark = pytest.mark.unit


def test_a_foreign_server_on_the_health_port_is_not_healthy(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def answer_like_nats():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b'INFO {"server_id":"x","version":"2.15.1"}\r\n')
            conn.recv(1024)

    t = threading.Thread(target=answer_like_nats, daemon=True)
    t.start()
    try:
        srv = _Server("etcd", [], f"http://127.0.0.1:{port}/health", '"health":"true"',
                      tmp_path / "etcd.log")
        assert srv.healthy() is False
    finally:
        t.join(5)
        listener.close()
