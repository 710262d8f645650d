"""Credentials and TLS for etcd and NATS: one description, handed to every client.

Dynamo's runtime, our aetcd clients and our nats-py clients must all use the same
credentials.  The supervisor passes them to its processes in the environment variables
Dynamo's runtime reads (``ETCD_AUTH_*``, ``NATS_AUTH_*``, ``NATS_TLS_*``), and every
client of this project builds its connection from those same variables here, so no
component opens etcd or NATS any other way.

Credentials written into a URL (``https://user:pass@host:2379``, ``nats://user:pass@h``)
are taken out of it: the URL that is logged, shown by ``dynamo status`` and put in
``ETCD_ENDPOINTS`` / ``NATS_SERVER`` carries none.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit


class AccessError(ValueError):
    """An etcd or NATS address or credential setting is inconsistent."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for TLS: the CA that signs the server, and an optional client identity."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    def check(self, what: str) -> None:
        """Raise AccessError when only one of cert and key is given or a file is missing."""
        if bool(self.cert) != bool(self.key):
            raise AccessError(f"{what}: a client certificate and its key go together; "
                              "give both or neither")
        for path in (self.ca, self.cert, self.key):
            if path and not os.path.isfile(path):
                raise AccessError(f"{what}: TLS file {path} does not exist")

    def ssl_context(self) -> ssl.SSLContext:
        """A client SSL context trusting ``ca`` (else the system store) with the identity."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert and self.key:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``scheme://user:pass@host:port`` -> (``scheme://host:port``, user, password).

    Percent-escapes in the user and password are decoded (``p%40ss`` is ``p@ss``).
    """
    parts = urlsplit(url if "://" in url else "//" + url)
    if parts.username is None and parts.password is None:
        return url, None, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    if "://" not in url:
        clean = clean[2:]
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return clean, user, password


def _merge_user(what: str, urls: list[str], user: str | None, password: str | None
                ) -> tuple[list[str], str | None, str | None]:
    clean = []
    for url in urls:
        c, u, p = split_credentials(url)
        clean.append(c)
        if u is None and p is None:
            continue
        if (user, password) not in ((None, None), (u, p)):
            raise AccessError(f"{what}: two different credentials given (in the URL and "
                              "in the settings or in two URLs); give them once")
        user, password = u, p
    if password and not user:
        raise AccessError(f"{what}: a password needs a user name")
    return clean, user, password


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach etcd: credential-free endpoints, optional user/password and TLS."""

    endpoints: str
    username: str | None = None
    password: str | None = None
    tls: TlsFiles = TlsFiles()

    @classmethod
    def parse(cls, endpoints: str, username: str | None = None, password: str | None = None,
              tls: TlsFiles = TlsFiles()) -> EtcdAccess:
        """Take credentials out of ``endpoints`` (comma-separated URLs) and check them."""
        urls = [u.strip() for u in endpoints.split(",") if u.strip()]
        if not urls:
            raise AccessError("etcd: no endpoint given")
        clean, user, pw = _merge_user("etcd", urls, username, password)
        if user and not pw:
            raise AccessError("etcd: user name given without a password")
        tls.check("etcd")
        if tls.enabled and any(u.startswith("http://") for u in clean):
            raise AccessError("etcd: TLS files are set but an endpoint uses http://; "
                              "use https://")
        return cls(",".join(clean), user, pw, tls)

    @classmethod
    def from_env(cls, env: Mapping[str, str], endpoints: str | None = None) -> EtcdAccess:
        """Read the variables Dynamo's runtime reads; ``endpoints`` overrides ETCD_ENDPOINTS."""
        eps = endpoints or env.get("ETCD_ENDPOINTS") or "http://127.0.0.1:2379"
        tls = TlsFiles(env.get("ETCD_AUTH_CA") or None, env.get("ETCD_AUTH_CLIENT_CERT") or None,
                       env.get("ETCD_AUTH_CLIENT_KEY") or None)
        return cls.parse(eps, env.get("ETCD_AUTH_USERNAME") or None,
                         env.get("ETCD_AUTH_PASSWORD") or None, tls)

    def env(self) -> dict[str, str]:
        """Environment for Dynamo's runtime and our clients in a component process."""
        out = {"ETCD_ENDPOINTS": self.endpoints}
        for name, value in (("ETCD_AUTH_USERNAME", self.username),
                            ("ETCD_AUTH_PASSWORD", self.password),
                            ("ETCD_AUTH_CA", self.tls.ca),
                            ("ETCD_AUTH_CLIENT_CERT", self.tls.cert),
                            ("ETCD_AUTH_CLIENT_KEY", self.tls.key)):
            if value:
                out[name] = value
        return out

    @property
    def secure(self) -> bool:
        return self.tls.enabled or self.endpoints.startswith("https://")

    def first_host_port(self) -> tuple[str, int]:
        """Host and port of the first endpoint (aetcd talks to one)."""
        first = self.endpoints.split(",")[0]
        u = urlsplit(first if "://" in first else "http://" + first)
        return u.hostname or "127.0.0.1", u.port or 2379


