"""How long records published to topics a subscription has not seen yet take to arrive.

    eval "$(scripts/brokers env kafka)"; .venv/bin/python bench/kafka_new_topics.py

One group on ``root.#``; six records, each to a new topic, then six to one known topic.
Prints seconds from the first publish to each arrival. The data consumer adopts a new
topic on its next refresh (at once when this process created it) and positions it
before fetching, so new topics lag; a known topic does not. Numbers, not assertions.
"""

from __future__ import annotations

import os
import time
import uuid

import mqabstract


def main() -> None:
    url = os.environ.get("MQ_TEST_KAFKA_URL", "kafka://127.0.0.1:9092")
    root = "lat" + uuid.uuid4().hex[:8]
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe("g" + root, f"{root}.#", lease=30)
        for label, topics in (("six new topics", [f"{root}.t{i}" for i in range(6)]),
                              ("one known topic", [f"{root}.t0"] * 6)):
            start = time.monotonic()
            for topic in topics:
                mq.publish(topic, b"x")
            seen: list[float] = []
            while len(seen) < 6 and time.monotonic() - start < 30:
                for msg in sub.receive(10, 1.0):
                    seen.append(round(time.monotonic() - start, 2))
                    msg.ack()
            print(f"{label}: arrivals after {seen} s")
        sub.close()
        mq.delete_group("g" + root)


if __name__ == "__main__":
    main()
