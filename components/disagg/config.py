"""Loading the ``disaggregated_router`` section and building its decider.

The section holds ``enable``, an optional ``decider`` name (default ``score``) and that
decider's parameters side by side, so the seed's policy loads as written::

    disaggregated_router:
      enable: true
      policies: [...]                   # score decider parameters
      remote_prefill_min_score: 0.5

    disaggregated_router:
      enable: true
      decider: threshold
      prefill_length_threshold: 512     # threshold decider parameters

Errors are ``pydantic.ValidationError``s whose paths point into the section
(``policies.1.weight``), or into the file (``disaggregated_router.policies.1.weight``)
when loaded with ``load_disaggregated_router_file``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from splitserve.contracts.validation import issue, raise_if_any, retitled

from .registry import DeciderRegistry, default_decider_registry
from .types import Decider, OffloadDecision, OffloadRequest, OffloadSnapshot

SECTION = "disaggregated_router"


def parse_disaggregated_router(section: Any, registry: DeciderRegistry | None = None,
                               source: str = SECTION) -> BaseModel:
    """Validate one ``disaggregated_router`` section; called by loaders and ``policy validate``.

    Returns the section model of the chosen decider (it has ``enable``, ``decider`` and
    the decider's parameters).  Raises ``ValidationError`` titled ``source``.
    """
    registry = registry or default_decider_registry()
    if not isinstance(section, Mapping):
        raise_if_any(source, [issue((), "the section must be a mapping", section)])
    name = section.get("decider", registry.default_name)
    decider_type = registry.get(name) if isinstance(name, str) else None
    if decider_type is None:
        raise_if_any(source, [issue(("decider",), f"unknown decider {name!r}; known: "
                                    f"{', '.join(registry.names())}", name)])
    try:
        return decider_type.section_model.model_validate(section)
    except ValidationError as exc:
        raise retitled(exc, source) from None


def load_disaggregated_router_file(path: Path | str,
                                   registry: DeciderRegistry | None = None) -> BaseModel:
    """Read a policy file whose only top-level key is ``disaggregated_router``."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    title = str(path)
    if not isinstance(data, Mapping) or set(data) != {SECTION}:
        raise_if_any(title, [issue((), f"expected a mapping with the single key {SECTION!r}",
                                   data)])
    try:
        return parse_disaggregated_router(data[SECTION], registry, source=title)
    except ValidationError as exc:
        raise retitled(exc, title, (SECTION,)) from None


class DisaggregatedRouter:
    """The decider the decode worker holds: the configured one behind two guards.

    Guards, checked first: a disabled section always answers local ('disabled'), and an
    empty prefill pool always answers local ('no-prefill-workers'), whatever the decider.
    ``protect_tpot_s`` (the section's ``protect_tpot_ms``) is for the decode worker,
    which alone knows the answers a local prefill would stall.
    """

    FORCED_LOCAL = frozenset({"disabled", "no-prefill-workers"})
    """Local verdicts that are not the decider's: no guard turns them remote."""

    def __init__(self, decider: Decider, enabled: bool = True,
                 protect_tpot_s: float | None = None) -> None:
        self._decider = decider
        self._enabled = enabled
        self.protect_tpot_s = protect_tpot_s

    def decide(self, request: OffloadRequest, snapshot: OffloadSnapshot) -> OffloadDecision:
        """Called by the decode worker once per new request; returns where to prefill."""
        if not self._enabled:
            return OffloadDecision(remote=False, reason="disabled")
        if snapshot.live_prefill_workers == 0:
            return OffloadDecision(remote=False, reason="no-prefill-workers")
        return self._decider.decide(request, snapshot)


def build_decider(config: BaseModel | Mapping[str, Any],
                  registry: DeciderRegistry | None = None) -> DisaggregatedRouter:
    """Build the decode worker's decider; called at start-up and on each policy reload.

    ``config`` is a parsed section or a raw mapping (validated here).
    """
    registry = registry or default_decider_registry()
    if isinstance(config, Mapping):
        config = parse_disaggregated_router(config, registry)
    decider_type = registry.get(getattr(config, "decider", ""))
    if decider_type is None:
        raise ValueError(f"config names no decider known to the registry: {config!r}")
    tpot_ms = getattr(config, "protect_tpot_ms", None)
    return DisaggregatedRouter(decider_type.factory(config), enabled=config.enable,
                               protect_tpot_s=tpot_ms / 1000.0 if tpot_ms else None)
