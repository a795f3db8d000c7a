"""Subprocess helper for the SQLite crash and multi-process tests (not a test module).

    python sqlite_worker.py publish URL TOPIC        # publish forever, print "PUB id" per id
    python sqlite_worker.py consume URL GROUP PATTERN LEASE HOLD_EVERY IDLE
        # receive in batches; print "RECV id attempt"; ack all but every HOLD_EVERY-th
        # message, printing "ACKING id" before and "ACKED id" after each ack; exit after
        # IDLE seconds without messages (0 = never)

Every line is flushed, so a parent that SIGKILLs this process knows exactly what happened.
"""

from __future__ import annotations

import itertools
import sys
import time

import mqabstract


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def publish(url: str, topic: str) -> None:
    with mqabstract.connect(url) as mq:
        for n in itertools.count():
            if n % 3 == 0:  # mix single publishes and small batches
                ids = mq.publish_batch([(topic, f"m{n}-{i}") for i in range(5)])
            else:
                ids = [mq.publish(topic, f"m{n}", key=f"k{n % 4}")]
            for mid in ids:
                out(f"PUB {mid}")


def consume(url: str, group: str, pattern: str, lease: float, hold_every: int,
            idle: float) -> None:
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe(group, pattern, lease=lease, max_attempts=100)
        last = time.monotonic()
        seen = 0
        while True:
            msgs = sub.receive(max_messages=10, wait=0.2)
            if not msgs:
                if idle and time.monotonic() - last > idle:
                    return
                continue
            last = time.monotonic()
            for msg in msgs:
                seen += 1
                out(f"RECV {msg.id} {msg.attempt}")
                if hold_every and seen % hold_every == 0:
                    continue  # never settled: the lease must expire and bring it back
                out(f"ACKING {msg.id}")
                try:
                    msg.ack()
                except mqabstract.LeaseExpired:
                    # a loaded machine can take longer than the 1 s lease for ten fsynced
                    # acks: the message comes back (the test counts it as in doubt)
                    out(f"EXPIRED {msg.id}")
                    continue
                out(f"ACKED {msg.id}")


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    if mode == "publish":
        publish(url, sys.argv[3])
    elif mode == "consume":
        consume(url, sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6]),
                float(sys.argv[7]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