@dataclass(frozen=True)
class NatsAccess:
    """How to reach NATS: a credential-free URL, one way to authenticate, optional TLS."""

    server: str
    user: str | None = None
    password: str | None = None
    token: str | None = None
    credentials_file: str | None = None
    tls: TlsFiles = TlsFiles()
    nkey_seed: str | None = None

    @classmethod
    def parse(cls, server: str, *, user: str | None = None, password: str | None = None,
              token: str | None = None, credentials_file: str | None = None,
              tls: TlsFiles = TlsFiles(), nkey_seed: str | None = None) -> NatsAccess:
        """Take credentials out of ``server`` and check that one way is chosen."""
        urls = [u.strip() for u in server.split(",") if u.strip()]
        if not urls:
            raise AccessError("NATS: no server given")
        if user and not password:
            raise AccessError("NATS: user name given without a password")
        clean, url_user, url_password = _merge_user("NATS", urls, None, None)
        if url_user and not url_password:  # nats://TOKEN@host: NATS's token-in-URL form
            if token not in (None, url_user):
                raise AccessError("NATS: two different tokens given; give it once")
            token, url_user = url_user, None
        if url_user:
            if (user, password) not in ((None, None), (url_user, url_password)):
                raise AccessError("NATS: two different credentials given (in the URL and "
                                  "in the settings); give them once")
            user, password = url_user, url_password
        ways = [w for w in (user, token, credentials_file, nkey_seed) if w]
        if len(ways) > 1:
            raise AccessError("NATS: choose one of user/password, token, NKey seed or a "
                              "credentials file")
        if credentials_file and not os.path.isfile(credentials_file):
            raise AccessError(f"NATS: credentials file {credentials_file} does not exist")
        tls.check("NATS")
        if tls.enabled and not all(u.startswith("tls://") for u in clean):
            raise AccessError("NATS: TLS files are set but the server URL does not use "
                              "tls:// (Dynamo's runtime requires it)")
        return cls(",".join(clean), user, password, token, credentials_file, tls, nkey_seed)

    @classmethod
    def from_env(cls, env: Mapping[str, str], server: str | None = None) -> NatsAccess:
        """Read the variables Dynamo's runtime reads; ``server`` overrides NATS_SERVER."""
        tls = TlsFiles(env.get("NATS_TLS_CA_CERT_PATH") or None,
                       env.get("NATS_TLS_CLIENT_CERT_PATH") or None,
                       env.get("NATS_TLS_CLIENT_KEY_PATH") or None)
        return cls.parse(server or env.get("NATS_SERVER") or "nats://127.0.0.1:4222",
                         user=env.get("NATS_AUTH_USERNAME") or None,
                         password=env.get("NATS_AUTH_PASSWORD") or None,
                         token=env.get("NATS_AUTH_TOKEN") or None,
                         credentials_file=env.get("NATS_AUTH_CREDENTIALS_FILE") or None, tls=tls,
                         nkey_seed=env.get("NATS_AUTH_NKEY") or None)

    def env(self) -> dict[str, str]:
        """Environment for Dynamo's runtime and our clients in a component process."""
        out = {"NATS_SERVER": self.server}
        for name, value in (("NATS_AUTH_USERNAME", self.user),
                            ("NATS_AUTH_PASSWORD", self.password),
                            ("NATS_AUTH_TOKEN", self.token),
                            ("NATS_AUTH_CREDENTIALS_FILE", self.credentials_file),
                            ("NATS_AUTH_NKEY", self.nkey_seed),
                            ("NATS_TLS_CA_CERT_PATH", self.tls.ca),
                            ("NATS_TLS_CLIENT_CERT_PATH", self.tls.cert),
                            ("NATS_TLS_CLIENT_KEY_PATH", self.tls.key)):
            if value:
                out[name] = value
        return out

    def connect_options(self) -> dict:
        """Keyword arguments for ``nats.connect`` (servers, auth, TLS)."""
        opts: dict = {"servers": self.server.split(",")}
        if self.user:
            opts.update(user=self.user, password=self.password)
        if self.token:
            opts["token"] = self.token
        if self.credentials_file:
            opts["user_credentials"] = self.credentials_file
        if self.nkey_seed:
            opts["nkeys_seed_str"] = self.nkey_seed
        if self.tls.enabled or self.server.startswith("tls://"):
            opts["tls"] = self.tls.ssl_context()
        return opts


async def connect_nats(url: str | None = None, **options):
    """Open a nats-py connection with the process's NATS credentials and TLS.

    ``url`` defaults to NATS_SERVER; credentials come from the ``NATS_AUTH_*`` and
    ``NATS_TLS_*`` variables the supervisor set (or from the URL itself).  ``options``
    are passed to ``nats.connect`` (name, reconnect settings, timeouts).
    """
    import nats

    access = NatsAccess.from_env(os.environ, url)
    return await nats.connect(**access.connect_options(), **options)


async def close_nats(nc, what: str) -> None:
    """Drain a nats-py connection at shutdown, or close it when it cannot drain.

    A connection that is reconnecting (NATS restarted, or already stopped because the
    graph's infrastructure goes last) refuses ``drain`` with ConnectionReconnectingError;
    a process must still stop cleanly then, with nothing left to flush.
    """
    import logging

    try:
        if nc.is_connected:
            await nc.drain()
            return
    except Exception as exc:  # noqa: BLE001 - stopping: say so and close below
        logging.getLogger("splitserve.nats").info("could not drain the %s connection (%s); "
                                                  "closing it", what, exc)
    try:
        await nc.close()
    except Exception as exc:  # noqa: BLE001 - the process is stopping anyway
        logging.getLogger("splitserve.nats").info("closing the %s connection failed: %s",
                                                  what, exc)
