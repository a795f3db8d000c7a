"""Kafka backend throughput next to raw kafka-python, in the same run, as ratios.

    .venv/bin/python bench/bench_kafka.py [--url kafka://127.0.0.1:9092] [--n 50000]
                                          [--size 100] [--batch 1000] [--rounds 2]

Produce: raw ``KafkaProducer`` (acks=all, idempotent, the same linger/batch settings as the
driver) sending ``n`` keyed records then flushing, or flushing every ``batch`` (the better
of the two is the baseline), against mqabstract ``publish_batch`` in chunks
of ``batch`` (every chunk waits for the broker's acks, as the contract requires).
Consume: a raw consumer-group member polling ``n`` records and committing after every poll,
against an mqabstract subscription receiving ``batch`` at a time and acking each message;
both read the same records (those published through mqabstract, with its headers).
Consume is timed from the first record to the last, so group joins are not counted.
Every measurement uses fresh topics and groups; rounds alternate raw / mqabstract and the
best round of each is reported. No assertions: numbers, not tests.
"""

from __future__ import annotations

import argparse
import secrets
import time

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

import mqabstract
from mqabstract.backends.kafka import kafka_topic_name


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def servers(url: str) -> list[str]:
    return [f"{h}:{p or 9092}" for h, p in mqabstract.BrokerURL.parse(url).hosts]


def raw_produce(url: str, topic: str, n: int, body: bytes, chunk: int | None = None) -> float:
    """Send ``n`` records and wait for all acks; with ``chunk``, flush every ``chunk``."""
    producer = KafkaProducer(bootstrap_servers=servers(url), acks="all",
                             enable_idempotence=True, linger_ms=2, batch_size=256 * 1024)
    producer.send(topic, b"warm-up").get(timeout=30)
    start = time.perf_counter()
    futures = []
    for i in range(n):
        futures.append(producer.send(topic, value=body, key=f"k{i}".encode()))
        if chunk and (i + 1) % chunk == 0:
            producer.flush()
    producer.flush()
    for f in futures:
        f.get(timeout=30)
    took = time.perf_counter() - start
    producer.close()
    return rate(n, took)


def mq_produce(broker: mqabstract.Broker, topic: str, n: int, body: bytes, batch: int) -> float:
    broker.publish(topic, b"warm-up")
    start = time.perf_counter()
    for lo in range(0, n, batch):
        broker.publish_batch([{"topic": topic, "body": body, "key": f"k{i}"}
                              for i in range(lo, min(n, lo + batch))])
    return rate(n, time.perf_counter() - start)


def raw_consume(url: str, topic: str, n: int) -> float:
    consumer = KafkaConsumer(topic, bootstrap_servers=servers(url),
                             group_id="bench-raw-" + secrets.token_hex(4),
                             enable_auto_commit=False, auto_offset_reset="earliest",
                             session_timeout_ms=6000, heartbeat_interval_ms=1000,  # Apache minimum
                             max_poll_records=1000, fetch_max_wait_ms=100)
    got, start = 0, None
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        batches = consumer.poll(timeout_ms=500)
        for records in batches.values():
            if start is None and records:
                start = time.perf_counter()
            got += sum(1 for r in records if r.value != b"warm-up")
        if batches:
            consumer.commit()
    took = time.perf_counter() - (start or time.perf_counter())
    consumer.close()
    return rate(got, took)


def mq_consume(broker: mqabstract.Broker, group: str, pattern: str, n: int, batch: int) -> float:
    sub = broker.subscribe(group, pattern, lease=300.0)
    got, start = 0, None
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        msgs = sub.receive(batch, 1.0)
        if msgs and start is None:
            start = time.perf_counter()
        for m in msgs:
            m.ack()
        got += sum(1 for m in msgs if m.body != b"warm-up")
    took = time.perf_counter() - (start or time.perf_counter())
    sub.close()
    return rate(got, took)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="kafka://127.0.0.1:9092")
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    body = b"x" * args.size
    broker = mqabstract.connect(args.url)
    admin = KafkaAdminClient(bootstrap_servers=servers(args.url))
    parts = broker.capabilities.max_consumers_per_group or 4
    best = {"raw produce": 0.0, "mq publish_batch": 0.0, "raw consume": 0.0,
            "mq consume": 0.0}
    try:
        for _ in range(args.rounds):
            token = "b" + secrets.token_hex(4)
            raw_topic = f"bench-raw-{token}"
            admin.create_topics([NewTopic(raw_topic, parts, -1)])
            mq_topic = f"bench.{token}.t"
            group = f"bench-{token}"
            broker.declare(group, f"bench.{token}.#")
            # The raw baseline is the better of "send all, then flush" and "flush every
            # batch" (the latter is what publish_batch does per call).
            best["raw produce"] = max(best["raw produce"],
                                      raw_produce(args.url, raw_topic, args.n, body),
                                      raw_produce(args.url, raw_topic, args.n, body, args.batch))
            best["mq publish_batch"] = max(
                best["mq publish_batch"], mq_produce(broker, mq_topic, args.n, body, args.batch))
            # Both consumers read the same records (the ones mqabstract published, with
            # its id / timestamp headers): the comparison is of the consuming side only.
            best["raw consume"] = max(best["raw consume"],
                                      raw_consume(args.url, kafka_topic_name(mq_topic), args.n))
            best["mq consume"] = max(best["mq consume"],
                                     mq_consume(broker, group, f"bench.{token}.#", args.n,
                                                args.batch))
            broker.delete_group(group)
            admin.delete_topics([raw_topic, kafka_topic_name(mq_topic)])
    finally:
        admin.close()
        broker.close()
    print(f"kafka bench: n={args.n} size={args.size} B batch={args.batch} "
          f"rounds={args.rounds} partitions={parts} (best round)")
    for name, value in best.items():
        print(f"  {name:18s} {value:10,.0f} msg/s")
    produce = best["mq publish_batch"] / max(best["raw produce"], 1e-9)
    consume = best["mq consume"] / max(best["raw consume"], 1e-9)
    print(f"  ratio publish_batch / raw produce: {produce:.2f}")
    print(f"  ratio consume / raw consume:       {consume:.2f}")


if __name__ == "__main__":
    main()
