"""Our own CPU per Kafka ``Broker.publish``, librdkafka left out: the cost of the portable
layer and the driver's publish path alone, in µs.

    .venv/bin/python bench/kafka_publish_python.py [--url kafka://127.0.0.1:9092]
        [--n 20000] [--rounds 7]

Opens a broker (confluent-kafka client), publishes once for real (topic creation), then
replaces each idle producer lane's librdkafka producer with a stub whose ``produce`` and
``flush`` do nothing, and times ``n`` publishes per round with the thread's CPU clock.
What is left is Python: validation, the envelope, the topic name, the record, the lane
pool and the result check. No assertions: numbers. Compare two checkouts by running it in
each (the real publish costs about three times this in wall time: between two publishes
librdkafka's threads run, and this code runs cold).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mqabstract


class _Stub:
    """A librdkafka producer that sends nothing and always reports every record sent."""

    def produce(self, *args: Any, **kwargs: Any) -> None:
        return None

    def flush(self, timeout: float | None = None) -> int:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="kafka://127.0.0.1:9092")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with mqabstract.connect(args.url) as broker:
        topic = "bench.python-publish"
        broker.publish(topic, b"warm-up")
        lanes = broker._driver.producer.idle  # type: ignore[attr-defined]
        for lane in lanes:
            lane.p = _Stub()
        body = b"x" * 100
        per = []
        for _ in range(args.rounds):
            start = time.thread_time()
            for _ in range(args.n):
                broker.publish(topic, body)
            per.append((time.thread_time() - start) / args.n * 1e6)
    print(f"publish, librdkafka stubbed: {statistics.median(per):.2f} µs CPU per call "
          f"(median of {args.rounds} rounds of {args.n}; min {min(per):.2f}, "
          f"max {max(per):.2f})")


if __name__ == "__main__":
    main()
