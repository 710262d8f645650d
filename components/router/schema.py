"""JSON Schema of the router config, and export of the shipped config files.

The schema is generated from the registry: each plugin type becomes its own variant of
``plugins[]`` with ``type`` fixed and ``parameters`` described by the type's params model,
so editors can complete and check parameters.  The loader itself stays two-pass (see
``config``), which keeps its error paths free of union tags.

Run ``python -m splitserve.components.router.schema configs`` from the repository root to
rewrite ``configs/schemas/router.schema.json`` and ``configs/router/*.yaml``.
"""

from __future__ import annotations

import json
import operator
import sys
from functools import reduce
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, create_model

from splitserve.contracts.models import StrictModel

from .builtin import BUILTIN_CONFIGS
from .config import RouterConfig
from .registry import PluginRegistry, default_registry


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("-"))


def router_config_schema(registry: PluginRegistry) -> dict[str, Any]:
    """Return the JSON Schema of a router config file for the types in ``registry``."""
    variants = []
    for plugin_type in registry.types():
        variants.append(create_model(
            f"{_camel(plugin_type.name)}Plugin", __base__=StrictModel,
            __doc__=f"A `{plugin_type.name}` {plugin_type.kind}.",
            name=(str, Field(min_length=1, description="Name used by `pluginRef`.")),
            type=(Literal[plugin_type.name], Field(description="Plugin type.")),
            parameters=(plugin_type.params_model,
                        Field(default_factory=plugin_type.params_model,
                              description="Parameters of this type.")),
        ))
    # The variants are only known at run time, so the union is built with `|` in a fold.
    spec = Annotated[reduce(operator.or_, variants), Field(discriminator="type")]
    document = create_model(
        "RouterConfigFile", __base__=RouterConfig,
        plugins=(list[spec], Field(min_length=1, description="Plugin instances.")))
    schema = document.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "splitserve router config"
    return schema


def export_router_configs(configs_root: Path,
                          registry: PluginRegistry | None = None) -> list[Path]:
    """Write the schema and built-in configs under ``configs_root``; returns the paths."""
    registry = registry or default_registry()
    schema_path = configs_root / "schemas" / "router.schema.json"
    schema_path.parent.mkdir(parents=True, exist_ok=True)
    schema_path.write_text(json.dumps(router_config_schema(registry), indent=2) + "\n",
                           encoding="utf-8")
    written = [schema_path]
    for name, config in BUILTIN_CONFIGS.items():
        path = configs_root / "router" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        # A JSON round trip unshares nested dicts, so YAML writes no anchors.
        plain = json.loads(json.dumps(config))
        path.write_text(yaml.safe_dump(plain, sort_keys=False), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "configs")
    for written_path in export_router_configs(root):
        print(written_path)
