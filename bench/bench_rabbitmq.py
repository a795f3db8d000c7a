"""RabbitMQ backend throughput, next to raw pika doing the same work in the same run.

    .venv/bin/python bench/bench_rabbitmq.py [--url amqp://guest:guest@127.0.0.1:5672/%2F]
        [--single 2000] [--n 20000] [--batch 1000] [--prefetch 100]

Both sides publish persistent 100-byte messages through a durable topic exchange into a
durable quorum queue (what an mqabstract group is) and wait for publisher confirms.

* single: one message per call, waiting for its confirm (raw: BlockingChannel with
  ``confirm_delivery``; mqabstract: ``Broker.publish``).
* batch: mqabstract ``publish_batch`` (confirms pipelined) against raw pika's only
  BlockingChannel way, one confirm per message — the ratio the issue asks for.
* consume: receive + ack every message at the same prefetch (raw: ``basic_consume`` with a
  manual ack per message; mqabstract: ``Subscription.receive`` + ``Message.ack``).
* redeliver (``--nack``, default 2000): every message refused once and received again,
  then acked; the rate counts messages, both passes. Raw: ``basic_nack(requeue=True)``
  (the broker counts the delivery); mqabstract: ``Message.nack()``, which puts a copy
  with the next attempt written down into the queue, confirmed, then acks the original
  (docs/backends/rabbitmq.md, *Redelivery*).

Prints msg/s and the mqabstract / raw ratio. No assertions: numbers, not tests.
"""

from __future__ import annotations

import argparse
import secrets
import time

import pika

import mqabstract

BODY = b"x" * 100


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


class Raw:
    """Raw pika on its own exchange + quorum queue (same shape as an mqabstract group)."""

    def __init__(self, url: str, token: str) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.ch = self.conn.channel()
        self.exchange = f"bench-raw-{token}"
        self.queue = f"bench-raw-{token}-q"
        self.ch.exchange_declare(self.exchange, "topic", durable=True)
        self.ch.queue_declare(self.queue, durable=True, arguments={"x-queue-type": "quorum"})
        self.ch.queue_bind(self.queue, self.exchange, routing_key="bench.#")
        self.ch.confirm_delivery()
        self.props = pika.BasicProperties(delivery_mode=2, message_id="m")

    def publish(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.ch.basic_publish(self.exchange, "bench.raw", BODY, self.props)
        return rate(n, time.perf_counter() - t0)

    def _consume(self, n: int, prefetch: int, requeue_first: bool) -> float:
        """Ack ``n`` deliveries (with ``requeue_first``, each message is nacked with
        requeue on its first delivery and acked on its second); their rate."""
        ch = self.conn.channel()
        ch.basic_qos(prefetch_count=prefetch)
        acked = 0
        t0 = time.perf_counter()
        for method, _props, _body in ch.consume(self.queue, inactivity_timeout=10):
            if method is None:
                break
            if requeue_first and not method.redelivered:
                ch.basic_nack(method.delivery_tag, requeue=True)
                continue
            ch.basic_ack(method.delivery_tag)
            acked += 1
            if acked >= n:
                break
        elapsed = time.perf_counter() - t0
        ch.cancel()
        ch.close()
        return rate(acked, elapsed)

    def consume(self, n: int, prefetch: int) -> float:
        return self._consume(n, prefetch, requeue_first=False)

    def redeliver(self, n: int, prefetch: int) -> float:
        return self._consume(n, prefetch, requeue_first=True)

    def close(self) -> None:
        self.ch.queue_delete(self.queue)
        self.ch.exchange_delete(self.exchange)
        self.conn.close()


def mq_consume(sub: mqabstract.Subscription, n: int, nack_first: bool = False) -> float:
    """Ack ``n`` messages (with ``nack_first``, each is nacked on attempt 1 and acked on
    attempt 2); their rate."""
    acked = 0
    t0 = time.perf_counter()
    while acked < n:
        msgs = sub.receive(100, 10.0)
        if not msgs:
            break
        for msg in msgs:
            if nack_first and msg.attempt == 1:
                msg.nack()
                continue
            msg.ack()
            acked += 1
    return rate(acked, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    ap.add_argument("--single", type=int, default=2000, help="messages for single publish")
    ap.add_argument("--n", type=int, default=20000, help="messages for batch and consume")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--prefetch", type=int, default=100)
    ap.add_argument("--nack", type=int, default=2000, help="messages for redeliver")
    ap.add_argument("--rounds", type=int, default=2, help="alternate raw/mqabstract runs")
    args = ap.parse_args()

    token = secrets.token_hex(4)
    raw = Raw(args.url, token)
    mq = mqabstract.connect(args.url, prefetch=args.prefetch)
    group = f"bench-{token}"
    sub = mq.subscribe(group, "bench.#")
    topic = "bench.mq"
    results: dict[str, list[float]] = {}

    def keep(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    try:
        for _ in range(args.rounds):
            # Interleaved in chunks so that load drifting on a shared broker hits both.
            raw_s = mq_s = 0.0
            for start in range(0, args.single, 100):
                chunk = min(100, args.single - start)
                raw_s += chunk / raw.publish(chunk)
                t0 = time.perf_counter()
                for _ in range(chunk):
                    mq.publish(topic, BODY)
                mq_s += time.perf_counter() - t0
            keep("raw single", rate(args.single, raw_s))
            keep("mq single", rate(args.single, mq_s))

            rest = args.n - args.single
            t0 = time.perf_counter()
            for start in range(0, rest, args.batch):
                mq.publish_batch([(topic, BODY)] * min(args.batch, rest - start))
            keep("mq batch", rate(rest, time.perf_counter() - t0))
            keep("raw batch (one confirm each)", raw.publish(rest))

            # Both queues now hold the n messages of this round (single + batch).
            keep("raw consume", raw.consume(args.n, args.prefetch))
            keep("mq consume", mq_consume(sub, args.n))

            if args.nack:
                raw.publish(args.nack)
                for start in range(0, args.nack, args.batch):
                    mq.publish_batch([(topic, BODY)] * min(args.batch, args.nack - start))
                keep("raw redeliver", raw.redeliver(args.nack, args.prefetch))
                keep("mq redeliver", mq_consume(sub, args.nack, nack_first=True))
    finally:
        sub.close()
        mq.delete_group(group)
        mq.close()
        raw.close()

    best = {k: max(v) for k, v in results.items()}
    print(f"RabbitMQ at {mqabstract.BrokerURL.parse(args.url).redacted()}, "
          f"prefetch {args.prefetch}, best of {args.rounds} rounds (msg/s)")
    for name, value in best.items():
        print(f"  {name:32s} {value:10.0f}")
    print("ratios (mqabstract / raw pika):")
    print(f"  single publish with confirms     {best['mq single'] / best['raw single']:6.2f}x"
          "  (target >= 1.0, #34)")
    print(f"  publish_batch vs one-confirm     "
          f"{best['mq batch'] / best['raw batch (one confirm each)']:6.2f}x  (target >= 10)")
    print(f"  consume (receive + ack)          {best['mq consume'] / best['raw consume']:6.2f}x"
          "  (target >= 0.9)")
    if args.nack:
        print(f"  redeliver (nack, again, ack)     "
              f"{best['mq redeliver'] / best['raw redeliver']:6.2f}x  (no target)")


if __name__ == "__main__":
    main()
