"""Who the control endpoint answers: the refusal rules, and the secret files."""

from __future__ import annotations

import os
import stat

import pytest

from splitserve.serve.control import ControlServer, check_request
from splitserve.contracts.kit.credentials import read_secret, write_secret
from splitserve.contracts.kit.listeners import listener_env

pytestmark = pytest.mark.unit

TOKEN = "t" * 43
OK = {"authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json", "content-length": "15"}


@pytest.mark.parametrize("headers,expected", [
    (OK, None),
    ({**OK, **JSON}, None),
    ({**OK, "content-type": "application/json; charset=utf-8", "content-length": "2"}, None),
    ({"authorization": f"bearer {TOKEN}"}, None),
    ({}, 401),
    ({"authorization": TOKEN}, 401),
    ({"authorization": f"Bearer {TOKEN[:-1]}"}, 401),
    ({"authorization": f"Bearer {TOKEN}x"}, 401),
    ({"authorization": "Basic dXNlcjpwYXNz"}, 401),
    ({**OK, "content-type": "text/plain", "content-length": "15"}, 415),
    ({**OK, "content-length": "15"}, 415),
    ({**OK, "content-type": "application/x-www-form-urlencoded", "content-length": "3"}, 415),
    ({**OK, "content-type": "application/json", "content-length": str(10**6)}, 413),
    ({**OK, **JSON, "origin": "http://evil.example"}, 403),
    ({**OK, "origin": "null"}, 403),
    ({"origin": "http://evil.example", "content-type": "text/plain"}, 403),
])
def test_refusal_rules(headers, expected):
    refused = check_request(headers, TOKEN)
    assert (refused[0] if refused else None) == expected


def test_a_short_token_is_refused_at_construction():
    async def handler(method, path, body):
        return 200, {}

    with pytest.raises(ValueError):
        ControlServer(handler, "short")


def test_secret_files_are_created_0600_and_never_overwritten(tmp_path):
    path = tmp_path / "control.token"
    token = write_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret(path) == token and len(token) >= 32
    with pytest.raises(FileExistsError):
        write_secret(path)
    assert write_secret(tmp_path / "other") != token


def test_a_secret_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "key"
    write_secret(path)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_secret(path)


def test_listener_env_keeps_everything_on_loopback_by_default():
    env = listener_env("127.0.0.1")
    for name in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST",
                 "DYN_EVENT_PLANE_HOST"):
        assert env[name] == "127.0.0.1"
    assert env["UCX_NET_DEVICES"] == "lo"


def test_listener_env_opens_to_the_given_address():
    env = listener_env("10.0.0.5")
    assert env["DYN_TCP_RPC_HOST"] == env["DYN_TCP_RESPONSE_STREAM_HOST"] == "10.0.0.5"
    assert env["UCX_NET_DEVICES"] == "all"
    assert listener_env("::1")["UCX_NET_DEVICES"] == "lo"


def test_the_default_state_dir_must_be_private(tmp_path, monkeypatch):
    import tempfile

    from splitserve.cli.paths import UnsafeStateDir, state_root

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    root = state_root(None)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    root.chmod(0o777)  # as if created by someone else for everybody
    with pytest.raises(UnsafeStateDir):
        state_root(None)
    assert state_root(str(tmp_path / "explicit")) == tmp_path / "explicit"




def test_the_cli_sends_the_token_only_to_a_loopback_address(tmp_path):
    """Only a literal loopback address gets the token (a host name could resolve
    anywhere); checked with a recording server on 127.0.0.1."""
    import http.server
    import threading

    from splitserve.serve.control import supervisor_status

    seen: list[str] = []

    class Record(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization", ""))
            body = b'{"replicas": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Record)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token_file = tmp_path / "control.token"
    token = write_secret(token_file)
    try:
        port = server.server_port
        named = {"control": f"http://localhost:{port}", "token_file": str(token_file)}
        assert supervisor_status(named) is None and seen == []
        literal = {"control": f"http://127.0.0.1:{port}", "token_file": str(token_file)}
        assert supervisor_status(literal) == {"replicas": []}
        assert seen == [f"Bearer {token}"]
    finally:
        server.shutdown()
        server.server_close()
