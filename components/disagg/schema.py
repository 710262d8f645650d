"""JSON Schema of the ``disaggregated_router`` section.

Run ``python -m splitserve.components.disagg.schema configs`` from the repository root to
rewrite ``configs/schemas/disaggregated_router.schema.json``.
"""

from __future__ import annotations

import json
import operator
import sys
from functools import reduce
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from .registry import DeciderRegistry, default_decider_registry


def disaggregated_router_schema(registry: DeciderRegistry | None = None) -> dict[str, Any]:
    """Return the section's JSON Schema: one variant per registered decider."""
    registry = registry or default_decider_registry()
    models = tuple(t.section_model for t in registry.types())
    # The variants are only known at run time, so the union is built with `|` in a fold.
    schema = TypeAdapter(reduce(operator.or_, models)).json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "splitserve disaggregated_router section"
    return schema


def write_disaggregated_router_schema(configs_root: Path,
                                      registry: DeciderRegistry | None = None) -> Path:
    """Write the schema to ``<configs_root>/schemas/disaggregated_router.schema.json``."""
    path = configs_root / "schemas" / "disaggregated_router.schema.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(disaggregated_router_schema(registry), indent=2) + "\n",
                    encoding="utf-8")
    return path


if __name__ == "__main__":
    print(write_disaggregated_router_schema(Path(sys.argv[1] if len(sys.argv) > 1 else "configs")))
