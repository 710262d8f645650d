"""The policy file: one strict document for routing, offload, QoS and autoscaling.

``load_policy_file`` is what the CLI and tests call; ``parse_policy`` validates a decoded
document (a file's content, or a version read back from etcd).  Every problem is
collected and reported as ``field.path: message``.  The ``disaggregated_router`` and
``router`` sections are validated by their own components' loaders, so a section that
loads in a component's config file loads here too, with the same messages.  The ``qos``
section is the QoS core's own ``QosConfig`` (see docs/qos.md), held to this file's no-coercion
rule.

Run ``python -m splitserve.components.policy configs`` from the repository root to rewrite
``configs/schemas/policy.schema.json``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from splitserve.components.disagg.config import parse_disaggregated_router
from splitserve.components.disagg.registry import DeciderRegistry, default_decider_registry
from splitserve.components.router.qos import QosConfig
from splitserve.components.router.builtin import BUILTIN_CONFIGS
from splitserve.components.router.config import parse_router_config
from splitserve.components.router.registry import PluginRegistry, default_registry

from .base import PolicyModel, check, problem
from .decode import DocumentError, decode_document
from .sections import Autoscale, CachePolicy, SplitPolicy

SCHEMA_FILE = "policy.schema.json"


@dataclass(frozen=True)
class PolicyRegistries:
    """The registries the ``router`` and ``disaggregated_router`` sections are checked
    against; a deployment with its own plugins passes its own to ``parse_policy``."""

    plugins: PluginRegistry = field(default_factory=default_registry)
    deciders: DeciderRegistry = field(default_factory=default_decider_registry)


class PolicyError(Exception):
    """A policy document that does not validate: ``errors`` holds ``path: message`` lines."""

    def __init__(self, file: str, errors: list[str]) -> None:
        super().__init__(f"{file}: {len(errors)} problem(s)\n  " + "\n  ".join(errors))
        self.file = file
        self.errors = errors


@functools.cache
def default_registries() -> PolicyRegistries:
    """Return the built-in registries, built once on first use.

    Built once because each registry creates its section model classes, and two loads of
    one document must produce equal policies (pydantic equality compares classes).
    """
    return PolicyRegistries()


def _registries(info: ValidationInfo) -> PolicyRegistries:
    context = info.context or {}
    return context.get("registries") or default_registries()


def _disagg_section(value: Any, handler: Any, info: ValidationInfo) -> Any:
    # The section's model depends on the decider it names, so the component's own
    # parser decides; its ValidationError nests under `disaggregated_router`.
    if isinstance(value, BaseModel):
        value = value.model_dump()
    return parse_disaggregated_router(value, _registries(info).deciders)


def _router_section(value: Any, handler: Any, info: ValidationInfo) -> Any:
    if isinstance(value, str):
        if value not in BUILTIN_CONFIGS:
            raise PydanticCustomError("config_error", "unknown built-in router config "
                                      f"{value!r}; known: {', '.join(sorted(BUILTIN_CONFIGS))}")
        return value
    if isinstance(value, BaseModel):
        value = value.model_dump(by_alias=True)
    if not isinstance(value, Mapping):
        raise PydanticCustomError("config_error", "expected a built-in config name or a "
                                  "mapping with plugins and schedulingProfiles")
    return parse_router_config(value, _registries(info).plugins)


# These two sections have schemas of their own (generated from their registries); the
# policy schema points at those files instead of copying them.  pydantic cannot emit a
# `$ref` to another file, so `policy_schema` puts these in after generation.
EXTERNAL_SECTIONS: dict[str, dict[str, Any]] = {
    "disaggregated_router": {
        "anyOf": [{"$ref": "disaggregated_router.schema.json"}, {"type": "null"}],
        "default": None, "description": "Remote-or-local prefill decider run by decode workers."},
    "router": {
        "anyOf": [{"enum": sorted(BUILTIN_CONFIGS)}, {"$ref": "router.schema.json"},
                  {"type": "null"}],
        "default": None, "description": "A built-in router config name, or a router config."},
}
DisaggSection = Annotated[Any, WrapValidator(_disagg_section), WithJsonSchema({})]
RouterSection = Annotated[Any, WrapValidator(_router_section), WithJsonSchema({})]


class PolicyFile(PolicyModel):
    """The whole policy document.  Every section is optional; a section left out is not
    governed by policy (the component keeps its own configuration for it)."""

    split_policy: SplitPolicy | None = Field(default=None, description="Worker scoring for "
                                                                      "the prefill/decode split.")
    enable_hotspot_prevention: bool = Field(
        default=False, description="Spread requests away from a worker whose load is far "
                                   "above the fleet's, even at the cost of prefix reuse.")
    cache: CachePolicy | None = Field(default=None, description="Prefix-cache reuse.")
    autoscale: Autoscale | None = Field(default=None, description="Planner bounds per pool.")
    qos: QosConfig | None = Field(
        default=None, description="Priority classes, admission control and graceful "
                                  "degradation (the QoS core's config; see docs/qos.md).")
    disaggregated_router: DisaggSection | None = Field(
        default=None, description="Remote-or-local prefill decider run by decode workers.")
    router: RouterSection | None = Field(
        default=None, description="Router plugins and scheduling profiles, or a built-in name.")

    @field_validator("qos", mode="wrap")
    @classmethod
    def _qos_strict(cls, value: Any, handler: Any) -> Any:
        # QosConfig coerces ("500" -> 500.0) when it reads the router's config; a policy
        # file never does.  Strict JSON validation refuses coercion and still takes a list
        # for `classes` (strict Python validation would want a tuple).  Errors, including
        # QosConfig's cross-field ones, nest under `qos`.
        if value is None or isinstance(value, QosConfig):
            return handler(value)
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            return handler(value)  # not plain JSON data: let QosConfig say what is wrong
        if json.loads(text) != value:
            return handler(value)  # e.g. a non-string key, which JSON would turn into one
        return QosConfig.model_validate_json(text, strict=True)

    @model_validator(mode="after")
    def _not_empty(self) -> Self:
        if not self.model_fields_set:
            check([problem((), "a policy file sets at least one section", {})])
        return self


def error_lines(error: ValidationError) -> list[str]:
    """Return one ``field.path: message`` line per problem, in pydantic's order."""
    lines = []
    for line in error.errors(include_url=False):
        path = ".".join(str(part) for part in line["loc"]) or "(root)"
        lines.append(f"{path}: {line['msg']}")
    return lines


