"""The consume loop's throughput, sync and asyncio, as ratios.

    .venv/bin/python bench/bench_consume.py [--url URL ...] [--n 3000] [--slow-n 40]

For each URL (default: memory, an SQLite file, and the brokers named by the
``MQ_TEST_*_URL`` variables that ``scripts/brokers env`` prints):

- a 100 ms handler (I/O-bound work: ``time.sleep`` / ``asyncio.sleep``) at concurrency 1
  and 8, sync and asyncio: msg/s and c8/c1 (the ideal is 8);
- a handler that does nothing: ``consume`` (ack per message) against the hand-written loop
  a user would write without it (``receive(10)`` then ``ack`` each), the loop's own cost.

Numbers, not assertions (tests check what the loop does, not how fast).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import tempfile
import time
from collections.abc import Callable

import mqabstract
from mqabstract import aio


def _fill(mq: mqabstract.Broker, n: int) -> tuple[str, str]:
    tag = secrets.token_hex(4)
    group, topic = f"bc-{tag}", f"bc.{tag}.a"
    mq.declare(group, f"bc.{tag}.#", lease=60)
    for start in range(0, n, 1000):
        mq.publish_batch([(topic, b"x" * 100)] * min(1000, n - start))
    return group, topic


def _rate(n: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def sync_consume(url: str, n: int, concurrency: int, slow: bool) -> float:
    with mqabstract.connect(url) as mq:
        group, _ = _fill(mq, n)
        sub = mq.subscribe(group, group.replace("bc-", "bc.") + ".#", lease=60)

        def handler(msg: mqabstract.Message) -> None:
            if slow:
                time.sleep(0.1)

        rate = _rate(n, lambda: sub.consume(handler, concurrency=concurrency, max_messages=n))
        sub.close()
        mq.delete_group(group)
        return rate


def async_consume(url: str, n: int, concurrency: int, slow: bool) -> float:
    with mqabstract.connect(url) as mq:
        group, _ = _fill(mq, n)

    async def main() -> float:
        async with await aio.connect(url) as amq:
            sub = await amq.subscribe(group, group.replace("bc-", "bc.") + ".#", lease=60)

            async def handler(msg: aio.AsyncMessage) -> None:
                if slow:
                    await asyncio.sleep(0.1)

            start = time.perf_counter()
            await sub.consume(handler, concurrency=concurrency, max_messages=n)
            rate = n / (time.perf_counter() - start)
            await sub.close()
            await amq.delete_group(group)
            return rate

    return asyncio.run(main())


def hand_loop(url: str, n: int) -> float:
    with mqabstract.connect(url) as mq:
        group, _ = _fill(mq, n)
        sub = mq.subscribe(group, group.replace("bc-", "bc.") + ".#", lease=60)

        def run() -> None:
            got = 0
            while got < n:
                for msg in sub.receive(10, 1.0):
                    msg.ack()
                    got += 1

        rate = _rate(n, run)
        sub.close()
        mq.delete_group(group)
        return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--slow-n", type=int, default=40)
    args = ap.parse_args()
    urls = args.url or [
        "memory://bench-consume", f"sqlite:///{tempfile.mkdtemp()}/bench.db",
        *(os.environ[v] for v in ("MQ_TEST_RABBITMQ_URL", "MQ_TEST_KAFKA_URL",
                                  "MQ_TEST_SQS_URL") if os.environ.get(v))]
    print("| backend | api | 100 ms handler c=1 | c=8 | c8/c1 | no-op handler consume "
          "| hand loop | consume/hand |")
    print("|---|---|---|---|---|---|---|---|")
    for url in urls:
        name = mqabstract.connect(url).backend if "://" in url else url
        hand = hand_loop(url, args.n)
        for api, run in (("sync", sync_consume), ("async", async_consume)):
            c1 = run(url, args.slow_n // 4, 1, True)
            c8 = run(url, args.slow_n * 2, 8, True)
            fast = run(url, args.n, 1, False)
            print(f"| {name} | {api} | {c1:,.1f} | {c8:,.1f} | {c8 / c1:.2f} | {fast:,.0f} "
                  f"| {hand:,.0f} | {fast / hand:.2f} |", flush=True)


if __name__ == "__main__":
    main()
