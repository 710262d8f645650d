"""The component types graphs are built from.

Each is an immutable ComponentSpec: the module its processes run, its config model, the
components it knows how to call, and its place in the shutdown order (frontend first so
no new work arrives while routers and workers drain).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from splitserve.components.frontend.config import FrontendConfig
from splitserve.components.router.service_config import RouterComponentConfig
from splitserve.components.worker.registry import (
    DEFAULT_ENGINE,
    ENGINES,
    EngineSpec,
    check_section,
    section_choices,
)
from splitserve.contracts.config import SelectedBy
from splitserve.serve.graph import ComponentSpec


def _planner_model():
    from splitserve.planner.component_config import PlannerComponentConfig

    return PlannerComponentConfig


def worker_model(role: str, engines: Mapping[str, EngineSpec] = ENGINES) -> SelectedBy:
    """The section model of a worker role, selected by its ``engine`` key among the
    registry's ``engines``."""
    return SelectedBy("engine", section_choices(role, engines), DEFAULT_ENGINE,
                      check=functools.partial(check_section, role))


Frontend = ComponentSpec(
    "Frontend", "splitserve.components.frontend.main", FrontendConfig,
    may_link=("Router", "Worker", "DecodeWorker", "Planner"), shutdown_rank=0,
    description="OpenAI-compatible HTTP API; tokenises, applies the chat template, streams.")
Router = ComponentSpec(
    "Router", "splitserve.components.router.main", RouterComponentConfig,
    may_link=("Worker", "DecodeWorker"), shutdown_rank=10,
    description="KV-aware router: filters, weighted scorers and a picker choose the worker.")
Worker = ComponentSpec(
    "Worker", "splitserve.components.worker.main", worker_model("agg"),
    may_link=(), shutdown_rank=20,
    description="Serves `generate` on an engine (torch, mocker, vLLM, SGLang, TensorRT-LLM).")
DecodeWorker = ComponentSpec(
    "DecodeWorker", "splitserve.components.worker.decode_main", worker_model("decode"),
    may_link=("PrefillWorker",), shutdown_rank=20,
    description="Decodes; per request, prefills locally or offloads to the prefill pool.")
PrefillWorker = ComponentSpec(
    "PrefillWorker", "splitserve.components.worker.prefill_main", worker_model("prefill"),
    may_link=(), shutdown_rank=30,
    description="Pulls prefill jobs, computes prompt KV, writes it into decode workers.")
Planner = ComponentSpec(
    "Planner", "splitserve.planner.main", _planner_model(),
    may_link=(), shutdown_rank=-10,
    description="Scales the prefill and decode pools within the policy's autoscale bounds.")
