#!/usr/bin/env python3
"""Raw pika, no mqabstract: does one ``tx.commit`` of copies and their originals' acks
into a quorum queue survive a connection cut right after it? (docs/backends/rabbitmq.md,
*Known gaps*.)

Each run: N messages into a new quorum queue; a consumer on a transactional channel
receives them all, cancels, then publishes a copy of each (header ``copy``) and acks its
original, in one commit (``onetx``, what the driver does) or copies first and the acks
after the commit-ok (``twotx``); the socket is shut down once the last commit frame is
written (after a random 0..``--delay`` s). Afterwards the queue should hold each id once.

    .venv/bin/python scripts/rabbitmq_tx_probe.py --n 8 --runs 100 --mode onetx
"""

from __future__ import annotations

import argparse
import random
import socket
import time
import uuid
from typing import Any

import pika


def run(url: str, n: int, mode: str, delay: float) -> tuple[list[str], int]:
    """One run: the ids left in the queue, and how many of them are copies."""
    q = "txprobe-" + uuid.uuid4().hex[:8]
    admin = pika.BlockingConnection(pika.URLParameters(url))
    ach = admin.channel()
    ach.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
    ach.confirm_delivery()
    for i in range(n):
        ach.basic_publish("", q, str(i).encode(),
                          pika.BasicProperties(message_id=str(i), delivery_mode=2))
    got: list[tuple[int, str, bytes]] = []
    conn: Any = None

    def cut() -> None:
        transport = conn._transport
        if transport.get_write_buffer_size():
            conn.ioloop.call_later(0.001, cut)
            return
        conn.ioloop.call_later(random.uniform(0, delay),
                               lambda: transport._sock.shutdown(socket.SHUT_RDWR))
        conn.ioloop.call_later(delay + 0.3, conn.ioloop.stop)

    def hand_back(ch: Any) -> None:
        for tag, mid, body in got:
            ch.basic_publish("", q, body, pika.BasicProperties(
                message_id=mid, delivery_mode=2, headers={"copy": "1"}))
            if mode == "onetx":
                ch.basic_ack(tag)
        if mode == "onetx":
            ch.tx_commit()
            cut()
            return

        def acks(_frame: Any) -> None:
            for tag, _, _ in got:
                ch.basic_ack(tag)
            ch.tx_commit()
            cut()
        ch.tx_commit(callback=acks)

    def on_msg(ch: Any, method: Any, props: Any, body: bytes) -> None:
        got.append((method.delivery_tag, props.message_id, body))
        if len(got) == n:
            ch.basic_cancel(method.consumer_tag, callback=lambda _f: hand_back(ch))

    def opened(ch: Any) -> None:
        ch.basic_qos(prefetch_count=n, callback=lambda _f: ch.tx_select(
            callback=lambda _f: ch.basic_consume(q, on_msg)))

    conn = pika.SelectConnection(pika.URLParameters(url), on_open_callback=lambda c: c.channel(
        on_open_callback=opened))
    conn.ioloop.start()
    time.sleep(0.5)  # the broker sees the cut and requeues what it did not apply
    ids, copies = [], 0
    while True:
        method, props, _body = ach.basic_get(q, auto_ack=True)
        if method is None:
            break
        ids.append(props.message_id)
        copies += bool((props.headers or {}).get("copy"))
    ach.queue_delete(q)
    admin.close()
    return ids, copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--mode", choices=("onetx", "twotx"), default="onetx")
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args()
    lost = doubled = copies = left = 0
    for _ in range(args.runs):
        ids, c = run(args.url, args.n, args.mode, args.delay)
        lost += args.n - len(set(ids))
        doubled += len(ids) - len(set(ids))
        copies += c
        left += len(ids)
    print(f"mode={args.mode} n={args.n} runs={args.runs}: lost {lost}, doubled {doubled}, "
          f"{copies} of the {left} left were copies")


if __name__ == "__main__":
    main()
