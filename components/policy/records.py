"""What the policy store keeps in etcd: key layout and the typed records under it.

Layout under ``splitserve/<namespace>/policy/``::

    versions/000001          PolicyVersion (JSON), written once, never changed
    current                  CurrentPointer (JSON): the version components should run
    status/<component>/<instance>
                             ComponentStatus (JSON), on the instance's lease

Version numbers are zero-padded so that key order is version order.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from splitserve.contracts.models import WireModel

FORMAT = 1  # bumped when a record's layout changes incompatibly
_PAD = 6


@dataclass(frozen=True)
class PolicyKeys:
    """The etcd keys of one namespace's policy; built by the store and the watcher."""

    namespace: str

    @property
    def root(self) -> str:
        """Prefix of every policy key of the namespace (ends with '/')."""
        return f"splitserve/{self.namespace}/policy/"

    @property
    def current(self) -> str:
        """The pointer to the version in force."""
        return self.root + "current"

    @property
    def versions(self) -> str:
        """Prefix of the immutable versions."""
        return self.root + "versions/"

    @property
    def statuses(self) -> str:
        """Prefix of the per-instance apply statuses."""
        return self.root + "status/"

    def version(self, number: int) -> str:
        """Key of version ``number``."""
        return f"{self.versions}{number:0{_PAD}d}"

    def status(self, component: str, instance: str) -> str:
        """Key of one component instance's status."""
        return f"{self.statuses}{component}/{instance}"


class PolicyVersion(WireModel):
    """One stored version: the canonical policy and who applied it, when and from where."""

    format: Literal[1] = Field(default=FORMAT, description="Record layout version.")
    version: int = Field(ge=1, description="Version number, 1 for the first apply.")
    created_at: datetime = Field(description="When it was applied (UTC).")
    source: str = Field(description="File it came from, or 'rollback to vN'.")
    author: str = Field(description="Who applied it.")
    sha256: str = Field(description="SHA-256 of the canonical JSON of `policy`.")
    rollback_of: int | None = Field(default=None, description="Version whose content this "
                                                              "rollback restored.")
    policy: dict[str, Any] = Field(description="The canonical policy document.")
    signature: str | None = Field(default=None, description="HMAC of the version's "
                                  "metadata and hash under the graph's policy key; "
                                  "components refuse a version without a valid one.")

    def summary(self) -> dict[str, Any]:
        """Return the metadata without the policy, for history listings."""
        return self.model_dump(mode="json", exclude={"policy"})


class CurrentPointer(WireModel):
    """Value of the ``current`` key."""

    format: Literal[1] = Field(default=FORMAT, description="Record layout version.")
    version: int = Field(ge=1, description="Version in force.")
    sha256: str = Field(description="Its hash, so watchers can skip a version they hold.")


class ComponentStatus(WireModel):
    """What one component instance runs, published by its watcher after each attempt."""

    format: Literal[1] = Field(default=FORMAT, description="Record layout version.")
    component: str = Field(description="Component name (e.g. Router, DecodeWorker).")
    instance: str = Field(description="Instance id within the component.")
    running_version: int | None = Field(description="Version in effect; None: none yet.")
    last_version: int | None = Field(description="Version of the last attempt.")
    ok: bool = Field(description="Whether the last attempt applied.")
    reason: str = Field(description="Why the last attempt failed, or 'applied'.")
    updated_at: datetime = Field(description="When this status was written (UTC).")
