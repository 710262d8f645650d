"""Small factories for router test data; every test builds real objects through these."""

from __future__ import annotations

from typing import Any

from splitserve.components.router import (
    Router,
    RouteRequest,
    Snapshot,
    WorkerState,
    build_router,
    default_registry,
    parse_router_config,
)


def worker(worker_id: int, **fields: Any) -> WorkerState:
    """A healthy worker with 100 KV blocks, none used, unless ``fields`` say otherwise."""
    fields.setdefault("kv_blocks_total", 100)
    return WorkerState(worker_id=worker_id, **fields)


def request(num_blocks: int = 10, **fields: Any) -> RouteRequest:
    """A request spanning ``num_blocks`` blocks of 16 tokens."""
    fields.setdefault("request_id", "req-1")
    fields.setdefault("num_tokens", num_blocks * 16)
    return RouteRequest(num_blocks=num_blocks, **fields)


def snapshot(*workers: WorkerState, overlap: dict[int, int] | None = None,
             recent: dict[int, int] | None = None) -> Snapshot:
    """A snapshot of ``workers`` with optional prefix overlap and recent-routing counts."""
    return Snapshot(workers=workers, overlap_blocks=overlap or {},
                    recent_prefix_blocks=recent or {})


def config(plugins: list[dict[str, Any]], profile_plugins: list[dict[str, Any]],
           **profile: Any) -> dict[str, Any]:
    """A one-profile config document named 'p'."""
    return {"plugins": plugins,
            "schedulingProfiles": [{"name": "p", "plugins": profile_plugins, **profile}]}


def router(document: dict[str, Any]) -> Router:
    """Validate ``document`` against the built-in registry and build a router."""
    registry = default_registry()
    return build_router(parse_router_config(document, registry), registry)
