"""OpenTelemetry traces and metrics for mqabstract (extra ``otel``).

    import mqabstract
    from mqabstract.otel import OpenTelemetry

    mq = mqabstract.connect(url, middleware=[OpenTelemetry()])

Publishing injects the W3C trace context (``traceparent``, ``tracestate``; whatever the
configured propagator writes) into the messages' headers; ``consume`` extracts it, so a
handler's ``process`` span continues the publisher's trace on every backend. Spans and
metrics follow the OpenTelemetry messaging semantic conventions:

- spans ``send {topic}`` (PRODUCER, one per publish call: a batch shares one context),
  ``receive {group}`` (CONSUMER, one per ``receive`` or ``receive_batch`` call that
  returned messages, linked to each distinct creation context the messages carry, at most
  ``MAX_LINKS``; a ``consume`` loop's own receives make none: its handlers' spans stand
  for them), ``process {group}`` (CONSUMER, around each handler, a child of the
  message's creation context, current while it runs), and with ``settle_spans=True``
  ``ack``/``nack``/``dead_letter {group}`` (CLIENT, one per settle call, ``ack_many``
  included, linked like a receive span; off by default: in the Python SDK a span costs
  tens of microseconds, and a per-message ack span would double what telemetry adds to
  ``consume``);
- counters ``messaging.client.sent.messages``, ``messaging.client.consumed.messages`` and
  ``mqabstract.client.settled.messages`` (by ``mqabstract.outcome``: acked, nacked,
  dead_lettered, expired, released); consumed messages count under the operation that
  handed them over (``receive``, or ``process`` for a ``consume`` loop); histograms
  ``messaging.client.operation.duration`` (send, receive, and settle with
  ``settle_spans``) and ``messaging.process.duration``;
- gauges ``mqabstract.group.messages`` (by ``mqabstract.state``: ready, leased, delayed,
  dead) and ``mqabstract.group.lag``, read from ``Broker.stats()`` of every group when
  the metric reader collects (``gauges=False`` turns them off).

Attributes carry names of systems, topics, groups and message ids, never URLs, user
names or credentials. Without a configured SDK the API's no-op providers make all of this
cost little and record nothing. On the message path the middleware builds a
destination's span name and attributes once, extracts a creation context once per
distinct header value, and sums counters in-process; what remains per message is the
SDK's own span and histogram point (see docs/benchmarks.md, "Telemetry overhead").
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import MiddlewareError, MissingDependency, MQError, ValidationError
from .middleware import Middleware, Publishing
from .url import redact

try:
    from opentelemetry import baggage, metrics, propagate, trace
    from opentelemetry import context as otel_context
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace import (
        Link,
        NonRecordingSpan,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
    )
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependency(
        "mqabstract.otel needs opentelemetry-api: pip install 'mqabstract[otel]'") from exc

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator

    from .broker import Broker
    from .message import Message
    from .subscription import Subscription

__all__ = ["OpenTelemetry", "extract", "trace_headers"]

#: ``messaging.system`` per backend (semantic-convention values where one exists).
SYSTEMS = {"sqs": "aws_sqs", "rabbitmq": "rabbitmq", "kafka": "kafka"}
OUTCOMES = {"ack": "acked", "nack": "nacked", "dead_letter": "dead_lettered",
            "expired": "expired", "release": "released"}
STATES = ("ready", "leased", "delayed", "dead")
#: Distinct attribute sets a counter keeps; later ones are summed under ``OVERFLOW``.
MAX_SERIES = 2000
OVERFLOW: tuple[tuple[str, Any], ...] = (("otel.metric.overflow", True),)
#: Links a receive or settle span carries at most (the SDK's default span link limit).
MAX_LINKS = 128
#: Creation contexts kept extracted (by their W3C header values); then all dropped.
MAX_CONTEXTS = 4096
#: Span names, attributes and metric keys kept per destination; then built each time.
MAX_ROUTES = 10_000

SYSTEM = "messaging.system"
DESTINATION = "messaging.destination.name"
GROUP = "messaging.consumer.group.name"
OP_TYPE = "messaging.operation.type"
OP_NAME = "messaging.operation.name"
MESSAGE_ID = "messaging.message.id"
BATCH = "messaging.batch.message_count"
ERROR_TYPE = "error.type"


#: A ``traceparent`` of version 00 exactly as W3C trace context writes it (anything else
#: goes to the propagator).
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _w3c(propagator: TextMapPropagator) -> bool:
    """Whether ``propagator`` is W3C trace context, alone or with W3C baggage (the API's
    default): then a plain ``traceparent`` is written and read here, without its round of
    calls; any other propagator does all of it."""
    parts = (getattr(propagator, "_propagators", None)
             if type(propagator) is CompositePropagator else [propagator])
    if not isinstance(parts, (list, tuple)):
        return False
    kinds = {type(p) for p in parts}
    return TraceContextTextMapPropagator in kinds and kinds <= {
        TraceContextTextMapPropagator, W3CBaggagePropagator}


def _system(backend: str) -> str:
    return SYSTEMS.get(backend, f"mqabstract.{backend}")


def _propagator(given: TextMapPropagator | None) -> TextMapPropagator:
    return given if given is not None else propagate.get_global_textmap()


def extract(msg: Message | Any, propagator: TextMapPropagator | None = None) -> Context:
    """The trace context a message carries (for code that processes messages from
    ``receive`` by hand: ``tracer.start_as_current_span(..., context=extract(msg))``)."""
    headers = getattr(msg, "headers", None) or {}
    return _propagator(propagator).extract(headers)


def trace_headers(propagator: TextMapPropagator | None = None) -> dict[str, str]:
    """The current trace context as headers (``traceparent`` ...): e.g. for the Spark
    sink's ``traceparent`` option, so consumers of its rows continue this trace."""
    out: dict[str, str] = {}
    _propagator(propagator).inject(out)
    return out


