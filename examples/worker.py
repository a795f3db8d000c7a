"""A worker that fulfils orders: typed payloads, 8 handlers at once, a graceful stop.

    python examples/worker.py [URL] [--concurrency 8]

Subscribes the ``fulfilment`` group with ``model=Order``: each handler gets an ``Order``;
a message that is not a valid order is dead-lettered with the reason (never retried). The
handlers run as asyncio tasks, ``concurrency`` at once, leases renewed while they run.
SIGTERM or Ctrl-C stops taking orders, lets the running ones finish (30 s grace) and hands
the rest back for redelivery: nothing is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from orders import GROUP, Order

import mqabstract
from mqabstract import aio


async def fulfil(order: Order) -> None:
    """Stand-in for the real work (a call to a warehouse API, say)."""
    await asyncio.sleep(0.1 if order.express else 0.2)
    print(f"fulfilled {order.customer}: {sum(line.qty for line in order.lines)} items",
          flush=True)


async def run(url: str | None, *, concurrency: int = 8, signals: bool = True,
              max_messages: int | None = None, idle_timeout: float | None = None,
              work: Callable[[Order], Awaitable[None]] = fulfil) -> mqabstract.ConsumeStats:
    async with await aio.connect(url) as mq:
        sub = await mq.subscribe(GROUP, "orders.#", model=Order, max_attempts=5)

        async def handle(msg: aio.AsyncMessage) -> None:
            await work(msg.value)  # an Order: invalid ones never get here

        return await sub.consume(handle, concurrency=concurrency, signals=signals,
                                 max_messages=max_messages, idle_timeout=idle_timeout)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="fulfil orders")
    ap.add_argument("url", nargs="?")
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    stats = asyncio.run(run(args.url, concurrency=args.concurrency))
    print(stats)
