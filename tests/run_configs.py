"""A component's resolved config file, as ``dynamo serve`` writes it for the process
(and a manifest mounts it), for tests that start a component's entry point alone."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan

REPO = Path(__file__).resolve().parents[1]


def run_config_file(tmp_path: Path, graph: str, config: str, component: str,
                    overrides: list[str]) -> Path:
    """configs/<config> planned for ``graph`` with ``overrides``: ``component``'s replica 0
    config, written under ``tmp_path``."""
    path = REPO / "configs" / config
    g = load_graph(graph)
    plan = build_plan(g, graph, yaml.safe_load(path.read_text()), str(path), overrides,
                      g.defined)
    cfg = plan.run_config(plan.component(component), 0, tmp_path / "status.json")
    out = tmp_path / f"{component}.json"
    out.write_text(json.dumps(cfg.model_dump(mode="json")))
    return out