class _Route:
    """What every operation of one kind on one destination shares, built once: the span
    name, the span's attributes, the metric attributes and their counter key."""

    __slots__ = ("key", "metric", "name", "span")

    def __init__(self, name: str, span: Mapping[str, Any], metric: Mapping[str, Any]
                 ) -> None:
        self.name, self.span, self.metric = name, span, metric
        self.key = tuple(metric.items())


class _Send:
    """The scope of one publish call: a PRODUCER span whose context goes into the headers."""

    __slots__ = ("otel", "pub", "route", "span", "t0")

    def __init__(self, otel: OpenTelemetry, pub: Publishing) -> None:
        self.otel, self.pub = otel, pub

    def __enter__(self) -> None:
        pub, otel = self.pub, self.otel
        self.route = route = otel.route(pub.backend, "send", DESTINATION, pub.topic)
        self.span = span = otel.tracer.start_span(
            route.name, kind=SpanKind.PRODUCER,
            attributes=route.span if pub.count == 1 else {**route.span, BATCH: pub.count})
        otel.inject(pub.headers, span)
        self.t0 = time.perf_counter()

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any
                 ) -> None:
        seconds = time.perf_counter() - self.t0
        pub, otel, span, route = self.pub, self.otel, self.span, self.route
        if exc is None:
            if pub.ids is not None and len(pub.ids) == 1:
                span.set_attribute(MESSAGE_ID, pub.ids[0])
            span.end()
            otel.sent.add_key(pub.count, route.key)
            otel.duration.record(seconds, route.metric)
            return
        attrs = {**route.metric, ERROR_TYPE: type(exc).__qualname__}
        _failed(span, exc)
        span.end()
        if not isinstance(exc, (ValidationError, MiddlewareError)):  # else nothing was sent
            otel.sent.add(pub.count, attrs)
        otel.duration.record(seconds, attrs)


class _Process:
    """The scope of one handler call: a CONSUMER span, child of the publisher's context,
    current while the handler runs."""

    __slots__ = ("msg", "otel", "route", "span", "t0", "token")

    def __init__(self, otel: OpenTelemetry, msg: Message) -> None:
        self.otel, self.msg = otel, msg

    def __enter__(self) -> None:
        msg, otel = self.msg, self.otel
        sub = msg._sub
        self.route = route = otel.route(sub._broker.backend, "process", GROUP, sub.spec.name,
                                        msg.topic)
        parent = otel.parent(msg.headers)
        self.span = span = otel.tracer.start_span(
            route.name, context=parent, kind=SpanKind.CONSUMER,
            attributes={**route.span, MESSAGE_ID: msg.id, "mqabstract.attempt": msg.attempt})
        self.token = otel_context.attach(trace.set_span_in_context(span, parent))
        self.t0 = time.perf_counter()

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any
                 ) -> None:
        seconds = time.perf_counter() - self.t0
        otel_context.detach(self.token)
        attrs = self.route.metric
        if exc is not None:
            attrs = {**attrs, ERROR_TYPE: type(exc).__qualname__}
            _failed(self.span, exc)
        self.span.end()
        self.otel.process.record(seconds, attrs)


