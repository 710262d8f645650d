"""OpenTelemetry spans for one request's hops, off unless the standard ``OTEL_*``
variables turn them on.

Each component process calls ``setup(component)`` once at start (``contracts.kit.
component.run``) and ``shutdown()`` before it leaves.  Tracing is on when

- ``OTEL_SDK_DISABLED`` is not ``true``, and
- ``OTEL_TRACES_EXPORTER`` names ``otlp`` (or ``console``), or it is unset and
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.

Spans are then exported over OTLP/HTTP (protobuf; ``grpc`` where
``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` asks for it and its exporter is installed) by a
batch processor, under ``OTEL_SERVICE_NAME`` (default: the component's name).  The
SDK reads the other standard variables itself (endpoint, headers, timeout, sampler,
``OTEL_BSP_*``, ``OTEL_RESOURCE_ATTRIBUTES``).

Off, nothing of OpenTelemetry is imported and every helper returns at its first line:
``start`` hands back one shared ``NOOP`` span (falsy, so a hook can skip building
attributes with ``if span:``) and the carriers are empty.

Context crosses processes as W3C ``traceparent`` / ``tracestate`` values: in an HTTP
request's headers (the client's), in a Dynamo request's context metadata (``to_dynamo``,
``from_dynamo``, ``dynamo_context``: Dynamo's request plane carries that map to the
handler's context) and in the prefill job's JetStream headers (``inject``).  A
traceparent that does not parse is ignored: the request starts a trace of its own.
Parents are passed explicitly (a ``Span`` or a carrier mapping); ``active`` makes one
the ambient parent for a stretch of code without a ``yield`` in it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("splitserve.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_tracer: Any = None  # the SDK's Tracer while tracing is on, else None
_provider: Any = None
_api: Any = None  # the ``_Otel`` bundle of imported names while on


# ---- W3C trace context (pure; no OpenTelemetry) ------------------------------------------

_TRACEPARENT_RE = re.compile(
    r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


@dataclass(frozen=True)
class TraceParent:
    """A parsed W3C ``traceparent``: the caller's trace, its span, its flags."""

    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def header(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"


def parse_traceparent(value: object) -> TraceParent | None:
    """``value`` as W3C Trace Context level 1 reads it, or None when it is not one
    (wrong shape, version ``ff``, an all-zero id, extra fields on version 00)."""
    if not isinstance(value, str) or len(value) > 512:
        return None
    m = _TRACEPARENT_RE.match(value.strip())
    if m is None:
        return None
    version, trace, span, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


# ---- switching on and off ----------------------------------------------------------------

def wanted_exporters(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the standard variables ask for ([] when tracing is off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        return [e for e in (x.strip() for x in named.split(","))
                if e in ("otlp", "console")]
    if (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return ["otlp"]
    return []


def enabled() -> bool:
    """True while this process records spans."""
    return _tracer is not None


def setup(component: str, environ: Mapping[str, str] | None = None,
          exporter: Any = None) -> bool:
    """Turn tracing on for this process if the ``OTEL_*`` variables ask for it; returns
    whether it is on.  ``component`` is the default service name.  ``exporter`` (tests)
    replaces the exporters the variables name.  A second call replaces the first's
    provider."""
    global _tracer, _provider, _api
    env = os.environ if environ is None else environ
    kinds = [] if exporter is not None else wanted_exporters(env)
    if exporter is None and not kinds:
        return False
    shutdown()
    try:
        otel = _Otel()
        exporters = [exporter] if exporter is not None else [
            _exporter(kind, env) for kind in kinds]
    except ImportError as exc:
        log.warning("tracing is asked for (OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_*) "
                    "but cannot start: %s", exc)
        return False
    name = env.get("OTEL_SERVICE_NAME") or component
    resource = otel.Resource.create({"service.name": name, "process.pid": os.getpid(),
                                     "splitserve.component": component})
    provider = otel.TracerProvider(resource=resource)
    for exp in exporters:
        processor = (otel.SimpleSpanProcessor(exp) if exporter is not None
                     else otel.BatchSpanProcessor(exp))
        provider.add_span_processor(processor)
    _provider, _api = provider, otel
    _tracer = provider.get_tracer("splitserve")
    log.info("tracing on: service %s, exporters %s", name, ", ".join(kinds) or "given")
    return True


def shutdown() -> None:
    """Export what is buffered and stop (before the process leaves); no-op when off."""
    global _tracer, _provider, _api
    provider, _tracer, _provider, _api = _provider, None, None, None
    if provider is not None:
        try:
            provider.shutdown()
        except Exception as exc:  # noqa: BLE001 - never fail a shutdown over spans
            log.warning("flushing spans failed: %s", exc)


class _Otel:
    """The OpenTelemetry names used while on, imported only when tracing starts."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.context, self.trace = context, trace
        self.Resource, self.TracerProvider = Resource, TracerProvider
        self.BatchSpanProcessor, self.SimpleSpanProcessor = BatchSpanProcessor, SimpleSpanProcessor
        self.kinds = {"internal": trace.SpanKind.INTERNAL, "server": trace.SpanKind.SERVER,
                      "client": trace.SpanKind.CLIENT, "producer": trace.SpanKind.PRODUCER,
                      "consumer": trace.SpanKind.CONSUMER}


def _exporter(kind: str, env: Mapping[str, str]) -> Any:
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ImportError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported "
                          "(http/protobuf or grpc)")
    return OTLPSpanExporter()


# ---- spans -------------------------------------------------------------------------------

class NoopSpan:
    """The span every helper returns while tracing is off (one shared instance)."""

    __slots__ = ()
    start_ns = 0

    def __bool__(self) -> bool:
        return False

    def set(self, attrs: Mapping[str, Any]) -> None:
        return None

    def event(self, name: str, attrs: Mapping[str, Any] | None = None) -> None:
        return None

    def end(self, attrs: Mapping[str, Any] | None = None, *, error: str | None = None,
            end_ns: int | None = None) -> None:
        return None

    def child(self, name: str, attrs: Mapping[str, Any] | None = None, *,
              kind: str = "internal", start_ns: int | None = None) -> NoopSpan:
        return self

    def record(self, name: str, start_ns: int, end_ns: int,
               attrs: Mapping[str, Any] | None = None, *, error: str | None = None) -> None:
        return None

    def carrier(self) -> dict[str, str]:
        return {}


NOOP = NoopSpan()


def _clean(attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Attributes OpenTelemetry accepts: None dropped, other odd values as text."""
    out: dict[str, Any] = {}
    for k, v in (attrs or {}).items():
        if v is None:
            continue
        if not isinstance(v, (bool, int, float, str)):
            v = str(v) if not isinstance(v, (list, tuple)) else [
                x if isinstance(x, (bool, int, float, str)) else str(x) for x in v]
        out[k] = v
    return out


class Span:
    """A recording span (tracing on): a thin wrapper over the SDK's."""

    __slots__ = ("_span", "start_ns")

    def __init__(self, span: Any, start_ns: int) -> None:
        self._span = span
        self.start_ns = start_ns

    def __bool__(self) -> bool:
        return True

    def set(self, attrs: Mapping[str, Any]) -> None:
        self._span.set_attributes(_clean(attrs))

    def event(self, name: str, attrs: Mapping[str, Any] | None = None) -> None:
        self._span.add_event(name, _clean(attrs))

    def end(self, attrs: Mapping[str, Any] | None = None, *, error: str | None = None,
            end_ns: int | None = None) -> None:
        """End the span (once; later calls are ignored by the SDK), with ``attrs`` and,
        when ``error`` is given, an error status with that description."""
        if attrs:
            self.set(attrs)
        if error is not None:
            self._span.set_status(_api.trace.Status(_api.trace.StatusCode.ERROR, error))
        self._span.end(end_time=end_ns)

    def child(self, name: str, attrs: Mapping[str, Any] | None = None, *,
              kind: str = "internal", start_ns: int | None = None) -> Span:
        return start(name, self, attrs, kind=kind, start_ns=start_ns)

    def record(self, name: str, start_ns: int, end_ns: int,
               attrs: Mapping[str, Any] | None = None, *, error: str | None = None) -> None:
        """A finished child span: from ``start_ns`` to ``end_ns`` (wall clock, ns)."""
        self.child(name, attrs, start_ns=start_ns).end(error=error, end_ns=end_ns)

    def carrier(self) -> dict[str, str]:
        """This span as W3C headers (what a child in another process continues)."""
        return _carrier_of(self._span.get_span_context())

    @property
    def otel(self) -> Any:
        """The SDK's span (tests)."""
        return self._span


def _carrier_of(sc: Any) -> dict[str, str]:
    if not sc.is_valid:
        return {}
    out = {TRACEPARENT: TraceParent(sc.trace_id, sc.span_id, int(sc.trace_flags)).header()}
    state = sc.trace_state.to_header() if sc.trace_state else ""
    if state:
        out[TRACESTATE] = state
    return out


def _parent_context(parent: Any) -> Any:
    """The OpenTelemetry context a new span hangs under: a ``Span``'s, a carrier's
    (headers, Dynamo metadata), or None (the ambient one)."""
    if parent is None or parent is NOOP:
        return None
    if isinstance(parent, Span):
        return _api.trace.set_span_in_context(parent._span)
    try:
        tp = parse_traceparent(parent.get(TRACEPARENT))
    except Exception:  # noqa: BLE001 - an odd carrier is no carrier
        return None
    if tp is None:
        return _api.context.Context()  # a bad or missing traceparent starts a new trace
    state = None
    raw_state = parent.get(TRACESTATE)
    if raw_state:
        with contextlib.suppress(Exception):
            state = _api.trace.TraceState.from_header([raw_state])
    sc = _api.trace.SpanContext(tp.trace_id, tp.span_id, is_remote=True,
                                trace_flags=_api.trace.TraceFlags(tp.flags & 0xff),
                                trace_state=state)
    return _api.trace.set_span_in_context(_api.trace.NonRecordingSpan(sc))


def start(name: str, parent: Any = None, attrs: Mapping[str, Any] | None = None, *,
          kind: str = "internal", start_ns: int | None = None) -> Span | NoopSpan:
    """Start a span under ``parent``: a ``Span``, a carrier mapping (HTTP headers,
    Dynamo metadata, JetStream headers; a bad traceparent in it starts a new trace), or
    None for the ambient parent (``active``).  ``NOOP`` while tracing is off."""
    if _tracer is None:
        return NOOP
    ctx = _parent_context(parent)
    begin = start_ns if start_ns is not None else time.time_ns()
    span = _tracer.start_span(name, context=ctx, kind=_api.kinds.get(kind),
                              attributes=_clean(attrs), start_time=begin)
    return Span(span, begin)


def record(name: str, parent: Any, start_ns: int, end_ns: int,
           attrs: Mapping[str, Any] | None = None, *, error: str | None = None) -> None:
    """A finished span after the fact (a wait or a compute measured elsewhere)."""
    if _tracer is None:
        return
    start(name, parent, attrs, start_ns=start_ns).end(error=error, end_ns=end_ns)


@contextlib.contextmanager
def _attached(ctx: Any):
    token = _api.context.attach(ctx)
    try:
        yield
    finally:
        _api.context.detach(token)


def active(parent: Any) -> contextlib.AbstractContextManager:
    """Make ``parent`` (a ``Span`` or a carrier) the ambient parent inside the ``with``
    block; the block must not ``yield`` (an async generator's frames may resume in
    another context)."""
    if _tracer is None or parent is None or parent is NOOP:
        return contextlib.nullcontext()
    ctx = _parent_context(parent)
    return _attached(ctx) if ctx is not None else contextlib.nullcontext()


def current() -> Span | NoopSpan:
    """The ambient span (inside ``active``) as a parent for ``start``; NOOP when off."""
    if _tracer is None:
        return NOOP
    span = _api.trace.get_current_span()
    return Span(span, 0) if span.get_span_context().is_valid else NOOP


def inject(headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` plus the ambient span's W3C context (a message that carries it on);
    ``headers`` unchanged while tracing is off or nothing is ambient."""
    if _tracer is None:
        return headers
    extra = _carrier_of(_api.trace.get_current_span().get_span_context())
    return {**(headers or {}), **extra} if extra else headers


# ---- Dynamo's request plane --------------------------------------------------------------

def from_dynamo(context: Any) -> dict[str, str] | None:
    """The W3C carrier a Dynamo request's context brought (its metadata), or None."""
    if _tracer is None or context is None:
        return None
    try:
        meta = context.metadata
        value = meta.get(TRACEPARENT)
        if not value:
            return None
        out = {TRACEPARENT: value}
        state = meta.get(TRACESTATE)
        if state:
            out[TRACESTATE] = state
        return out
    except Exception:  # noqa: BLE001 - a context without metadata carries nothing
        return None


def to_dynamo(context: Any, span: Any) -> None:
    """Put ``span``'s W3C context into a Dynamo context's metadata, which the request
    plane carries to the handler (``from_dynamo`` there)."""
    if _tracer is None or context is None or not span:
        return
    try:
        for key, value in span.carrier().items():
            context.metadata[key] = value
    except Exception as exc:  # noqa: BLE001 - tracing never fails a request
        log.debug("could not carry the trace context: %s", exc)


def dynamo_context(span: Any, request_id: str | None = None) -> Any:
    """A new Dynamo context carrying ``span`` (for a call that had none), or None while
    tracing is off or there is no span."""
    if _tracer is None or not span:
        return None
    from dynamo.runtime import Context

    return Context(id=request_id, metadata=span.carrier())


# ---- the frontend's stream ------------------------------------------------------------

def stream_span(meta: Any, context: Any = None) -> Span | NoopSpan:
    """One choice's ``stream`` span under the request's (``meta.trace``), carried into
    the Dynamo ``context`` of its worker call; NOOP when off."""
    if _tracer is None:
        return NOOP
    span = start("stream", meta.trace, {"splitserve.request_id": meta.request_id},
                 kind="client")
    to_dynamo(context, span)
    return span


def end_stream(span: Any, meta: Any, finish: str | None) -> None:
    """End a ``stream`` span with what the choice produced (``meta``: the frontend's
    ``StreamMeta``) and its finish reason (None: it ended without one)."""
    if not span:
        return
    worker = meta.worker_id
    span.end({"splitserve.output_tokens": meta.output_tokens,
              "splitserve.cached_tokens": meta.cached_tokens,
              "splitserve.finish_reason": finish or "none",
              "splitserve.worker_id": f"{worker:x}" if worker is not None else None,
              "splitserve.route_reason": meta.route_reason or None,
              "splitserve.priority_class": meta.class_name,
              "splitserve.predicted_ttft_ms": meta.predicted_ttft_ms},
             error=None if finish else "ended without a finish reason")


# ---- clocks ------------------------------------------------------------------------------

def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as wall-clock nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def now_ns() -> int:
    return time.time_ns()
