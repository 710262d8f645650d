"""Base models shared by every config, policy and wire message."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A pydantic model that refuses unknown keys.

    Used for every file a person writes (configs, policies) so that a typo is an
    error naming the field path instead of a setting that quietly does nothing.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WireModel(BaseModel):
    """A message crossing a process boundary: strict keys, explicit version field."""

    model_config = ConfigDict(extra="forbid")
