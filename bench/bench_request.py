"""Request/reply round-trip latency per backend: ``Broker.request`` against a responder
running ``consume(handler, reply=True)`` on its own connection in this process.

    .venv/bin/python bench/bench_request.py [--url URL ...] [--n 300] [--api sync|asyncio|both]

Default URLs: memory, a SQLite file in a temporary directory, and the brokers that
``scripts/brokers env`` exports (``MQ_TEST_RABBITMQ_URL``, ``MQ_TEST_KAFKA_URL``,
``MQ_TEST_SQS_URL``). After 20 warm-up requests, ``n`` requests one after another (SQS: a
fifth of them, moto answers slowly); prints p50 / p99 / max in milliseconds and the
sequential request rate. The first request of a broker (which declares its reply route)
is reported apart: on Kafka it creates a topic and joins a group. The asyncio rows
(``AsyncBroker.request``, which waits on a future) add the rate with all ``n`` requests
awaited at once (gather), where the sync API would need a thread per request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import tempfile
import threading
import time

import mqabstract
from mqabstract import aio


def _urls(given: list[str] | None, tmp: str) -> list[str]:
    if given:
        return given
    urls = ["memory://bench-rr", f"sqlite:///{tmp}/rr.db"]
    for name in ("MQ_TEST_RABBITMQ_URL", "MQ_TEST_KAFKA_URL", "MQ_TEST_SQS_URL"):
        if os.environ.get(name):
            urls.append(os.environ[name])
    return urls


def _summary(first: float, times: list[float]) -> dict[str, float]:
    times.sort()
    return {"first_ms": first * 1000, "p50_ms": times[len(times) // 2] * 1000,
            "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] * 1000,
            "max_ms": times[-1] * 1000, "per_s": len(times) / sum(times),
            "mean_ms": statistics.fmean(times) * 1000}


def _responder(url: str, tag: str) -> tuple[mqabstract.Broker, mqabstract.Subscription,
                                             threading.Thread]:
    service = mqabstract.connect(url)
    sub = service.subscribe(f"bench-rr{tag}", f"bench.rr{tag}.#")
    worker = threading.Thread(
        target=lambda: sub.consume(lambda m: m.body, reply=True, concurrency=4),
        daemon=True)
    worker.start()
    return service, sub, worker


def _stop(service: mqabstract.Broker, sub: mqabstract.Subscription, worker: threading.Thread,
          tag: str) -> None:
    sub.stop()
    worker.join(30)
    service.delete_group(f"bench-rr{tag}")
    service.close()


def run(url: str, n: int) -> dict[str, float]:
    tag = secrets.token_hex(4)
    topic = f"bench.rr{tag}.echo"
    service, sub, worker = _responder(url, tag)
    try:
        with mqabstract.connect(url) as client:
            t0 = time.perf_counter()
            client.request(topic, b"first", timeout=60)
            first = time.perf_counter() - t0
            for _ in range(20):
                client.request(topic, b"warm", timeout=30)
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                reply = client.request(topic, str(i).encode(), timeout=30)
                times.append(time.perf_counter() - t0)
                assert reply.body == str(i).encode()
    finally:
        _stop(service, sub, worker, tag)
    return _summary(first, times)


async def run_async(url: str, n: int) -> dict[str, float]:
    tag = secrets.token_hex(4)
    topic = f"bench.rr{tag}.echo"
    service, sub, worker = _responder(url, tag)
    try:
        async with await aio.connect(url) as client:
            t0 = time.perf_counter()
            await client.request(topic, b"first", timeout=60)
            first = time.perf_counter() - t0
            for _ in range(20):
                await client.request(topic, b"warm", timeout=30)
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                reply = await client.request(topic, str(i).encode(), timeout=30)
                times.append(time.perf_counter() - t0)
                assert reply.body == str(i).encode()
            t0 = time.perf_counter()
            many = await asyncio.gather(*(client.request(topic, str(i).encode(), timeout=60)
                                          for i in range(n)))
            wide = n / (time.perf_counter() - t0)
            assert [m.body for m in many] == [str(i).encode() for i in range(n)]
    finally:
        _stop(service, sub, worker, tag)
    return {**_summary(first, times), "wide_per_s": wide}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--api", choices=("sync", "asyncio", "both"), default="both")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'backend':10} {'api':8} {'first':>8} {'p50':>8} {'p99':>8} {'max':>8} "
              f"{'req/s':>8} {'all at once':>12}")
        for url in _urls(args.url, tmp):
            n = max(10, args.n // 5) if url.startswith("sqs") else args.n
            name = url.split(":", 1)[0].replace("amqp", "rabbitmq")
            rows = []
            if args.api in ("sync", "both"):
                rows.append(("sync", run(url, n)))
            if args.api in ("asyncio", "both"):
                rows.append(("asyncio", asyncio.run(run_async(url, n))))
            for api, r in rows:
                wide = f"{r['wide_per_s']:12.0f}" if "wide_per_s" in r else f"{'':12}"
                print(f"{name:10} {api:8} {r['first_ms']:8.1f} {r['p50_ms']:8.2f} "
                      f"{r['p99_ms']:8.2f} {r['max_ms']:8.1f} {r['per_s']:8.0f} {wide}"
                      f"   (ms; n={n})", flush=True)


if __name__ == "__main__":
    main()
