"""Request/reply round-trip latency per backend: ``Broker.request`` against a responder
running ``consume(handler, reply=True)`` on its own connection in this process.

    .venv/bin/python bench/bench_request.py [--url URL ...] [--n 300]

Default URLs: memory, a SQLite file in a temporary directory, and the brokers that
``scripts/brokers env`` exports (``MQ_TEST_RABBITMQ_URL``, ``MQ_TEST_KAFKA_URL``,
``MQ_TEST_SQS_URL``). After 20 warm-up requests, ``n`` requests one after another (SQS: a
fifth of them, moto answers slowly); prints p50 / p99 / max in milliseconds and the
sequential request rate. The first request of a broker (which declares its reply route)
is reported apart: on Kafka it creates a topic and joins a group.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import tempfile
import threading
import time

import mqabstract


def _urls(given: list[str] | None, tmp: str) -> list[str]:
    if given:
        return given
    urls = ["memory://bench-rr", f"sqlite:///{tmp}/rr.db"]
    for name in ("MQ_TEST_RABBITMQ_URL", "MQ_TEST_KAFKA_URL", "MQ_TEST_SQS_URL"):
        if os.environ.get(name):
            urls.append(os.environ[name])
    return urls


def run(url: str, n: int) -> dict[str, float]:
    tag = secrets.token_hex(4)
    topic, group = f"bench.rr{tag}.echo", f"bench-rr{tag}"
    with mqabstract.connect(url) as service, mqabstract.connect(url) as client:
        sub = service.subscribe(group, f"bench.rr{tag}.#")
        worker = threading.Thread(
            target=lambda: sub.consume(lambda m: m.body, reply=True), daemon=True)
        worker.start()
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
        sub.stop()
        worker.join(30)
        service.delete_group(group)
    times.sort()
    return {"first_ms": first * 1000, "p50_ms": times[len(times) // 2] * 1000,
            "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] * 1000,
            "max_ms": times[-1] * 1000, "per_s": n / sum(times),
            "mean_ms": statistics.fmean(times) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append")
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'backend':10} {'first':>8} {'p50':>8} {'p99':>8} {'max':>8} {'req/s':>8}")
        for url in _urls(args.url, tmp):
            n = max(10, args.n // 5) if url.startswith("sqs") else args.n
            r = run(url, n)
            name = url.split(":", 1)[0].replace("amqp", "rabbitmq")
            print(f"{name:10} {r['first_ms']:8.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                  f"{r['max_ms']:8.1f} {r['per_s']:8.0f}   (ms; n={n})", flush=True)


if __name__ == "__main__":
    main()
