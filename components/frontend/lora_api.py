"""Loading and unloading LoRA adapters over HTTP, as vLLM's server does it.

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "base_model"?}``: the
  directory is checked (it exists and holds ``adapter_config.json``); without
  ``base_model`` the adapter goes on the served model its config names as its base
  (``base_model_name_or_path``: that model's directory or hub id, or its served name),
  else on the graph's first model; the adapter's
  record is written to etcd, and the answer waits (``Frontend.lora_load_timeout_s``)
  until a worker of the base model reports it loaded (200), every worker reports why
  it cannot (400 naming the reasons; the record is removed again), or time runs out
  (504; the record stays and workers go on trying);
- ``POST /v1/unload_lora_adapter`` ``{"lora_name", "force"?}``: the record is removed
  (404 for an adapter the graph does not have, 400 for one a worker section lists unless
  ``force``); requests for it get 404 at once, and workers unload it when its requests
  in flight are done;
- ``GET /v1/lora_adapters``: every adapter with its record and each worker's status
  (``dynamo lora list``).

All three change or reveal the running graph, so each needs the graph's control token
(``Authorization: Bearer <token>``, the token `dynamo serve` wrote into the run
directory): 401 without it, 403 for a browser's request (an ``Origin`` header).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitserve.contracts.kit.credentials import bearer_matches
from splitserve.contracts.kit.loras import (
    ADAPTER_CONFIG,
    LoraRecord,
    LoraView,
    lora_name_problem,
)
from splitserve.contracts.kit.waiting import poll_until

from .errors import APIError, bad_request, service_unavailable
from .intake import check_content_type, read_body
from .state import FrontendState, ModelLane

MAX_BODY = 64 * 1024
UNLOAD_WAIT_S = 5.0
"""How long an unload waits for workers to let the adapter go before it answers (the
answer names those still holding it: requests in flight)."""


def _error(err: APIError) -> JSONResponse:
    """The error's OpenAI-style body; a 401 names the scheme it wants."""
    extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    return JSONResponse(err.body(), status_code=err.status, headers={**err.headers(),
                                                                     **extra})


def authorize(request: Request, token: str | None) -> None:
    """Raise 403 for a browser's request and 401 unless it carries the control token."""
    if "origin" in request.headers:
        raise APIError(403, "browser requests (with an Origin header) cannot manage "
                       "adapters", type_="permission_error", code="forbidden")
    if not token:
        raise APIError(401, "adapter management is off: this frontend was started "
                       "without the graph's control token", type_="authentication_error",
                       code="invalid_api_key")
    if not bearer_matches(request.headers.get("authorization", ""), token):
        raise APIError(401, "adapter management needs the graph's control token as "
                       "'Authorization: Bearer <token>' (control.token in the run "
                       "directory; `dynamo lora` sends it)", type_="authentication_error",
                       code="invalid_api_key")


async def _body(request: Request, state: FrontendState) -> dict[str, Any]:
    check_content_type(request.headers.get("content-type"))
    raw = await read_body(request, MAX_BODY, state.body_timeout_s)
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return body


def _text(body: dict[str, Any], field: str, required: bool = True) -> str | None:
    value = body.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{field}' must be a non-empty string", field, "invalid_value")
    return value


def check_adapter_dir(path: str) -> tuple[str, dict[str, Any]]:
    """The adapter directory as an absolute path, and its parsed config; 400 naming what
    is wrong with it (the workers read the same path, so a relative one is made absolute
    here)."""
    full = Path(os.path.abspath(os.path.expanduser(path)))
    config = full / ADAPTER_CONFIG
    if not full.is_dir():
        raise bad_request(f"lora_path {path!r}: no such directory", "lora_path",
                          "invalid_lora_path")
    if not config.is_file():
        raise bad_request(f"lora_path {path!r}: not a LoRA adapter directory (no "
                          f"{ADAPTER_CONFIG})", "lora_path", "invalid_lora_path")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise bad_request(f"lora_path {path!r}: {ADAPTER_CONFIG} cannot be read: {exc}",
                          "lora_path", "invalid_lora_path") from None
    if not isinstance(parsed, dict):
        raise bad_request(f"lora_path {path!r}: {ADAPTER_CONFIG} is not a JSON object",
                          "lora_path", "invalid_lora_path")
    return str(full), parsed