class _Tally:
    """A counter summed here and observed by the SDK when it collects: an add on the
    message path is a dict update under a lock, not an SDK measurement (which hashes the
    attributes and walks its views: ~10 µs here, once per message of a consume loop)."""

    __slots__ = ("_lock", "_totals")

    def __init__(self, meter: Any, name: str, description: str) -> None:
        self._lock = threading.Lock()
        self._totals: dict[tuple[tuple[str, Any], ...], int] = {}
        meter.create_observable_counter(name, callbacks=[self._observe], unit="{message}",
                                        description=description)

    def add(self, n: int, attrs: Mapping[str, Any]) -> None:
        self.add_key(n, tuple(attrs.items()))

    def add_key(self, n: int, key: tuple[tuple[str, Any], ...]) -> None:
        """``add`` with the attributes as ``tuple(attrs.items())`` (a ``_Route.key``)."""
        with self._lock:
            if key not in self._totals and len(self._totals) >= MAX_SERIES:
                key = OVERFLOW  # bounded, as the SDK's cardinality limit does it
            self._totals[key] = self._totals.get(key, 0) + n

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [Observation(total, dict(key)) for key, total in self._totals.items()]


def _failed(span: Any, exc: BaseException) -> None:
    """Mark ``span`` failed with an ``exception`` event of type and message only: a
    stack trace would carry the chained native error, whose text is not redacted."""
    span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}"))
    span.add_event("exception", {"exception.type": type(exc).__qualname__,
                                 "exception.message": redact(str(exc))[:1000]})