def parse_policy(data: Any, source: str = "policy",
                 registries: PolicyRegistries | None = None) -> PolicyFile:
    """Validate a decoded document; called by ``load_policy_file`` and on reads from etcd.

    Returns the policy; raises ``PolicyError(source, lines)`` listing every problem.
    """
    if not isinstance(data, Mapping):
        raise PolicyError(source, ["(root): a policy document must be a mapping"])
    try:
        return PolicyFile.model_validate(data, context={"registries": registries})
    except ValidationError as exc:
        raise PolicyError(source, error_lines(exc)) from None


def load_policy_file(path: Path | str,
                     registries: PolicyRegistries | None = None) -> PolicyFile:
    """Read and validate a ``.yaml``/``.yml``/``.json`` policy file.

    Returns the policy; raises ``PolicyError`` naming the file (unreadable, undecodable,
    duplicate keys or invalid content).
    """
    try:
        data = decode_document(Path(path))
    except DocumentError as exc:
        raise PolicyError(str(path), [f"(root): {exc}"]) from None
    return parse_policy(data, str(path), registries)


def policy_schema() -> dict[str, Any]:
    """Return the JSON Schema of the policy file (sections of other components by $ref)."""
    schema = PolicyFile.model_json_schema(by_alias=True)
    schema["properties"].update(EXTERNAL_SECTIONS)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "splitserve policy file"
    return schema


def export_schema(path: Path | str) -> Path:
    """Write the schema to ``path`` (conventionally ``configs/schemas/policy.schema.json``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(policy_schema(), indent=2) + "\n", encoding="utf-8")
    return path
