"""One process's portable-layer cost on the memory backend: publish N messages one at a
time, then receive and ack them all in batches of 100. A whole-process workload for
before/after comparisons of the publish and receive paths with ``farm-bench``:

    farm-bench -n 5 --vs "OLD/.venv/bin/python bench/publish_cycle.py 30000" \\
        -- .venv/bin/python bench/publish_cycle.py 30000

(OLD: a checkout of the earlier revision.) Prints nothing; the time is the figure.
"""

from __future__ import annotations

import sys
import uuid

import mqabstract


def main(n: int) -> None:
    with mqabstract.connect(f"memory://cycle-{uuid.uuid4().hex}") as mq:
        mq.declare("g", "bench.#")
        body = b"x" * 100
        for _ in range(n):
            mq.publish("bench.t", body)
        sub = mq.subscribe("g", "bench.#")
        got = 0
        while got < n:
            msgs = sub.receive(100, 0.1)
            sub.ack_many(msgs)
            got += len(msgs)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30_000)
