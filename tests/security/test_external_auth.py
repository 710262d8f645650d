"""`dynamo serve` against external etcd and NATS that require credentials.

Real servers on loopback: etcd with authentication enabled (user root) and NATS with a
user and password.  The credentials are given only inside the URLs (with characters that
must be percent-escaped); the graph must come up, which proves that Dynamo's runtime and
this project's clients all received them, and no URL it prints or registers carries them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.contracts.kit.connect import connect_nats
from splitserve.contracts.kit.etcd import get_prefix
from splitserve.contracts.kit.procs import find_binary, free_port, kill_pid
from tests.fixtures.echo_front import ECHO_TOKEN
from tests.integration.serve_helpers import ServeRun, http_get_json

pytestmark = [pytest.mark.security, pytest.mark.integration]

ETCD_USER, ETCD_PASS = "root", "r00t:pw"
NATS_USER, NATS_PASS = "app", "p@ss/w0rd"
ESCAPED = {"r00t:pw": "r00t%3Apw", "p@ss/w0rd": "p%40ss%2Fw0rd"}


def wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s}s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(etcd URL, NATS URL), both without credentials; the servers require them."""
    tmp = tmp_path_factory.mktemp("authinfra")
    c, p, n = free_port(), free_port(), free_port()
    etcd_url, nats_url = f"http://127.0.0.1:{c}", f"nats://127.0.0.1:{n}"
    procs = [subprocess.Popen(
        [find_binary("etcd"), "--name", "n", "--data-dir", str(tmp / "etcd"),
         "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
         "--listen-peer-urls", f"http://127.0.0.1:{p}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
         "--initial-cluster", f"n=http://127.0.0.1:{p}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    procs.append(subprocess.Popen(
        [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(n), "-js", "-sd", str(tmp / "js"),
         "--user", NATS_USER, "--pass", NATS_PASS],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        ctl = [find_binary("etcdctl"), "--endpoints", etcd_url]
        env = {**os.environ, "ETCDCTL_API": "3"}

        def etcdctl(*args: str, user: bool = False) -> subprocess.CompletedProcess:
            extra = ["--user", f"{ETCD_USER}:{ETCD_PASS}"] if user else []
            return subprocess.run([*ctl, *extra, *args], env=env, capture_output=True,
                                  text=True, timeout=20, check=False)

        wait(lambda: etcdctl("endpoint", "health").returncode == 0, 20, "etcd health")
        assert etcdctl("user", "add", f"{ETCD_USER}:{ETCD_PASS}").returncode == 0
        assert etcdctl("user", "grant-role", ETCD_USER, "root").returncode == 0
        assert etcdctl("auth", "enable").returncode == 0
        assert etcdctl("get", "x").returncode != 0  # anonymous access is now refused
        yield etcd_url, nats_url
    finally:
        for proc in procs:
            kill_pid(proc.pid, 5.0)
            proc.wait(10)


def with_credentials(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://")
    return f"{scheme}://{user}:{ESCAPED[password]}@{rest}"


def test_graph_comes_up_with_credentials_given_only_in_the_urls(servers, tmp_path,
                                                                monkeypatch):
    etcd_url, nats_url = servers
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ETCD_", "NATS_"))}
    run = ServeRun(tmp_path, "tests.fixtures.echo_graph:EchoFront",
                   "--etcd", with_credentials(etcd_url, ETCD_USER, ETCD_PASS),
                   "--nats", with_credentials(nats_url, NATS_USER, NATS_PASS), env=env)
    try:
        rows = run.wait_ready(90)["rows"]
        front = next(r["endpoint"] for r in rows if r["component"] == "EchoFront")
        code, body = http_get_json(f"{front}/echo/secret", token=ECHO_TOKEN)
        assert code == 200 and body["text"] == "secret"
        info = run.info()
        assert (info["etcd"], info["nats"]) == (etcd_url, nats_url)
        for text in (json.dumps(info), run.output()):
            assert ESCAPED[ETCD_PASS] not in text and ETCD_PASS not in text
            assert ESCAPED[NATS_PASS] not in text and NATS_PASS not in text

        for k in [k for k in os.environ if k.startswith(("ETCD_", "NATS_"))]:
            monkeypatch.delenv(k)
        with pytest.raises(Exception):  # noqa: B017 - any refusal from etcd
            asyncio.run(get_prefix(etcd_url, "v1/instances/"))
        monkeypatch.setenv("ETCD_AUTH_USERNAME", ETCD_USER)
        monkeypatch.setenv("ETCD_AUTH_PASSWORD", ETCD_PASS)
        keys = [k for k, _ in asyncio.run(get_prefix(etcd_url, "v1/instances/"))]
        assert any("echoworker" in k for k in keys)

        async def nats_roundtrip() -> bool:
            nc = await connect_nats(with_credentials(nats_url, NATS_USER, NATS_PASS),
                                    allow_reconnect=False)
            try:
                return nc.is_connected
            finally:
                await nc.close()

        assert asyncio.run(nats_roundtrip())
        assert run.stop() == 0
    finally:
        run.kill_all()


def test_dynamo_status_accepts_credentials_in_the_url(servers, tmp_path):
    etcd_url, _ = servers
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "NATS_"))}
    from tests.integration.serve_helpers import REPO, dynamo_cmd

    out = subprocess.run([*dynamo_cmd(), "status", "--json", "--state-dir", str(tmp_path),
                          "--etcd", with_credentials(etcd_url, ETCD_USER, ETCD_PASS)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    report = json.loads(out.stdout)
    assert report["unreachable"] == [], out.stderr
    assert list(report["etcd"]) == [etcd_url]  # listed without its credentials
    assert ESCAPED[ETCD_PASS] not in out.stdout


def _ca_and_server_cert(tmp: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it."""
    ext = tmp / "san.cnf"
    ext.write_text("[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=IP:127.0.0.1\n"
                   "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp / "ca.key"),
        "-out", str(tmp / "ca.pem"), "-days", "1", "-subj", "/CN=test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp / "srv.key"), "-out",
        str(tmp / "srv.csr"), "-subj", "/CN=127.0.0.1")
    ssl("x509", "-req", "-in", str(tmp / "srv.csr"), "-CA", str(tmp / "ca.pem"), "-CAkey",
        str(tmp / "ca.key"), "-CAcreateserial", "-out", str(tmp / "srv.pem"), "-days", "1",
        "-extfile", str(ext), "-extensions", "ext")
    return tmp / "ca.pem", tmp / "srv.pem", tmp / "srv.key"


def test_our_etcd_client_speaks_tls_with_the_configured_ca(tmp_path, monkeypatch):
    ca, cert, key = _ca_and_server_cert(tmp_path)
    c, p = free_port(), free_port()
    url = f"https://127.0.0.1:{c}"
    proc = subprocess.Popen(
        [find_binary("etcd"), "--name", "n", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{p}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
         "--initial-cluster", f"n=http://127.0.0.1:{p}",
         "--cert-file", str(cert), "--key-file", str(key)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for k in [k for k in os.environ if k.startswith("ETCD_")]:
            monkeypatch.delenv(k)
        monkeypatch.setenv("ETCD_AUTH_CA", str(ca))

        def answers() -> bool:
            try:
                return asyncio.run(get_prefix(url, "v1/")) == []
            except Exception:  # noqa: BLE001 - not up yet
                return False

        wait(answers, 20, "etcd over TLS")
        monkeypatch.delenv("ETCD_AUTH_CA")
        with pytest.raises(Exception):  # noqa: B017 - now the server's CA is not trusted
            asyncio.run(get_prefix(url, "v1/"))
    finally:
        kill_pid(proc.pid, 5.0)
        proc.wait(10)
