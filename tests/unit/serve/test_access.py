"""etcd/NATS addresses with credentials and TLS: parsed, never silently dropped."""

from __future__ import annotations

import ssl

import pytest

from splitserve.cli.serve_cmd import external_access
from splitserve.contracts.kit.connect import (
    AccessError,
    EtcdAccess,
    NatsAccess,
    TlsFiles,
    split_credentials,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("url,expected", [
    ("https://user:pass@h:2379", ("https://h:2379", "user", "pass")),
    ("http://h:2379", ("http://h:2379", None, None)),
    ("https://u%40x:p%3Aw%40@h:2379", ("https://h:2379", "u@x", "p:w@")),
    ("nats://tok@h:4222", ("nats://h:4222", "tok", None)),
    ("u:p@h:2379", ("h:2379", "u", "p")),
    ("https://u:p@[::1]:2379", ("https://[::1]:2379", "u", "p")),
])
def test_split_credentials(url, expected):
    assert split_credentials(url) == expected


def test_etcd_credentials_in_the_url_reach_the_runtime_env():
    a = EtcdAccess.parse("https://root:s3cret@etcd.example:2379")
    assert a.endpoints == "https://etcd.example:2379"
    env = a.env()
    assert env["ETCD_ENDPOINTS"] == "https://etcd.example:2379"
    assert (env["ETCD_AUTH_USERNAME"], env["ETCD_AUTH_PASSWORD"]) == ("root", "s3cret")
    assert "s3cret" not in env["ETCD_ENDPOINTS"]


def test_etcd_settings_from_env_and_url_must_agree():
    env = {"ETCD_AUTH_USERNAME": "a", "ETCD_AUTH_PASSWORD": "b"}
    assert EtcdAccess.from_env(env, "http://a:b@h:1").username == "a"
    with pytest.raises(AccessError, match="two different credentials"):
        EtcdAccess.from_env(env, "http://c:d@h:1")
    with pytest.raises(AccessError, match="without a password"):
        EtcdAccess.parse("http://h:1", username="only-user")


def test_etcd_tls_files_are_checked(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    a = EtcdAccess.from_env({"ETCD_AUTH_CA": str(ca)}, "https://h:2379")
    assert a.env()["ETCD_AUTH_CA"] == str(ca) and a.secure
    with pytest.raises(AccessError, match="does not exist"):
        EtcdAccess.parse("https://h:2379", tls=TlsFiles(ca=str(tmp_path / "nope.pem")))
    with pytest.raises(AccessError, match="go together"):
        EtcdAccess.parse("https://h:2379", tls=TlsFiles(cert=str(ca)))
    with pytest.raises(AccessError, match="use https://"):
        EtcdAccess.parse("http://h:2379", tls=TlsFiles(ca=str(ca)))


def test_nats_user_password_token_and_credentials_file(tmp_path):
    a = NatsAccess.parse("nats://app:pw@n:4222")
    assert a.server == "nats://n:4222"
    assert a.env()["NATS_AUTH_USERNAME"] == "app" and a.env()["NATS_AUTH_PASSWORD"] == "pw"
    assert a.connect_options() == {"servers": ["nats://n:4222"], "user": "app",
                                   "password": "pw"}
    t = NatsAccess.parse("nats://tok3n@n:4222")
    assert t.token == "tok3n" and t.env()["NATS_AUTH_TOKEN"] == "tok3n"
    assert t.connect_options()["token"] == "tok3n"
    creds = tmp_path / "app.creds"
    creds.write_text("x")
    c = NatsAccess.from_env({"NATS_AUTH_CREDENTIALS_FILE": str(creds)}, "nats://n:4222")
    assert c.connect_options()["user_credentials"] == str(creds)
    with pytest.raises(AccessError, match="choose one"):
        NatsAccess.parse("nats://a:b@n:4222", token="t")
    with pytest.raises(AccessError, match="without a password"):
        NatsAccess.from_env({"NATS_AUTH_USERNAME": "u"}, "nats://n:4222")


def test_nats_tls_needs_the_tls_scheme_and_gives_an_ssl_context(tmp_path):
    import subprocess

    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=test"],
                   check=True, capture_output=True)
    with pytest.raises(AccessError, match="tls://"):
        NatsAccess.parse("nats://n:4222", tls=TlsFiles(ca=str(cert)))
    a = NatsAccess.from_env({"NATS_TLS_CA_CERT_PATH": str(cert),
                             "NATS_TLS_CLIENT_CERT_PATH": str(cert),
                             "NATS_TLS_CLIENT_KEY_PATH": str(key)}, "tls://n:4222")
    assert isinstance(a.connect_options()["tls"], ssl.SSLContext)
    assert a.env()["NATS_TLS_CLIENT_KEY_PATH"] == str(key)


def test_serve_passes_url_credentials_on_instead_of_dropping_them(monkeypatch):
    for name in ("ETCD_AUTH_USERNAME", "ETCD_AUTH_PASSWORD", "NATS_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    etcd, nats = external_access("https://root:pw@e:2379", "nats://tok@n:4222")
    assert etcd.env()["ETCD_AUTH_PASSWORD"] == "pw" and etcd.endpoints == "https://e:2379"
    assert nats.env()["NATS_AUTH_TOKEN"] == "tok" and nats.server == "nats://n:4222"
    assert external_access(None, None) is None



def test_route_explain_hands_url_credentials_to_the_runtime(monkeypatch):
    from splitserve.cli.route_cmd import runtime_env

    for name in ("ETCD_AUTH_USERNAME", "ETCD_AUTH_PASSWORD", "NATS_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    env = runtime_env("https://u:p@e:2379", "nats://tok@n:4222")
    assert env == {"ETCD_ENDPOINTS": "https://e:2379", "ETCD_AUTH_USERNAME": "u",
                   "ETCD_AUTH_PASSWORD": "p", "NATS_SERVER": "nats://n:4222",
                   "NATS_AUTH_TOKEN": "tok"}
    assert runtime_env("http://e:2379", None) == {"ETCD_ENDPOINTS": "http://e:2379"}


def test_nats_nkey_seed_from_dynamos_variable():
    a = NatsAccess.from_env({"NATS_AUTH_NKEY": "SUSEED"}, "nats://n:4222")
    assert a.env()["NATS_AUTH_NKEY"] == "SUSEED"
    assert a.connect_options()["nkeys_seed_str"] == "SUSEED"
    with pytest.raises(AccessError, match="choose one"):
        NatsAccess.from_env({"NATS_AUTH_NKEY": "SUSEED", "NATS_AUTH_TOKEN": "t"},
                            "nats://n:4222")
