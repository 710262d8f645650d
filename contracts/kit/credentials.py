"""Per-run secrets of `dynamo serve`: the control token and the policy signing key.

Both are random, written once into the run directory with mode 0600 (the run directory
itself is 0700), and read back by the CLI commands of the same user.  Whoever can read
them is the graph's operator; nobody else on the machine can.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

CONTROL_TOKEN_FILE = "control.token"
POLICY_KEY_FILE = "policy.key"


def write_secret(path: Path, nbytes: int = 32) -> str:
    """Create ``path`` (0600, must not exist) holding a new random token; return it."""
    token = secrets.token_urlsafe(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_secret(path: Path | str) -> str:
    """Read a secret file; refuses one that another user owns or that others can read
    (raises PermissionError)."""
    p = Path(path)
    st = p.stat()
    mode = st.st_mode
    if st.st_uid != os.getuid():
        raise PermissionError(f"{p} belongs to another user (uid {st.st_uid})")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{p} is readable by others (mode {stat.S_IMODE(mode):o}); "
                              f"chmod 600 {p}")
    value = p.read_text().strip()
    if not value:
        raise ValueError(f"{p} is empty")
    return value


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (scheme in any
    case), compared in constant time; the one check of the control token, for the
    supervisor's control endpoint and the frontend's adapter endpoints alike."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())
