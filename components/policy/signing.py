"""Signed policy versions: only the holder of the graph's policy key can change routing.

Anyone who can write to etcd could otherwise hot-load a policy into every router and
decode worker.  `dynamo policy apply` and `rollback` sign each version with HMAC-SHA256
under a per-graph secret (the ``policy.key`` file, 0600, in the run directory of
`dynamo serve`, or the operator's own file given with ``--policy-key-file`` /
SPLITSERVE_POLICY_KEY_FILE); components verify the signature before applying and refuse,
and report through `dynamo policy show`, a version that is unsigned, signed with another
key, or whose content does not match its hash.

The signed message binds the namespace and the version number to the content hash, so
a signed version can be neither moved to another namespace nor replayed as another
version number.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from .records import PolicyVersion

ALGORITHM = "hmac-sha256"


class PolicyKey:
    """The secret that signs and verifies policy versions of one graph."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a policy key needs at least 16 bytes")
        self._secret = secret

    @classmethod
    def from_file(cls, path: Path | str) -> PolicyKey:
        """Read a key file (refused when others can read it)."""
        from splitserve.contracts.kit.credentials import read_secret

        return cls(read_secret(path).encode())

    def sign(self, namespace: str, record: PolicyVersion) -> str:
        """Return the signature of ``record`` (its ``signature`` field is ignored)."""
        return f"{ALGORITHM}:" + hmac.new(self._secret, _message(namespace, record),
                                          hashlib.sha256).hexdigest()

    def check(self, namespace: str, record: PolicyVersion) -> str | None:
        """Why ``record`` must not be applied, or None when its signature is valid."""
        if not record.signature:
            return "unsigned policy version (apply it with `dynamo policy apply`, which signs)"
        if not hmac.compare_digest(record.signature.encode(),
                                   self.sign(namespace, record).encode()):
            return "policy signature does not verify (signed with another key, or altered)"
        return None


def _message(namespace: str, record: PolicyVersion) -> bytes:
    fields = {"namespace": namespace, "version": record.version, "sha256": record.sha256,
              "author": record.author, "source": record.source,
              "rollback_of": record.rollback_of,
              "created_at": record.created_at.isoformat()}
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
