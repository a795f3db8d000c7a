"""OpenTelemetry end to end on every backend: the trace context a publisher injects comes
back out of the broker, so each handler's ``process`` span continues the publisher's
trace; the counters and the histogram equal what happened.

Needs ``opentelemetry-sdk`` (its in-memory exporters); without it the scenario skips
and says so."""

from __future__ import annotations

from typing import Any

import pytest

from mqabstract import Feature

from .harness import Ctx

sdk_trace = pytest.importorskip(
    "opentelemetry.sdk.trace",
    reason="the telemetry scenario needs opentelemetry-sdk: pip install opentelemetry-sdk")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from mqabstract.otel import OpenTelemetry  # noqa: E402


def _points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    return [point for rm in (data.resource_metrics if data else ())
            for sm in rm.scope_metrics for metric in sm.metrics if metric.name == name
            for point in metric.data.data_points]


def _total(reader: InMemoryMetricReader, name: str, **attrs: str) -> int:
    return sum(p.value for p in _points(reader, name)
               if all(p.attributes.get(k) == v for k, v in attrs.items()))


def test_process_spans_continue_the_publishers_trace_and_metrics_count(mq_ctx: Ctx) -> None:
    spans = InMemorySpanExporter()
    tracing = sdk_trace.TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    otel = OpenTelemetry(tracer_provider=tracing, meter_provider=MeterProvider([reader]),
                         gauges=False)
    mq = mq_ctx.connect(middleware=[otel])
    dead = mq_ctx.caps.supports(Feature.DEAD_LETTER)
    sub = mq_ctx.subscribe("t", mq_ctx.pattern("#"), broker=mq, max_attempts=1)
    topic = mq_ctx.topic("order")
    with tracing.get_tracer("test").start_as_current_span("checkout") as root:
        singles = [mq.publish(topic, {"n": n}) for n in range(3)]
        batch = mq.publish_batch([(topic, {"n": 3}), (topic, {"n": "poison"})])
    ids = [*singles, *batch]

    def handler(msg: Any) -> None:
        if msg.value["n"] == "poison":
            raise ValueError("poison")

    stats = sub.consume(handler, max_messages=5, idle_timeout=mq_ctx.wait)
    assert stats.received == 5 and stats.acked == 4, stats

    finished = spans.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    sends = [s for s in finished if s.kind == SpanKind.PRODUCER]
    assert len(sends) == 4 and all(s.parent.span_id == root.get_span_context().span_id
                                   for s in sends), [s.name for s in sends]
    by_id = {s.attributes["messaging.message.id"]: s for s in sends
             if "messaging.message.id" in s.attributes}
    [batch_send] = [s for s in sends if s.attributes.get("messaging.batch.message_count") == 2]
    process = {s.attributes["messaging.message.id"]: s for s in finished
               if s.name.startswith("process ")}
    assert sorted(process) == sorted(ids), finished
    for mid, span in process.items():
        sender = by_id.get(mid, batch_send)
        assert span.context.trace_id == trace_id, f"{mid}: a new trace, not the publisher's"
        assert span.parent.span_id == sender.context.span_id, mid
        assert span.kind == SpanKind.CONSUMER
        assert span.attributes["messaging.consumer.group.name"] == sub.group
    assert process[batch[1]].status.status_code == StatusCode.ERROR

    assert _total(reader, "messaging.client.sent.messages") == 5
    assert _total(reader, "messaging.client.consumed.messages") == 5
    assert _total(reader, "mqabstract.client.settled.messages",
                  **{"mqabstract.outcome": "acked"}) == 4
    if dead:
        assert _total(reader, "mqabstract.client.settled.messages",
                      **{"mqabstract.outcome": "dead_lettered"}) == 1
    assert sum(p.count for p in _points(reader, "messaging.process.duration")) == 5
    text = repr([(s.name, dict(s.attributes)) for s in finished])
    secret = mq_ctx.url.split("@")[0] if "@" in mq_ctx.url else None
    assert secret is None or secret not in text, "the URL's credentials reached a span"
