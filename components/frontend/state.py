"""What every stage of a frontend request reads: the process's ``FrontendState``, built
once by ``main`` (the request's own types, one per stage, are in ``request.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from splitserve.contracts.engine import EngineRequestParams

from .backend import Backend
from .backlog import TokenizeBacklog
from .errors import APIError, service_unavailable
from .loras import AdapterCatalog, AdapterStore
from .metrics import FrontendMetrics
from .textcodec import TextCodec


@dataclass
class ModelLane:
    """One served model: its name, its tokenizer (None while it loads), the workers that
    serve it (``backend``: its pool's router or workers) and its output formats.  A LoRA
    adapter is served on a copy of its base model's lane with ``lora`` set."""

    name: str
    backend: Backend
    codec: TextCodec | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    namespace: str = ""
    """The Dynamo namespace of its pool (where its adapters are recorded)."""
    lora: str | None = None
    """The adapter this lane serves (``name``), on the workers of ``base``."""
    base: str = ""
    """The served model whose workers serve it: its adapter's base ("": ``name``)."""
    source: str = ""
    """What its pool's config names as the model (``Common.model``: a directory or a
    hub id); a LoRA adapter's config names its base the same way."""

    @property
    def base_model(self) -> str:
        return self.base or self.name

    def is_ready(self) -> bool:
        """A request for it would be served now: its tokenizer is loaded and a worker of
        its pool is registered."""
        return self.codec is not None and self.backend.ready()


@dataclass
class FrontendState:
    """Everything a request handler needs; built once per process."""

    model_name: str
    codec: TextCodec | None
    backend: Backend
    metrics: FrontendMetrics = field(default_factory=FrontendMetrics)
    max_inflight: int = 256
    default_max_tokens: int = 512
    first_token_timeout_s: float = 120.0
    inter_token_timeout_s: float = 30.0
    priority_header: str = "x-priority"
    context_factory: Any = None
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0
    max_pending_prepares: int = 1024
    # The tokenizer pool's queue is bounded by the wait it implies (backlog.py).
    max_tokenization_wait_s: float = 2.0
    max_loop_lag_s: float = 0.0  # 0: never refuse for the event loop's lag
    loop_lag: Any = None  # a loop_lag.LoopLag while the frontend serves
    # Parsing and tokenising run here, never on the event loop: a multi-megabyte prompt
    # takes seconds to tokenise and would stall every other connection meanwhile.
    prepare_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="frontend-tokenize"))
    inflight: int = 0
    backlog: TokenizeBacklog = field(init=False)
    loading_detail: str = "loading tokenizer"
    engines: Mapping[str, EngineRequestParams] = field(default_factory=dict)
    """The engines of the graph's workers, with the request parameters each declares it
    honours (``capabilities.graph_engines`` of the run config): parameters one of them
    does not honour are refused by name (empty: only those no engine honours)."""
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    # Names of the graph's dependencies (etcd, NATS) unreachable now; set by main.
    dependencies_down: Callable[[], list[str]] = field(default=list)
    pools: dict[str, ModelLane] = field(default_factory=dict)
    """The graph's other models (its ``Models`` pools) by served name; the fields above
    (``model_name``, ``codec``, ``backend``, the parsers) are the first model's."""
    namespace: str = ""
    """The first model's Dynamo namespace."""
    model_source: str = ""
    """The first model as its config names it (``Common.model``)."""
    adapters: AdapterCatalog = field(default_factory=AdapterCatalog)
    """The LoRA adapters of every served model, as etcd says (``loras.py``)."""
    adapter_store: AdapterStore | None = None
    """Writes adapter records (the management endpoints); None: no etcd to write to."""
    control_token: str | None = field(default=None, repr=False)
    """The graph's control token: the adapter management endpoints require it as a
    bearer token (None: they refuse every request)."""
    lora_load_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self.backlog = TokenizeBacklog(self.prepare_pool._max_workers,
                                       self.max_tokenization_wait_s, self.max_pending_prepares)

    def first_lane(self) -> ModelLane:
        """The graph's first model (``Common.model``) as a lane."""
        return ModelLane(self.model_name, self.backend, self.codec, self.tool_call_parser,
                         self.reasoning_parser, namespace=self.namespace,
                         source=self.model_source)

    def lanes(self) -> list[ModelLane]:
        """Every model this frontend serves, the first one first (adapters not
        included: ``adapter_lanes``)."""
        return [self.first_lane(), *self.pools.values()]

    def lane(self, model: str) -> ModelLane:
        """The lane serving ``model``: a served model's, or a LoRA adapter's (once a
        worker has it loaded); 404 ``model_not_found`` (as OpenAI answers) for a model
        this graph does not serve."""
        if model == self.model_name:
            return self.first_lane()
        found = self.pools.get(model)
        if found is not None:
            return found
        adapter, why = self._adapter_lane(model)
        if adapter is None:
            names = ", ".join(lane.name for lane in self.lanes() + self.adapter_lanes())
            what = f"is not served now: {why}" if why else "does not exist here"
            raise APIError(404, f"the model '{model}' {what}; available: {names}",
                           param="model", code="model_not_found")
        return adapter

    def _base_lane(self, namespace: str) -> ModelLane | None:
        return next((lane for lane in self.lanes() if lane.namespace == namespace), None)

    def _adapter_lane(self, name: str) -> tuple[ModelLane | None, str]:
        """The lane of adapter ``name`` (None while no worker has it loaded) and, for a
        recorded adapter without one, why (for the 404's message)."""
        found = self.adapters.find(name)
        if found is None:
            return None, ""
        namespace, record = found
        base = self._base_lane(namespace)
        if base is None:
            return None, ""
        if not self.adapters.loaded_on(namespace, name):
            problems = sorted(set(self.adapters.view(namespace).problems(name).values()))
            detail = f" ({'; '.join(problems)})" if problems else ""
            return None, (f"it is a LoRA adapter of {base.name} that no worker has loaded "
                          f"yet{detail}")
        return dataclasses.replace(base, name=name, lora=name, base=base.name), ""

    def adapter_lanes(self) -> list[ModelLane]:
        """The LoRA adapters served now (a worker has each loaded), by name; a name that
        a served model has is never an adapter's."""
        models = {lane.name for lane in self.lanes()}
        out = []
        for _, name, _ in self.adapters.entries():
            if name in models:
                continue
            lane, _ = self._adapter_lane(name)
            if lane is not None:
                out.append(lane)
        return out

    def is_ready(self) -> bool:
        """Some model would be served now (its tokenizer loaded, a worker registered)
        and etcd and NATS are up."""
        return (self.codec is not None and any(lane.is_ready() for lane in self.lanes())
                and not self.dependencies_down())

    def outage(self, err: APIError) -> APIError:
        """A 503 answered while etcd or NATS is down says so (service_unavailable)."""
        down = self.dependencies_down() if err.status == 503 else []
        if not down:
            return err
        return service_unavailable(f"the service is unavailable: {', '.join(down)} is down "
                                   f"({err.message}); retry later",
                                   retry_after_s=max(2.0, err.retry_after_s or 0))