def _same_model(named: str, source: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the model ``source`` (a
    pool's ``Common.model``): the same directory, or the same hub id."""
    if not named or not source:
        return False
    if named == source:
        return True
    if os.path.isdir(named) and os.path.isdir(source):
        return os.path.realpath(named) == os.path.realpath(source)
    return False


def default_base(lanes: list[ModelLane], config: dict[str, Any]) -> ModelLane:
    """The served model an adapter is loaded on when the request names none: the one whose
    directory or hub id the adapter's config names (``base_model_name_or_path``, as
    PEFT writes it) or whose served name it is, when exactly one is; else the graph's
    first model."""
    named = config.get("base_model_name_or_path")
    if isinstance(named, str) and named:
        found = [lane for lane in lanes
                 if _same_model(named, lane.source) or named == lane.name]
        if len(found) == 1:
            return found[0]
    return lanes[0]


def _workers(view: LoraView, name: str) -> dict[str, dict[str, str]]:
    return {f"{w:x}": {"state": s.state, **({"error": s.error} if s.error else {}),
                       **({"role": s.role} if s.role != "serve" else {})}
            for w, s in sorted(view.current(name).items())}


async def load_adapter(request: Request) -> Response:
    """``POST /v1/load_lora_adapter``."""
    state: FrontendState = request.app.state.frontend
    try:
        authorize(request, state.control_token)
        body = await _body(request, state)
        return await _load(state, body)
    except APIError as err:
        return _error(err)


async def _load(state: FrontendState, body: dict[str, Any]) -> Response:
    name = _text(body, "lora_name")
    problem = lora_name_problem(name)
    if problem:
        raise bad_request(f"lora_name: {problem}", "lora_name", "invalid_value")
    lanes = {lane.name: lane for lane in state.lanes()}
    if name in lanes:
        raise bad_request(f"lora_name: '{name}' is a served model's name", "lora_name",
                          "invalid_value")
    base_name = _text(body, "base_model", required=False)
    base = None if base_name is None else lanes.get(base_name)
    if base_name is not None and base is None:
        raise bad_request(f"base_model: '{base_name}' is not served here (served: "
                          f"{', '.join(lanes)})", "base_model", "model_not_found")
    path, config = check_adapter_dir(_text(body, "lora_path"))
    if base is None:
        base = default_base(list(lanes.values()), config)
    existing = state.adapters.find(name)
    if existing is not None:
        namespace, record = existing
        if namespace != base.namespace or record.path != path:
            raise bad_request(f"the adapter '{name}' is already loaded from {record.path} "
                              f"on {record.base_model}; unload it first", "lora_name",
                              "lora_exists")
    workers = base.backend.worker_ids()
    if not workers:
        raise service_unavailable(f"no worker of {base.name} is running to load the "
                                  "adapter; retry later", code="no_workers")
    if existing is None:
        await _write(state, base.namespace, name,
                     LoraRecord(path=path, base_model=base.name, source="api"))
    return await _await_load(state, base.namespace, base.name, name, path,
                             removable=existing is None or existing[1].source == "api")


async def _write(state: FrontendState, namespace: str, name: str,
                 record: LoraRecord | None) -> None:
    if state.adapter_store is None:
        raise service_unavailable("adapters cannot be changed: this frontend has no etcd "
                                  "to record them in", code="no_store")
    try:
        if record is None:
            await state.adapter_store.delete(namespace, name)
        else:
            await state.adapter_store.put(namespace, name, record)
    except Exception as exc:  # noqa: BLE001 - etcd unreachable: the client may retry
        raise service_unavailable(f"the adapter could not be recorded in etcd ({exc}); "
                                  "retry later") from None


async def _await_load(state: FrontendState, namespace: str, base: str, name: str,
                      path: str, removable: bool) -> Response:
    """Wait until a worker reports ``name`` loaded (200), every worker reports a
    problem (400; the record is removed again unless the config made it, so a corrected
    adapter can be loaded anew), or the timeout (504)."""
    backend = next(lane.backend for lane in state.lanes() if lane.namespace == namespace)

    def settled() -> bool:
        view = state.adapters.view(namespace)
        if view.adapters.get(name) is None or view.adapters[name].path != path:
            return False
        problems = view.problems(name)
        return bool(view.loaded_on(name)) or (
            bool(problems) and set(backend.worker_ids()) <= set(problems))

    started = time.monotonic()
    await poll_until(settled, state.lora_load_timeout_s, poll_s=0.05)
    view = state.adapters.view(namespace)
    workers = _workers(view, name)
    if view.loaded_on(name):
        return JSONResponse({"object": "lora_adapter", "id": name, "base_model": base,
                             "path": path, "workers": workers,
                             "message": f"Success: LoRA adapter '{name}' added "
                                        f"successfully ({time.monotonic() - started:.1f}s)"})
    problems = view.problems(name)
    if problems and set(backend.worker_ids()) <= set(problems):
        if removable:
            await _write(state, namespace, name, None)
        reasons = "; ".join(sorted(set(problems.values())))
        code = ("lora_not_supported" if all(s.state == "unsupported"
                                            for s in view.current(name).values())
                else "lora_load_failed")
        raise bad_request(f"the LoRA adapter '{name}' could not be loaded on any worker "
                          f"of {base}: {reasons}", "lora_path", code)
    raise APIError(504, f"no worker of {base} reported the LoRA adapter '{name}' loaded "
                   f"within {state.lora_load_timeout_s:.0f}s; it stays recorded and workers "
                   "keep trying (`dynamo lora list` shows their progress)",
                   type_="server_error", code="lora_load_timeout")


async def unload_adapter(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter``."""
    state: FrontendState = request.app.state.frontend
    try:
        authorize(request, state.control_token)
        body = await _body(request, state)
        name = _text(body, "lora_name")
        found = state.adapters.find(name)
        if found is None:
            raise APIError(404, f"the LoRA adapter '{name}' is not loaded here",
                           param="lora_name", code="lora_not_found")
        namespace, record = found
        if record.source == "config" and body.get("force") is not True:
            raise bad_request(f"the LoRA adapter '{name}' comes from the graph's config "
                              "(a worker section's loras): remove it there (replicas that "
                              "start write it again), or send \"force\": true for a "
                              "record the config no longer has", "lora_name",
                              "lora_from_config")
        await _write(state, namespace, name, None)
        await poll_until(lambda: not state.adapters.view(namespace).statuses.get(name),
                         UNLOAD_WAIT_S)
        still = sorted(f"{w:x}" for w, s in
                       state.adapters.view(namespace).statuses.get(name, {}).items()
                       if s.state == "loaded")
        return JSONResponse({"object": "lora_adapter", "id": name, "deleted": True,
                             "still_loaded_on": still,
                             "message": f"Success: LoRA adapter '{name}' removed "
                                        "successfully"})
    except APIError as err:
        return _error(err)


async def list_adapters(request: Request) -> Response:
    """``GET /v1/lora_adapters``: every adapter, its record and each worker's status."""
    state: FrontendState = request.app.state.frontend
    try:
        authorize(request, state.control_token)
    except APIError as err:
        return _error(err)
    served = {lane.name for lane in state.adapter_lanes()}
    data = []
    for namespace, name, record in state.adapters.entries():
        view = state.adapters.view(namespace)
        data.append({"id": name, "base_model": record.base_model, "path": record.path,
                     "source": record.source, "namespace": namespace,
                     "served": name in served, "workers": _workers(view, name)})
    return JSONResponse({"object": "list", "data": data})
