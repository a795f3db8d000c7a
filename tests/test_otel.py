"""The OpenTelemetry middleware over the memory reference: which spans exist (one receive
span per ``receive_batch``, linked to the messages' creation contexts; none for a consume
loop's receives; one settle span per ``ack_many``), and the W3C shortcuts agreeing with
the propagator they stand in for."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import mqabstract
from mqabstract import aio

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry import baggage, propagate, trace  # noqa: E402
from opentelemetry import context as otel_context  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import (  # noqa: E402
    TraceContextTextMapPropagator,
)

from mqabstract.otel import MAX_LINKS, OpenTelemetry  # noqa: E402

BATCH = "messaging.batch.message_count"


class Telemetry:
    """An ``OpenTelemetry`` middleware on SDK providers whose output the test reads."""

    def __init__(self, **kw: Any) -> None:
        self.spans = InMemorySpanExporter()
        self.tracing = sdk_trace.TracerProvider()
        self.tracing.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.otel = OpenTelemetry(tracer_provider=self.tracing,
                                  meter_provider=MeterProvider([self.reader]), gauges=False,
                                  **kw)

    def finished(self, name: str | None = None, kind: SpanKind | None = None) -> list[Any]:
        return [s for s in self.spans.get_finished_spans()
                if (name is None or s.name == name) and (kind is None or s.kind == kind)]

    def consumed(self) -> dict[str, int]:
        """``messaging.client.consumed.messages`` by ``messaging.operation.name``."""
        out: dict[str, int] = {}
        data: Any = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == "messaging.client.consumed.messages":
                        for p in metric.data.data_points:
                            op = p.attributes["messaging.operation.name"]
                            out[op] = out.get(op, 0) + p.value
        return out


def memory_url() -> str:
    return f"memory://otel-{uuid.uuid4().hex}"


def _ids(ctx: Any) -> tuple[int, int]:
    return ctx.trace_id, ctx.span_id


def _traceparent(n: int) -> str:
    return f"00-{n + 1:032x}-{n + 1:016x}-01"


def test_receive_batch_is_one_span_linked_to_each_creation_context() -> None:
    t = Telemetry()
    with mqabstract.connect(memory_url(), middleware=[t.otel]) as mq:
        sub = mq.subscribe("g", "t.#")
        with t.tracing.get_tracer("test").start_as_current_span("checkout"):
            for n in range(3):
                mq.publish("t.1", {"n": n})
            mq.publish_batch([("t.1", b"a"), ("t.2", b"b")])  # one context for both
        with mqabstract.connect(mq.url) as plain:  # no middleware: no context
            plain.publish("t.3", b"bare")
        batch = sub.receive_batch(10, 1)
        assert len(batch) == 6
        batch.ack()
    sends = t.finished(kind=SpanKind.PRODUCER)
    assert len(sends) == 4
    [receive] = t.finished(kind=SpanKind.CONSUMER)  # no per-message span for a batch
    assert receive.name == "receive g"
    assert receive.attributes[BATCH] == 6
    assert receive.attributes["messaging.operation.type"] == "receive"
    assert receive.attributes["messaging.consumer.group.name"] == "g"
    assert receive.attributes["messaging.system"] == "mqabstract.memory"
    assert sorted(_ids(link.context) for link in receive.links) == sorted(
        _ids(s.context) for s in sends)
    assert t.consumed() == {"receive": 6}


def test_a_receive_links_at_most_max_links_contexts() -> None:
    t = Telemetry()
    with mqabstract.connect(memory_url(), middleware=[t.otel]) as mq:
        sub = mq.subscribe("g", "t.#")
        with mqabstract.connect(mq.url) as plain:
            n = MAX_LINKS + 5
            plain.publish_columns("t.1", [b"x"] * n,
                                  row_headers=[{"traceparent": _traceparent(i)}
                                               for i in range(n)])
        assert len(sub.receive_batch(n, 1)) == n
    [receive] = t.finished("receive g")
    assert len(receive.links) == MAX_LINKS
    assert {_ids(link.context) for link in receive.links} == {
        (i + 1, i + 1) for i in range(MAX_LINKS)}


def test_consume_makes_a_process_span_per_message_and_no_receive_span() -> None:
    t = Telemetry()
    with mqabstract.connect(memory_url(), middleware=[t.otel]) as mq:
        sub = mq.subscribe("g", "t.#")
        ids = [mq.publish("t.1", {"n": n}) for n in range(3)]
        seen: list[Any] = []

        def handler(msg: mqabstract.Message) -> None:
            seen.append(trace.get_current_span().get_span_context())

        assert sub.consume(handler, max_messages=3, idle_timeout=2).acked == 3
    sends = {s.attributes["messaging.message.id"]: s for s in t.finished(kind=SpanKind.PRODUCER)}
    process = {s.attributes["messaging.message.id"]: s for s in t.finished(kind=SpanKind.CONSUMER)}
    assert sorted(process) == sorted(ids)  # and nothing else: no receive span
    for mid, span in process.items():
        assert span.name == "process g"
        assert span.parent is not None and _ids(span.parent) == _ids(sends[mid].context)
        assert span.attributes["messaging.destination.name"] == "t.1"
    assert sorted(map(_ids, seen)) == sorted(_ids(s.context) for s in process.values())
    assert t.consumed() == {"process": 3}


def test_asyncio_consume_makes_no_receive_span() -> None:
    t = Telemetry()

    async def main() -> None:
        async with await aio.connect(memory_url(), middleware=[t.otel]) as mq:
            sub = await mq.subscribe("g", "t.#")
            await mq.publish_batch([("t.1", b"a"), ("t.1", b"b")])

            async def handler(msg: aio.AsyncMessage) -> None:
                pass

            assert (await sub.consume(handler, max_messages=2, idle_timeout=2)).acked == 2

    asyncio.run(main())
    [send] = t.finished(kind=SpanKind.PRODUCER)
    process = t.finished(kind=SpanKind.CONSUMER)
    assert [s.name for s in process] == ["process g", "process g"]
    assert all(s.parent is not None and _ids(s.parent) == _ids(send.context)
               for s in process)
    assert t.consumed() == {"process": 2}


def test_ack_many_is_one_settle_span_linked_to_each_creation_context() -> None:
    t = Telemetry(settle_spans=True)
    with mqabstract.connect(memory_url(), middleware=[t.otel]) as mq:
        sub = mq.subscribe("g", "t.#")
        mq.publish_batch([("t.1", b"a"), ("t.1", b"b")])
        mq.publish("t.1", b"c")
        got = sub.receive(3, 1)
        sub.ack_many(got)
    sends = t.finished(kind=SpanKind.PRODUCER)
    [ack] = t.finished(kind=SpanKind.CLIENT)
    assert ack.name == "ack g" and ack.attributes[BATCH] == 3
    assert ack.attributes["messaging.operation.type"] == "settle"
    assert sorted(_ids(link.context) for link in ack.links) == sorted(
        _ids(s.context) for s in sends)


@pytest.fixture
def w3c_span() -> Iterator[Any]:
    tracing = sdk_trace.TracerProvider()
    span = tracing.get_tracer("test").start_span("x")
    yield span
    span.end()


HEADERS: list[dict[str, str]] = [
    {},
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"},
    {"traceparent": "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"},
    {"traceparent": "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future"},
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra"},
    {"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"},
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"},
    {"traceparent": "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    {"traceparent": " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 "},
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
     "tracestate": "vendor=x,other=y"},
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
     "baggage": "tenant=acme"},
    {"traceparent": "not a trace context"},
    {"baggage": "tenant=acme"},
]


@pytest.mark.parametrize("headers", HEADERS, ids=range(len(HEADERS)))
def test_the_w3c_reading_agrees_with_the_propagator(headers: dict[str, str]) -> None:
    otel = OpenTelemetry(gauges=False)
    propagator = propagate.get_global_textmap()
    assert otel._w3c, "the API's default propagator takes the shortcut"
    for _ in range(3):  # extracted, then from the cache (with the context built)
        ctx = otel.creation(headers)
        context = otel.parent(headers)
        expected = propagator.extract(headers)
        assert ctx == trace.get_current_span(expected).get_span_context()
        assert trace.get_current_span(context).get_span_context() == ctx
        assert ctx.trace_state == trace.get_current_span(expected).get_span_context().trace_state
        assert dict(baggage.get_all(context)) == dict(baggage.get_all(expected))


def test_the_w3c_writing_agrees_with_the_propagator(w3c_span: Any) -> None:
    otel = OpenTelemetry(gauges=False)
    propagator = propagate.get_global_textmap()

    def both(span: Any) -> tuple[dict[str, str], dict[str, str]]:
        ours: dict[str, str] = {}
        otel.inject(ours, span)
        theirs: dict[str, str] = {}
        propagator.inject(theirs, context=trace.set_span_in_context(span))
        return ours, theirs

    ours, theirs = both(w3c_span)
    assert ours == theirs and set(ours) == {"traceparent"}
    token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        ours, theirs = both(w3c_span)
    finally:
        otel_context.detach(token)
    assert ours == theirs and "baggage" in ours
    parent = propagator.extract({
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=x"})
    child = sdk_trace.TracerProvider().get_tracer("test").start_span("y", context=parent)
    ours, theirs = both(child)
    assert ours == theirs and ours["tracestate"] == "vendor=x"
    ours, theirs = both(trace.INVALID_SPAN)
    assert ours == theirs == {}


class CountingPropagator(TraceContextTextMapPropagator):
    """W3C trace context, but not the API's class: the middleware leaves it all to it."""

    def __init__(self) -> None:
        self.extracted = 0

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        self.extracted += 1
        if getter is None:
            return super().extract(carrier, context)
        return super().extract(carrier, context, getter)


def test_other_propagators_do_all_the_work_and_still_carry_the_trace() -> None:
    propagator = CountingPropagator()
    t = Telemetry(propagator=propagator)
    assert not t.otel._w3c
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    t.otel.creation(headers)
    t.otel.creation(headers)
    assert propagator.extracted == 2  # no cache: it may read headers it does not name
    with mqabstract.connect(memory_url(), middleware=[t.otel]) as mq:
        sub = mq.subscribe("g", "t.#")
        mq.publish("t.1", b"x")
        assert sub.consume(lambda m: None, max_messages=1, idle_timeout=2).acked == 1
    [send] = t.finished(kind=SpanKind.PRODUCER)
    [process] = t.finished(kind=SpanKind.CONSUMER)
    assert process.parent is not None and _ids(process.parent) == _ids(send.context)
