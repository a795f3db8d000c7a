"""What the asyncio API costs over the sync one, per backend, as ratios.

    .venv/bin/python bench/bench_aio.py [--url URL ...] [--n 2000] [--concurrency 8]

For each URL (default: memory and an SQLite file): single publishes one after another
(sync ``Broker.publish`` against ``await AsyncBroker.publish``), ``concurrency``
publishers at once (threads against tasks), and receive + ack of ``n`` messages in
batches of 100 (``ack_many``). Prints msg/s and async/sync. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import mqabstract
from mqabstract import aio


def sync_run(url: str, n: int, conc: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with mqabstract.connect(url) as mq:
        tag = secrets.token_hex(4)
        sub = mq.subscribe(f"aio-{tag}", f"aio.{tag}.#", lease=60)
        start = time.perf_counter()
        for _ in range(n):
            mq.publish(f"aio.{tag}.a", b"x" * 100)
        out["publish"] = n / (time.perf_counter() - start)
        start = time.perf_counter()
        with ThreadPoolExecutor(conc) as pool:
            list(pool.map(lambda _: mq.publish(f"aio.{tag}.a", b"x" * 100), range(n)))
        out["concurrent publish"] = n / (time.perf_counter() - start)
        got, start = 0, time.perf_counter()
        while got < 2 * n:
            msgs = sub.receive(100, 5)
            sub.ack_many(msgs)
            got += len(msgs)
        out["receive+ack"] = got / (time.perf_counter() - start)
        sub.close()
        mq.delete_group(f"aio-{tag}")
    return out


async def async_run(url: str, n: int, conc: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with await aio.connect(url) as mq:
        tag = secrets.token_hex(4)
        sub = await mq.subscribe(f"aio-{tag}", f"aio.{tag}.#", lease=60)
        start = time.perf_counter()
        for _ in range(n):
            await mq.publish(f"aio.{tag}.a", b"x" * 100)
        out["publish"] = n / (time.perf_counter() - start)
        start = time.perf_counter()
        sem = asyncio.Semaphore(conc)

        async def one() -> None:
            async with sem:
                await mq.publish(f"aio.{tag}.a", b"x" * 100)

        await asyncio.gather(*(one() for _ in range(n)))
        out["concurrent publish"] = n / (time.perf_counter() - start)
        got, start = 0, time.perf_counter()
        while got < 2 * n:
            msgs = await sub.receive(100, 5)
            await sub.ack_many(msgs)
            got += len(msgs)
        out["receive+ack"] = got / (time.perf_counter() - start)
        await sub.close()
        await mq.delete_group(f"aio-{tag}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", action="append")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        urls = args.url or ["memory://bench-aio", f"sqlite:///{tmp}/aio.db"]
        print(f"n={args.n} concurrency={args.concurrency} (msg/s)")
        print(f"  {'backend':10s} {'operation':20s} {'sync':>10s} {'asyncio':>10s}  async/sync")
        for url in urls:
            s = sync_run(url, args.n, args.concurrency)
            a = asyncio.run(async_run(url, args.n, args.concurrency))
            name = mqabstract.BrokerURL.parse(url).scheme
            for op in s:
                print(f"  {name:10s} {op:20s} {s[op]:10,.0f} {a[op]:10,.0f}  "
                      f"{a[op] / s[op]:6.2f}")


if __name__ == "__main__":
    main()
