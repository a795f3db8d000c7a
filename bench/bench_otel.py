"""What the OpenTelemetry middleware adds per message, against the same work without it.

    .venv/bin/python bench/bench_otel.py [--url URL ...] [--n 10000] [--single-n 2000]
                                         [--rounds 3] [--sample 1.0] [--contexts distinct]

For each URL (default: memory and ``$MQ_TEST_RABBITMQ_URL`` when set, as ``scripts/brokers
env`` prints it), each operation runs without middleware ("plain") and with
``mqabstract.otel.OpenTelemetry()`` on an SDK whose exporters drop everything (spans and
metric points are still made, batched and handed over, as in production), in alternating
rounds:

- ``publish``: single publishes (one send span each);
- ``publish_batch``: 500 per call (one send span per call);
- ``consume``: a handler that does nothing, acked by the loop (a process span each);
- ``receive_batch``: 100 per ``receive_batch``, acked with ``Batch.ack()``.

The consumed messages are published without middleware and carry a trace context each
(``--contexts distinct``: one per message, as single publishes give them; ``shared``: one
for all, as one ``publish_batch`` gives them), identical in the plain and the otel runs.
Printed per operation: the plain and otel rates (wall clock), and the microseconds the
middleware adds per message — otel minus plain, per message, paired round by round, the
median — in CPU time of the process (every thread: the span processor's too) and in wall
time. On a loaded machine the CPU figure is the steadier one. Before and after, the cost
of the SDK alone (a span, a histogram point) is printed: the floor of any operation that
makes one of each. ``--sample 0.1`` samples a tenth of the traces (consumers follow the
publisher's decision).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

import mqabstract
from mqabstract.otel import OpenTelemetry

#: (cpu seconds, wall seconds, messages) of one timed run.
Run = tuple[float, float, int]


class _DropSpans(SpanExporter):
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class _DropMetrics(MetricExporter):
    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kw: Any
               ) -> MetricExportResult:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kw: Any) -> None:
        pass


def _middleware(sample: float) -> OpenTelemetry:
    tracing = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sample)))
    tracing.add_span_processor(BatchSpanProcessor(_DropSpans()))
    meters = MeterProvider([PeriodicExportingMetricReader(_DropMetrics(), 10_000)])
    return OpenTelemetry(tracer_provider=tracing, meter_provider=meters, gauges=False)


def _connect(url: str, otel: OpenTelemetry | None) -> mqabstract.Broker:
    return mqabstract.connect(url, middleware=[otel] if otel else [])


def _timed(n: int, fn: Callable[[], object]) -> Run:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall, n


def _traceparent(sampled: bool) -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"


def _fill(mq: mqabstract.Broker, topic: str, n: int, contexts: str, sample: float) -> None:
    """``n`` messages on ``topic`` carrying trace contexts, published without middleware."""
    shared = {"traceparent": _traceparent(True)}
    for start in range(0, n, 500):
        rows = min(500, n - start)
        headers = [shared if contexts == "shared" else
                   {"traceparent": _traceparent(random.random() < sample)}
                   for _ in range(rows)]
        mq.publish_columns(topic, [b"x" * 100] * rows, row_headers=headers)


def publish(url: str, n: int, otel: OpenTelemetry | None, **_: Any) -> Run:
    tag = secrets.token_hex(4)
    with _connect(url, otel) as mq:
        mq.declare(f"bo-{tag}", f"bo.{tag}.#")
        run = _timed(n, lambda: [mq.publish(f"bo.{tag}.a", b"x" * 100) for _ in range(n)])
        mq.delete_group(f"bo-{tag}")
        return run


def publish_batch(url: str, n: int, otel: OpenTelemetry | None, **_: Any) -> Run:
    tag = secrets.token_hex(4)
    with _connect(url, otel) as mq:
        mq.declare(f"bo-{tag}", f"bo.{tag}.#")
        batch = [(f"bo.{tag}.a", b"x" * 100)] * 500

        def run() -> None:
            for _ in range(n // 500):
                mq.publish_batch(batch)

        timed = _timed(n // 500 * 500, run)
        mq.delete_group(f"bo-{tag}")
        return timed


def consume(url: str, n: int, otel: OpenTelemetry | None, contexts: str = "distinct",
            sample: float = 1.0) -> Run:
    tag = secrets.token_hex(4)
    group = f"bo-{tag}"
    with _connect(url, None) as plain:
        plain.declare(group, f"bo.{tag}.#", lease=60)
        _fill(plain, f"bo.{tag}.a", n, contexts, sample)
    with _connect(url, otel) as mq:
        sub = mq.subscribe(group, f"bo.{tag}.#", lease=60)
        run = _timed(n, lambda: sub.consume(lambda m: None, max_messages=n))
        sub.close()
        mq.delete_group(group)
        return run


def receive_batch(url: str, n: int, otel: OpenTelemetry | None, contexts: str = "distinct",
                  sample: float = 1.0) -> Run:
    tag = secrets.token_hex(4)
    group = f"bo-{tag}"
    with _connect(url, None) as plain:
        plain.declare(group, f"bo.{tag}.#", lease=60)
        _fill(plain, f"bo.{tag}.a", n, contexts, sample)
    with _connect(url, otel) as mq:
        sub = mq.subscribe(group, f"bo.{tag}.#", lease=60)

        def run() -> None:
            got = 0
            while got < n:
                batch = sub.receive_batch(min(100, n - got), 5.0)
                batch.ack()
                got += len(batch)

        timed = _timed(n, run)
        sub.close()
        mq.delete_group(group)
        return timed


def sdk_floor(sample: float, n: int = 5_000) -> str:
    """What the SDK alone costs here, in CPU µs: a span like a send span (four
    attributes) started and ended, a histogram point with three attributes — the part of
    the added cost that no middleware can cut while it makes them per message."""
    otel = _middleware(sample)
    attrs = {"messaging.system": "mqabstract.memory", "messaging.operation.name": "send",
             "messaging.destination.name": "bo.floor.a"}
    span_attrs = {**attrs, "messaging.operation.type": "send"}
    tracer, histogram = otel.tracer, otel.duration

    def each(fn: Callable[[], object]) -> float:
        runs = []
        for _ in range(3):
            cpu = time.process_time()
            for _ in range(n):
                fn()
            runs.append((time.process_time() - cpu) / n * 1e6)
        return statistics.median(runs)

    span = each(lambda: tracer.start_span("send bo.floor.a", attributes=span_attrs).end())
    point = each(lambda: histogram.record(0.001, attrs))
    return f"SDK alone: a span {span:.1f} µs CPU, a histogram point {point:.1f} µs CPU"


def compare(name: str, fn: Callable[[OpenTelemetry | None], Run], rounds: int,
            otel: OpenTelemetry) -> None:
    plain: list[Run] = []
    traced: list[Run] = []
    for _ in range(rounds):
        plain.append(fn(None))
        traced.append(fn(otel))

    def rate(runs: list[Run]) -> float:
        return statistics.median(m / wall for _, wall, m in runs)

    def added(i: int) -> list[float]:  # µs per message, otel minus plain, round by round
        return [(t[i] / t[2] - p[i] / p[2]) * 1e6 for p, t in zip(plain, traced, strict=True)]

    cpu, wall = added(0), added(1)
    print(f"  {name:<14} plain {rate(plain):>9,.0f} msg/s  otel {rate(traced):>9,.0f} msg/s"
          f"  added per message: {statistics.median(cpu):6.1f} µs CPU"
          f" ({', '.join(f'{x:.1f}' for x in cpu)})  {statistics.median(wall):6.1f} µs wall",
          flush=True)


OPS: dict[str, Callable[..., Run]] = {
    "publish": publish, "publish_batch": publish_batch, "consume": consume,
    "receive_batch": receive_batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append")
    ap.add_argument("--n", type=int, default=10_000, help="messages per batch-op run")
    ap.add_argument("--single-n", type=int, default=2_000,
                    help="messages per publish and consume run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sample", type=float, default=1.0,
                    help="the tracer's sampling ratio (ParentBased(TraceIdRatioBased))")
    ap.add_argument("--contexts", choices=("distinct", "shared"), default="distinct",
                    help="the trace contexts the consumed messages carry")
    ap.add_argument("--op", action="append", choices=sorted(OPS))
    args = ap.parse_args()
    urls = args.url or ["memory://bench-otel", *filter(None, [
        os.environ.get("MQ_TEST_RABBITMQ_URL")])]
    otel = _middleware(args.sample)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"sample {args.sample:g}, contexts {args.contexts}", flush=True)
    print(sdk_floor(args.sample), flush=True)
    for url in urls:
        print(mqabstract.BrokerURL.parse(url).redacted(), flush=True)
        for name in args.op or OPS:
            n = args.single_n if name in ("publish", "consume") else args.n
            compare(name, functools.partial(OPS[name], url, n, contexts=args.contexts,
                                            sample=args.sample), args.rounds, otel)
    print(sdk_floor(args.sample), flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
