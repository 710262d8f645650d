"""Decider ``forced``: always remote or always local, for tests and benchmarks."""

from __future__ import annotations

from pydantic import Field

from splitserve.contracts.models import StrictModel

from .types import OffloadDecision, OffloadRequest, OffloadSnapshot

TYPE_NAME = "forced"


class Params(StrictModel):
    """Parameters of the ``forced`` decider."""

    remote: bool = Field(description="True: always prefill remotely; False: always locally.")


class ForcedDecider:
    """Ignores the inputs; reason 'forced-remote' or 'forced-local'.

    The pool check still applies when built through ``build_decider``: with no live prefill
    worker even a forced-remote policy prefills locally.
    """

    def __init__(self, params: Params) -> None:
        self._remote = params.remote

    def decide(self, request: OffloadRequest, snapshot: OffloadSnapshot) -> OffloadDecision:
        """Called per request; returns the fixed answer."""
        return OffloadDecision(remote=self._remote,
                               reason="forced-remote" if self._remote else "forced-local")
