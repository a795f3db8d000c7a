"""How long a consumer-group join takes on this broker, with plain kafka-python.

    .venv/bin/python bench/kafka_join_probe.py [--bootstrap 127.0.0.1:9092]
                                               [--session 2000] [--heartbeat 500]

One consumer polls continuously in a thread (no gaps, so kafka-python never abandons a
join); prints the seconds from ``subscribe`` to ``on_partitions_assigned`` for the first
join and for a re-subscription to one more topic. Numbers, not tests.
"""

from __future__ import annotations

import argparse
import secrets
import threading
import time

from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.admin import KafkaAdminClient, NewTopic


class _Seen(ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.assigned: list[set[str]] = []

    def on_partitions_revoked(self, revoked: object) -> None:
        pass

    def on_partitions_assigned(self, assigned: object) -> None:
        self.assigned.append({tp.topic for tp in assigned})  # type: ignore[attr-defined]


def _wait(seen: _Seen, topic: str, start: float, limit: float = 30.0) -> float:
    while time.monotonic() - start < limit:
        if any(topic in topics for topics in seen.assigned):
            return time.monotonic() - start
        time.sleep(0.01)
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default="127.0.0.1:9092")
    ap.add_argument("--session", type=int, default=2000)
    ap.add_argument("--heartbeat", type=int, default=500)
    args = ap.parse_args()
    admin = KafkaAdminClient(bootstrap_servers=args.bootstrap)
    t1, t2 = (f"probe-{secrets.token_hex(4)}" for _ in range(2))
    admin.create_topics([NewTopic(t1, 4, -1), NewTopic(t2, 4, -1)])
    consumer = KafkaConsumer(bootstrap_servers=args.bootstrap,
                             group_id=f"probe-{secrets.token_hex(4)}",
                             enable_auto_commit=False, session_timeout_ms=args.session,
                             heartbeat_interval_ms=args.heartbeat)
    seen = _Seen()
    lock = threading.Lock()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                consumer.poll(timeout_ms=100)

    try:
        start = time.monotonic()
        consumer.subscribe(topics=[t1], listener=seen)
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        first = _wait(seen, t1, start)
        with lock:
            start = time.monotonic()
            consumer.subscribe(topics=[t1, t2], listener=seen)
        again = _wait(seen, t2, start)
        stop.set()
        thread.join(5)
        print(f"session={args.session} ms heartbeat={args.heartbeat} ms: "
              f"first join {first:.2f} s, re-subscription {again:.2f} s")
    finally:
        stop.set()
        consumer.close(autocommit=False)
        admin.delete_topics([t1, t2])
        admin.close()


if __name__ == "__main__":
    main()
