"""OpenTelemetry traces and metrics for mqabstract (extra ``otel``).

    import mqabstract
    from mqabstract.otel import OpenTelemetry

    mq = mqabstract.connect(url, middleware=[OpenTelemetry()])

Publishing injects the W3C trace context (``traceparent``, ``tracestate``; whatever the
configured propagator writes) into the messages' headers; ``consume`` extracts it, so a
handler's ``process`` span continues the publisher's trace on every backend. Spans and
metrics follow the OpenTelemetry messaging semantic conventions:

- spans ``send {topic}`` (PRODUCER, one per publish call: a batch shares one context),
  ``receive {group}`` (CONSUMER, one per receive that returned messages), ``process
  {group}`` (CONSUMER, around each handler, current while it runs), and with
  ``settle_spans=True`` ``ack``/``nack``/``dead_letter {group}`` (CLIENT, one per settle
  call; off by default: in the Python SDK a span costs tens of microseconds, and a
  per-message ack span would double what telemetry adds to ``consume``);
- counters ``messaging.client.sent.messages``, ``messaging.client.consumed.messages`` and
  ``mqabstract.client.settled.messages`` (by ``mqabstract.outcome``: acked, nacked,
  dead_lettered, expired, released); histograms ``messaging.client.operation.duration``
  (send, receive, and settle with ``settle_spans``) and ``messaging.process.duration``;
- gauges ``mqabstract.group.messages`` (by ``mqabstract.state``: ready, leased, delayed,
  dead) and ``mqabstract.group.lag``, read from ``Broker.stats()`` of every group when
  the metric reader collects (``gauges=False`` turns them off).

Attributes carry names of systems, topics, groups and message ids, never URLs, user
names or credentials. Without a configured SDK the API's no-op providers make all of this
cost little and record nothing.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import MiddlewareError, MissingDependency, MQError, ValidationError
from .middleware import Middleware, Publishing
from .url import redact

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, propagate, trace
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import SpanKind, Status, StatusCode
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

SYSTEM = "messaging.system"
DESTINATION = "messaging.destination.name"
GROUP = "messaging.consumer.group.name"
OP_TYPE = "messaging.operation.type"
OP_NAME = "messaging.operation.name"
MESSAGE_ID = "messaging.message.id"
BATCH = "messaging.batch.message_count"
ERROR_TYPE = "error.type"


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


class _Send:
    """The scope of one publish call: a PRODUCER span whose context goes into the headers."""

    __slots__ = ("otel", "pub", "span", "t0")

    def __init__(self, otel: OpenTelemetry, pub: Publishing) -> None:
        self.otel, self.pub = otel, pub

    def __enter__(self) -> None:
        pub, otel = self.pub, self.otel
        attrs: dict[str, Any] = {SYSTEM: _system(pub.backend), OP_TYPE: "send",
                                 OP_NAME: "send"}
        if pub.topic is not None:
            attrs[DESTINATION] = pub.topic
        if pub.count != 1:
            attrs[BATCH] = pub.count
        self.span = span = otel.tracer.start_span(
            f"send {pub.topic}" if pub.topic else "send", kind=SpanKind.PRODUCER,
            attributes=attrs)
        otel.propagator.inject(pub.headers, context=trace.set_span_in_context(span))
        self.t0 = time.perf_counter()

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any
                 ) -> None:
        pub, otel, span = self.pub, self.otel, self.span
        seconds = time.perf_counter() - self.t0
        attrs = otel.attrs(pub.backend, DESTINATION, pub.topic, "send")
        if exc is not None:
            attrs = {**attrs, ERROR_TYPE: type(exc).__qualname__}
            _failed(span, exc)
        elif pub.ids is not None and len(pub.ids) == 1:
            span.set_attribute(MESSAGE_ID, pub.ids[0])
        span.end()
        if not isinstance(exc, (ValidationError, MiddlewareError)):  # else nothing was sent
            otel.sent.add(pub.count, attrs)
        otel.duration.record(seconds, attrs)


class _Process:
    """The scope of one handler call: a CONSUMER span, child of the publisher's context,
    current while the handler runs."""

    __slots__ = ("msg", "otel", "span", "t0", "token")

    def __init__(self, otel: OpenTelemetry, msg: Message) -> None:
        self.otel, self.msg = otel, msg

    def __enter__(self) -> None:
        msg, otel = self.msg, self.otel
        group = msg.group
        parent = otel.propagator.extract(msg.headers)
        self.span = span = otel.tracer.start_span(
            f"process {group}", context=parent, kind=SpanKind.CONSUMER, attributes={
                SYSTEM: otel.system_of(msg), OP_TYPE: "process", OP_NAME: "process",
                DESTINATION: msg.topic, GROUP: group, MESSAGE_ID: msg.id,
                "mqabstract.attempt": msg.attempt,
            })
        self.token = otel_context.attach(trace.set_span_in_context(span, parent))
        self.t0 = time.perf_counter()

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any
                 ) -> None:
        seconds = time.perf_counter() - self.t0
        otel_context.detach(self.token)
        attrs = self.otel.attrs(self.msg._sub._broker.backend, GROUP, self.msg.group,
                                "process")
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
        key = tuple(attrs.items())
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
        self._attrs: dict[tuple[str, str, str | None, str], Mapping[str, Any]] = {}
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
        backend, group = sub._broker.backend, sub.group
        attrs = self.attrs(backend, GROUP, group, "receive")
        span = self.tracer.start_span(
            f"receive {group}", kind=SpanKind.CONSUMER, start_time=started_ns, attributes={
                **attrs, OP_TYPE: "receive", BATCH: len(messages)})
        span.end()
        self.consumed.add(len(messages), attrs)
        self.duration.record((time.time_ns() - started_ns) / 1e9, attrs)

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
                else {**attrs, OP_TYPE: "settle", MESSAGE_ID: messages[0].id})
            if error is not None:
                _failed(span, error)
            span.end()
            self.duration.record((time.time_ns() - started_ns) / 1e9, attrs)
        if error is not None:
            return
        key = (backend, "outcome", group, op)
        counted = self._attrs.get(key)
        if counted is None:
            counted = {SYSTEM: _system(backend), GROUP: group,
                       "mqabstract.outcome": OUTCOMES[op]}
            if len(self._attrs) < 10_000:
                self._attrs[key] = counted
        self.settled_count.add(len(messages), counted)

    # -- helpers ----------------------------------------------------------------------
    def attrs(self, backend: str, what: str, name: str | None, op: str) -> Mapping[str, Any]:
        """The metric attributes of an operation (cached: built once per name)."""
        key = (backend, what, name, op)
        got = self._attrs.get(key)
        if got is None:
            got = {SYSTEM: _system(backend), OP_NAME: op}
            if name is not None:
                got[what] = name
            if len(self._attrs) < 10_000:  # bounded: names are the user's
                self._attrs[key] = got
        return got

    @staticmethod
    def system_of(msg: Message) -> str:
        return _system(msg._sub._broker.backend)

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
