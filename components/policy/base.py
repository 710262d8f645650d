"""The base model of every policy section, and the helper its cross-field checks use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ConfigDict, ValidationError
from pydantic_core import InitErrorDetails

from splitserve.contracts.models import StrictModel
from splitserve.contracts.validation import Loc, issue


class PolicyModel(StrictModel):
    """A policy section: unknown keys refused, no type coercion, immutable once loaded.

    ``strict`` keeps YAML's ``"80"`` from becoming ``80`` silently; ``frozen`` because a
    loaded policy is shared between the watcher and the component applying it.
    """

    model_config = ConfigDict(strict=True, frozen=True)


def check(lines: Sequence[InitErrorDetails]) -> None:
    """Raise the collected cross-field problems of one model validator, if any.

    Called at the end of an ``after`` model validator.  Raising a ``ValidationError``
    there makes pydantic nest each line under the model's own path, so a problem in
    ``autoscale.prefill`` reads ``autoscale.prefill.min_replicas: ...``.
    """
    if lines:
        raise ValidationError.from_exception_data("policy", list(lines))


def problem(loc: Loc, message: str, value: Any) -> InitErrorDetails:
    """One cross-field problem at ``loc`` (relative to the model being checked)."""
    return issue(loc, message, value)
