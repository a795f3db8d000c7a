"""What the OpenTelemetry middleware costs, as ratios to the same work without it.

    .venv/bin/python bench/bench_otel.py [--url URL ...] [--n 20000] [--rounds 3]

For each URL (default: memory and ``$MQ_TEST_RABBITMQ_URL`` when set, as ``scripts/brokers
env`` prints it): ``publish_batch`` (500 per call), ``consume`` (a handler that does nothing,
ack per message; the messages carry the trace context, so every one is extracted and gets
a ``process`` span) and single ``publish``, each with and without
``mqabstract.otel.OpenTelemetry()`` on an SDK whose exporters drop everything (the spans and
metric points are still made, batched and handed over, as in production). Rounds
alternate plain/otel; the median of each is reported with otel/plain (1.00 = free).
``--sample 0.1`` samples a tenth of the traces (the consumers follow the publisher's
decision): unsampled spans are not recorded, the metrics still are.
"""

from __future__ import annotations

import argparse
import functools
import os
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


def _rate(n: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def publish_batch(url: str, n: int, otel: OpenTelemetry | None) -> float:
    tag = secrets.token_hex(4)
    with _connect(url, otel) as mq:
        mq.declare(f"bo-{tag}", f"bo.{tag}.#")
        batch = [(f"bo.{tag}.a", b"x" * 100)] * 500

        def run() -> None:
            for _ in range(n // 500):
                mq.publish_batch(batch)

        rate = _rate(n // 500 * 500, run)
        mq.delete_group(f"bo-{tag}")
        return rate


def publish(url: str, n: int, otel: OpenTelemetry | None) -> float:
    tag = secrets.token_hex(4)
    with _connect(url, otel) as mq:
        mq.declare(f"bo-{tag}", f"bo.{tag}.#")
        rate = _rate(n, lambda: [mq.publish(f"bo.{tag}.a", b"x" * 100) for _ in range(n)])
        mq.delete_group(f"bo-{tag}")
        return rate


def consume(url: str, n: int, otel: OpenTelemetry | None) -> float:
    tag = secrets.token_hex(4)
    group = f"bo-{tag}"
    with _connect(url, otel) as mq:
        mq.declare(group, f"bo.{tag}.#", lease=60)
        for start in range(0, n, 500):
            mq.publish_batch([(f"bo.{tag}.a", b"x" * 100)] * min(500, n - start))
        sub = mq.subscribe(group, f"bo.{tag}.#", lease=60)
        rate = _rate(n, lambda: sub.consume(lambda m: None, max_messages=n))
        sub.close()
        mq.delete_group(group)
        return rate


def compare(name: str, fn: Callable[[OpenTelemetry | None], float], rounds: int,
            sample: float) -> None:
    plain, traced = [], []
    otel = _middleware(sample)
    for _ in range(rounds):
        plain.append(fn(None))
        traced.append(fn(otel))
    p, t = statistics.median(plain), statistics.median(traced)
    each = ", ".join(f"{b / a:.2f}" for a, b in zip(plain, traced, strict=True))
    print(f"  {name:<14} plain {p:>9,.0f} msg/s   otel {t:>9,.0f} msg/s   otel/plain "
          f"{t / p:.2f}  (rounds: {each})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--single-n", type=int, default=2_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sample", type=float, default=1.0,
                    help="the tracer's sampling ratio (ParentBased(TraceIdRatioBased))")
    args = ap.parse_args()
    urls = args.url or ["memory://bench-otel", *filter(None, [
        os.environ.get("MQ_TEST_RABBITMQ_URL")])]
    for url in urls:
        print(mqabstract.BrokerURL.parse(url).redacted(), flush=True)
        for name, fn, n in (("publish_batch", publish_batch, args.n),
                            ("consume", consume, args.n), ("publish", publish, args.single_n)):
            compare(name, functools.partial(fn, url, n), args.rounds, args.sample)


if __name__ == "__main__":
    main()
