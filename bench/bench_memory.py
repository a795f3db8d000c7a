"""In-memory backend: publish and full-cycle rates, and depth independence.

    python bench/bench_memory.py [--cycles 200000] [--deep 1000000]

Prints publish rates (single and batch), publish+receive+ack cycles per second, and the
receive+ack cost with 1,000 vs 1,000,000 messages already queued — the ratio should be ~1
because every operation is O(1)/O(log n). Numbers, not assertions: see README.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import mqabstract
from mqabstract import OutgoingMessage


def _broker() -> mqabstract.Broker:
    return mqabstract.connect(f"memory://bench-{uuid.uuid4().hex}")


def publish_single(n: int) -> float:
    with _broker() as mq:
        mq.declare("g", "bench.#")
        t0 = time.perf_counter()
        for _ in range(n):
            mq.publish("bench.t", b"x" * 100)
        return n / (time.perf_counter() - t0)


def publish_batch(n: int, batch: int = 1000) -> float:
    with _broker() as mq:
        mq.declare("g", "bench.#")
        items = [OutgoingMessage("bench.t", b"x" * 100) for _ in range(batch)]
        t0 = time.perf_counter()
        for _ in range(n // batch):
            mq.publish_batch(items)
        return (n // batch * batch) / (time.perf_counter() - t0)


def cycles(n: int, batch: int = 100) -> float:
    """publish_batch → receive(batch) → ack each, n messages in all."""
    with _broker() as mq:
        sub = mq.subscribe("g", "bench.#")
        items = [OutgoingMessage("bench.t", b"x" * 100) for _ in range(batch)]
        t0 = time.perf_counter()
        for _ in range(n // batch):
            mq.publish_batch(items)
            for msg in sub.receive(batch, 0):
                msg.ack()
        return (n // batch * batch) / (time.perf_counter() - t0)


def depth_cost(depth: int, probes: int = 20000) -> float:
    """Median µs per publish+receive+ack cycle while ``depth`` messages stay queued."""
    with _broker() as mq:
        sub = mq.subscribe("g", "bench.#")
        chunk = [OutgoingMessage("bench.t", b"x" * 100) for _ in range(10_000)]
        for _ in range(depth // 10_000):
            mq.publish_batch(chunk)
        mq.publish_batch(chunk[: depth % 10_000])
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(probes // 5):
                mq.publish("bench.t", b"x" * 100)
                [msg] = sub.receive(1, 0)
                msg.ack()
            samples.append((time.perf_counter() - t0) / (probes // 5) * 1e6)
        return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200_000)
    parser.add_argument("--shallow", type=int, default=1_000)
    parser.add_argument("--deep", type=int, default=1_000_000)
    args = parser.parse_args()
    print("memory:// backend, 100-byte bodies, one process")
    print(f"  publish (single)          {publish_single(args.cycles // 2):>12,.0f} msg/s")
    print(f"  publish_batch (1000)      {publish_batch(args.cycles):>12,.0f} msg/s")
    rate = cycles(args.cycles)
    print(f"  publish+receive+ack       {rate:>12,.0f} cycles/s (batches of 100)")
    shallow = depth_cost(args.shallow)
    deep = depth_cost(args.deep)
    print(f"  publish+receive+ack, {args.shallow:>9,} queued {shallow:>7.2f} µs/cycle")
    print(f"  publish+receive+ack, {args.deep:>9,} queued {deep:>7.2f} µs/cycle"
          f"   ratio deep/shallow {deep / shallow:.2f}")

if __name__ == "__main__":
    main()