class OpenTelemetry(Middleware):
    """Traces and metrics per the OpenTelemetry messaging conventions (see the module).

    ``tracer_provider``/``meter_provider``/``propagator`` default to the global ones.
    One instance may serve several brokers.
    """

    def __init__(self, *, tracer_provider: Any = None, meter_provider: Any = None,
                 propagator: TextMapPropagator | None = None, gauges: bool = True,
                 settle_spans: bool = False) -> None:
        from . import __version__

        self.tracer = trace.get_tracer("mqabstract", __version__,
                                       tracer_provider=tracer_provider)
        meter = metrics.get_meter("mqabstract", __version__, meter_provider=meter_provider)
        self.propagator = _propagator(propagator)
        self.settle_spans = settle_spans
        self.sent = _Tally(meter, "messaging.client.sent.messages",
                           "Messages the producer attempted to send to the broker.")
        self.consumed = _Tally(meter, "messaging.client.consumed.messages",
                               "Messages delivered to the application.")
        self.settled_count = _Tally(meter, "mqabstract.client.settled.messages",
                                    "Messages settled, by outcome (acked, nacked, "
                                    "dead_lettered, expired, released).")
        self.duration = meter.create_histogram(
            "messaging.client.operation.duration", unit="s",
            description="Duration of send, receive and settle operations.")
        self.process = meter.create_histogram(
            "messaging.process.duration", unit="s",
            description="Duration of processing (the consume handler).")
        self._brokers: weakref.WeakSet[Broker] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._reading: tuple[float, list[tuple[Broker, Any]]] = (-1e9, [])
        self._routes: dict[tuple[str, str, str, str | None, str | None], _Route] = {}
        self._settles: dict[tuple[str, str, str, str], tuple[tuple[str, Any], ...]] = {}
        self._w3c = _w3c(self.propagator)
        self._contexts: dict[tuple[str | None, ...], tuple[Context | None, SpanContext]] = {}
        if gauges:
            meter.create_observable_gauge(
                "mqabstract.group.messages", callbacks=[self._observe_counts],
                unit="{message}",
                description="Messages of a group by state (ready, leased, delayed, dead).")
            meter.create_observable_gauge(
                "mqabstract.group.lag", callbacks=[self._observe_lag], unit="{message}",
                description="Messages published to a group's topics not yet consumed "
                            "(backends with offsets).")

    # -- hooks ------------------------------------------------------------------------
    def bind(self, broker: Broker) -> None:
        self._brokers.add(broker)

    def unbind(self, broker: Broker) -> None:
        self._brokers.discard(broker)

    def publishing(self, pub: Publishing) -> _Send:
        return _Send(self, pub)

    def handling(self, msg: Message) -> _Process:
        return _Process(self, msg)

    def received(self, sub: Subscription, messages: Sequence[Message], started_ns: int
                 ) -> None:
        route = self.route(sub._broker.backend, "receive", GROUP, sub.group)
        span = self.tracer.start_span(
            route.name, kind=SpanKind.CONSUMER, start_time=started_ns,
            attributes={**route.span, BATCH: len(messages)}, links=self.links(messages))
        span.end()
        self.consumed.add_key(len(messages), route.key)
        self.duration.record((time.time_ns() - started_ns) / 1e9, route.metric)

    def delivered(self, sub: Subscription, messages: Sequence[Message], started_ns: int
                  ) -> None:
        # A consume loop's receive: counted; the handlers' process spans stand for it.
        self.consumed.add_key(len(messages), self.route(
            sub._broker.backend, "process", GROUP, sub.group).key)

    def settled(self, sub: Subscription, op: str, messages: Sequence[Message],
                started_ns: int, error: MQError | None) -> None:
        backend, group = sub._broker.backend, sub.group
        if self.settle_spans and op in ("ack", "nack", "dead_letter"):  # broker operations
            attrs = self.attrs(backend, GROUP, group, op)
            if error is not None:
                attrs = {**attrs, ERROR_TYPE: type(error).__qualname__}
            span = self.tracer.start_span(
                f"{op} {group}", kind=SpanKind.CLIENT, start_time=started_ns, attributes={
                    **attrs, OP_TYPE: "settle", BATCH: len(messages)} if len(messages) != 1
                else {**attrs, OP_TYPE: "settle", MESSAGE_ID: messages[0].id},
                links=self.links(messages))
            if error is not None:
                _failed(span, error)
            span.end()
            self.duration.record((time.time_ns() - started_ns) / 1e9, attrs)
        if error is not None:
            return
        key = (backend, "outcome", group, op)
        counted = self._settles.get(key)
        if counted is None:
            counted = ((SYSTEM, _system(backend)), (GROUP, group),
                       ("mqabstract.outcome", OUTCOMES[op]))
            if len(self._settles) < MAX_ROUTES:
                self._settles[key] = counted
        self.settled_count.add_key(len(messages), counted)

    # -- helpers ----------------------------------------------------------------------
    def attrs(self, backend: str, what: str, name: str | None, op: str) -> Mapping[str, Any]:
        """The metric attributes of an operation (cached: built once per name)."""
        return self.route(backend, op, what, name).metric

    def route(self, backend: str, op: str, what: str, name: str | None,
              topic: str | None = None) -> _Route:
        """The ``_Route`` of ``op`` on ``name`` (``what``: a topic's or a group's
        attribute), spans naming ``topic`` as the destination when given; cached."""
        key = (backend, op, what, name, topic)
        route = self._routes.get(key)
        if route is None:
            metric = {SYSTEM: _system(backend), OP_NAME: op}
            if name is not None:
                metric[what] = name
            span = {**metric, OP_TYPE: op}
            if topic is not None:
                span[DESTINATION] = topic
            route = _Route(f"{op} {name}" if name else op, span, metric)
            if len(self._routes) < MAX_ROUTES:  # bounded: names are the user's
                self._routes[key] = route
        return route

    def inject(self, headers: dict[str, str], span: Any) -> None:
        """Write ``span``'s context (and the current baggage) into ``headers``."""
        ctx = span.get_span_context()
        if self._w3c and ctx.is_valid and not ctx.trace_state and not baggage.get_all():
            headers["traceparent"] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-" \
                                     f"{ctx.trace_flags:02x}"
        else:
            self.propagator.inject(headers, context=trace.set_span_in_context(span))

    def parent(self, headers: Mapping[str, str]) -> Context:
        """The context a message's headers carry (empty when they carry none)."""
        context, ctx, key = self._creation(headers)
        if context is None:  # read here: built on first use (links need none)
            context = trace.set_span_in_context(NonRecordingSpan(ctx), otel_context.Context())
            if key is not None:
                self._contexts[key] = (context, ctx)
        return context

    def creation(self, headers: Mapping[str, str]) -> SpanContext:
        """The span context a message's headers carry (invalid when they carry none)."""
        return self._creation(headers)[1]

    def _creation(self, headers: Mapping[str, str]
                  ) -> tuple[Context | None, SpanContext, tuple[str | None, ...] | None]:
        """(context, span context, cache key) of ``headers``; the context None when
        ``_extract`` read a plain ``traceparent`` (then it is the span context alone).
        With W3C propagators, extracted once per distinct header value (the messages of
        one publish call carry the same one; a receive span's links and the process spans
        read the same messages); other propagators may read more headers than they name,
        so they extract each time."""
        if not self._w3c:
            context = self.propagator.extract(headers)
            return context, trace.get_current_span(context).get_span_context(), None
        key = (headers.get("traceparent"), headers.get("tracestate"), headers.get("baggage"))
        got = self._contexts.get(key)
        if got is None:
            got = self._extract(headers, key)
            contexts = self._contexts
            if len(contexts) >= MAX_CONTEXTS:
                contexts.clear()
            contexts[key] = got
        return got[0], got[1], key

    def _extract(self, headers: Mapping[str, str], key: tuple[str | None, ...]
                 ) -> tuple[Context | None, SpanContext]:
        """A W3C ``traceparent`` of the usual form (version 00, valid ids), without
        ``tracestate`` or ``baggage``, read here; anything else by the propagator."""
        traceparent, tracestate, baggage_header = key
        found = (_TRACEPARENT.fullmatch(traceparent)
                 if traceparent and tracestate is None and baggage_header is None else None)
        if found is not None:
            trace_id, span_id = int(found[1], 16), int(found[2], 16)
            if trace_id and span_id:
                return None, SpanContext(trace_id, span_id, True,
                                         TraceFlags(int(found[3], 16)))
        context = self.propagator.extract(headers)
        return context, trace.get_current_span(context).get_span_context()

    def links(self, messages: Sequence[Message]) -> list[Link]:
        """One link to each distinct creation context of ``messages`` (``MAX_LINKS`` at
        most)."""
        links: list[Link] = []
        seen: set[tuple[int, int]] = set()
        creation = self.creation
        for msg in messages:
            headers = msg.headers
            if not headers:
                continue
            ctx = creation(headers)
            ids = (ctx.trace_id, ctx.span_id)
            if ctx.is_valid and ids not in seen:
                seen.add(ids)
                links.append(Link(ctx))
                if len(links) >= MAX_LINKS:
                    break
        return links

    def _groups(self) -> list[tuple[Broker, Any]]:
        """Every bound broker's group stats, read once per collection (both gauges' callbacks
        run back to back: the second gets the first's reading)."""
        with self._lock:
            at, readings = self._reading
            if time.monotonic() - at < 1.0:
                return readings
            readings = []
            for broker in list(self._brokers):
                if broker.closed or not broker.capabilities.lists_groups:
                    continue
                try:
                    groups = broker.groups()
                except MQError:
                    continue  # away: no reading this time
                for group in groups:
                    try:
                        readings.append((broker, broker.stats(group)))
                    except MQError:
                        continue  # deleted meanwhile, or away
            self._reading = (time.monotonic(), readings)
            return readings

    def _observe_counts(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for broker, stats in self._groups():
            for state in STATES:
                value = getattr(stats, state)
                if value is not None:
                    out.append(Observation(value, {
                        SYSTEM: _system(broker.backend), GROUP: stats.group,
                        "mqabstract.state": state}))
        return out

    def _observe_lag(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(stats.lag, {SYSTEM: _system(broker.backend), GROUP: stats.group})
                for broker, stats in self._groups() if getattr(stats, "lag", None) is not None]
