"""Kafka backend throughput on each client library, next to that library used raw, as ratios.

    .venv/bin/python bench/bench_kafka.py [--url kafka://127.0.0.1:9092] [--n 50000]
        [--size 100] [--batch 1000] [--rounds 2] [--single 2000]
        [--only publish|columns|single|consume|many|batch ...] [--clients confluent,kafka-python]

For each client (``confluent``: confluent-kafka / librdkafka; ``kafka-python``) one run
measures, against the same broker, ``size``-byte keyed records, acks=all, idempotent:

* publish: mqabstract ``Broker.publish_batch`` in chunks of ``batch`` (every chunk waits for
  the broker's acks, as the contract requires) against the raw producer sending ``n``
  records and waiting for every delivery confirmation, two ways: "send all, then flush"
  (``raw``) and "flush every ``batch``" (``raw/batch``: what a ``publish_batch`` call of
  that size must do), and that again with the header every mqabstract record carries
  (``+hdr``: ``mq-id``; its publish time is the record timestamp since session 24;
  librdkafka's cost per header is not ours to save); a ratio against each. Raw confluent
  learns failures the cheap way: ``delivery.report.only.error``
  with one callback that records errors.
* columns: the same records through ``Broker.publish_columns`` (one topic, bodies and keys as
  columns, chunks of ``batch``), against the same raw baseline.
* single: one message per call, waiting for its ack, ``single`` times (mqabstract:
  ``Broker.publish``; raw, linger 0: confluent ``produce`` + ``flush``, kafka-python
  ``send().get()``).
* consume: a consumer-group member reading ``n`` records, every one acked (mqabstract:
  ``Subscription.receive(batch)`` + ``Message.ack`` each; raw: consume/poll up to ``batch``
  records, then a synchronous commit per poll batch). Timed from the first record to the
  last, so group joins are not counted. Raw members read a topic filled beforehand; the
  mqabstract subscription reads what mqabstract published.
* many: the same as consume, acking each received batch with one ``Subscription.ack_many``
  (against the consume baseline).
* batch: the same as consume through ``Subscription.receive_batch(batch)`` and
  ``Batch.ack()``, reading the ``bodies`` column (against the consume baseline).

mqabstract picks the client by the URL query ``client=confluent`` / ``client=kafka-python``;
where that fails (unknown option, client not implemented) the row says ``n/a`` with the
reason and the run goes on. Every measurement uses fresh topics and groups, raw and
mqabstract alternate within a round, the best round of each is reported with the
mqabstract / raw ratio per client. No assertions: numbers, not tests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaConsumer, KafkaProducer

import mqabstract

CLIENTS = ("confluent", "kafka-python")
OPS = ("publish", "columns", "single", "consume", "many", "batch")
OP_NAMES = {"publish": "publish_batch", "columns": "publish_columns", "single": "single publish",
            "consume": "receive+ack", "many": "receive+ack_many",
            "batch": "receive_batch+ack"}
RAW_OF = {"many": "consume", "batch": "consume"}  # ops measured against another op's raw baseline
CONSUMING = ("consume", "many", "batch")  # the ops that read the filled topic
PARTITIONS = 4  # the driver's default ``partitions``: raw topics get the same
WAIT = 120.0  # give up on a consume after this long (reported as n/a)
HARD = WAIT + 60.0  # a call not back by then is left behind on its thread (n/a: hung)
HUNG: list[str] = []


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def consumed(got: int, n: int, took: float) -> float:
    """The consume rate, or TimeoutError when fewer than ``n`` records came in time."""
    if got < n:
        raise TimeoutError(f"got {got} of {n} records in {WAIT:.0f} s")
    return rate(got, took)


def servers(url: str) -> list[str]:
    return [f"{h}:{p or 9092}" for h, p in mqabstract.BrokerURL.parse(url).hosts]


def with_client(url: str, client: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}client={client}"


def wire_ids(n: int) -> list[bytes]:
    return [secrets.token_hex(16).encode() for _ in range(n)]


def wire_headers(mid: bytes) -> list[tuple[str, bytes]]:
    """The header every mqabstract record carries on Kafka (wire schema: ``mq-id``; the
    publish time is the record timestamp), for a raw baseline that sends what mqabstract
    sends."""
    return [("mq-id", mid)]


def reason(exc: BaseException) -> str:
    return f"n/a: {type(exc).__name__}: {exc}".replace("\n", " ")[:80]


def bounded(call: Callable[[], Any], limit: float | None = None, what: str = "call") -> Any:
    """Run ``call`` on a daemon thread; raise if it is not back within ``limit`` (a hung
    client call must not stop the run: the thread is left behind, the process exits
    without waiting for it)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"bench {what}")
    thread.start()
    limit = HARD if limit is None else limit
    thread.join(limit)
    if thread.is_alive():
        HUNG.append(what)
        raise TimeoutError(f"hung: {what} not back after {limit:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- raw confluent-kafka ----------------------------------------------------------------------
class RawConfluent:
    name = "confluent"

    def __init__(self, url: str) -> None:
        self.bootstrap = ",".join(servers(url))
        self.errors: list[KafkaError] = []

    def _producer(self, **extra: Any) -> Producer:
        return Producer({"bootstrap.servers": self.bootstrap, "acks": "all",
                         "enable.idempotence": True, "queue.buffering.max.messages": 1_000_000,
                         "delivery.report.only.error": True, "on_delivery": self._report,
                         **extra})

    def _report(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.errors.append(err)

    def _confirm(self, producer: Producer) -> None:
        if producer.flush(60) or self.errors:
            raise RuntimeError(f"raw confluent: undelivered records ({self.errors[:1]})")

    def produce(self, topic: str, keys: list[bytes], body: bytes, chunk: int = 0,
                wire: bool = False) -> float:
        producer = self._producer(**{"linger.ms": 5, "batch.size": 4_000_000,
                                     "batch.num.messages": 100_000})
        producer.produce(topic, b"warm-up")
        self._confirm(producer)
        send = producer.produce
        ids = wire_ids(len(keys)) if wire else []
        start = time.perf_counter()
        for i, key in enumerate(keys):
            extra = {"headers": wire_headers(ids[i])} if wire else {}
            try:
                send(topic, body, key, **extra)
            except BufferError:  # local queue full: serve delivery reports, then retry
                producer.poll(0.05)
                send(topic, body, key, **extra)
            if chunk and (i + 1) % chunk == 0:
                self._confirm(producer)
        self._confirm(producer)
        return rate(len(keys), time.perf_counter() - start)

    def single(self, topic: str, n: int, body: bytes) -> float:
        producer = self._producer(**{"linger.ms": 0})  # flush() sends at once anyway
        producer.produce(topic, b"warm-up")
        self._confirm(producer)
        start = time.perf_counter()
        for _ in range(n):
            producer.produce(topic, body)
            self._confirm(producer)
        return rate(n, time.perf_counter() - start)

    def consume(self, topic: str, n: int, batch: int) -> float:
        consumer = Consumer({"bootstrap.servers": self.bootstrap,
                             "group.id": "bench-raw-" + secrets.token_hex(4),
                             "enable.auto.commit": False, "auto.offset.reset": "earliest",
                             "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000,
                             "fetch.wait.max.ms": 100})
        consumer.subscribe([topic])
        got, start = 0, None
        deadline = time.monotonic() + WAIT
        try:
            while got < n and time.monotonic() < deadline:
                msgs = consumer.consume(batch, 0.5)
                if not msgs:
                    continue
                if start is None:
                    start = time.perf_counter()
                for m in msgs:
                    if m.error() is not None:
                        raise RuntimeError(f"raw confluent consume: {m.error()}")
                got += len(msgs)
                consumer.commit(asynchronous=False)
            took = time.perf_counter() - (start or time.perf_counter())
        finally:
            consumer.close()
        return consumed(got, n, took)


# -- raw kafka-python -------------------------------------------------------------------------
class RawKafkaPython:
    name = "kafka-python"

    def __init__(self, url: str) -> None:
        self.servers = servers(url)

    def _producer(self, linger_ms: int = 2) -> KafkaProducer:
        return KafkaProducer(bootstrap_servers=self.servers, acks="all",
                             enable_idempotence=True, linger_ms=linger_ms,
                             batch_size=256 * 1024)

    def produce(self, topic: str, keys: list[bytes], body: bytes, chunk: int = 0,
                wire: bool = False) -> float:
        producer = self._producer()
        producer.send(topic, b"warm-up").get(timeout=30)
        ids = wire_ids(len(keys)) if wire else []
        start = time.perf_counter()
        futures = []
        for i, key in enumerate(keys):
            futures.append(producer.send(topic, value=body, key=key,
                                         headers=wire_headers(ids[i]) if wire else None))
            if chunk and (i + 1) % chunk == 0:
                producer.flush()
        producer.flush()
        for f in futures:
            f.get(timeout=30)
        took = time.perf_counter() - start
        producer.close()
        return rate(len(keys), took)

    def single(self, topic: str, n: int, body: bytes) -> float:
        producer = self._producer(linger_ms=0)  # get() waits: lingering only adds latency
        producer.send(topic, b"warm-up").get(timeout=30)
        start = time.perf_counter()
        for _ in range(n):
            producer.send(topic, body).get(timeout=30)
        took = time.perf_counter() - start
        producer.close()
        return rate(n, took)

    def consume(self, topic: str, n: int, batch: int) -> float:
        consumer = KafkaConsumer(topic, bootstrap_servers=self.servers,
                                 group_id="bench-raw-" + secrets.token_hex(4),
                                 enable_auto_commit=False, auto_offset_reset="earliest",
                                 session_timeout_ms=6000, heartbeat_interval_ms=1000,
                                 max_poll_records=batch, fetch_max_wait_ms=100)
        got, start = 0, None
        deadline = time.monotonic() + WAIT
        try:
            while got < n and time.monotonic() < deadline:
                batches = consumer.poll(timeout_ms=500)
                if not batches:
                    continue
                if start is None:
                    start = time.perf_counter()
                got += sum(len(records) for records in batches.values())
                consumer.commit()
            took = time.perf_counter() - (start or time.perf_counter())
        finally:
            consumer.close()
        return consumed(got, n, took)


# -- mqabstract -------------------------------------------------------------------------------
def mq_publish(broker: mqabstract.Broker, topic: str, keys: list[str], body: bytes,
               batch: int) -> float:
    broker.publish(topic, b"warm-up")
    start = time.perf_counter()
    for lo in range(0, len(keys), batch):
        broker.publish_batch([{"topic": topic, "body": body, "key": k}
                              for k in keys[lo:lo + batch]])
    return rate(len(keys), time.perf_counter() - start)


def mq_columns(broker: mqabstract.Broker, topic: str, keys: list[str], body: bytes,
               batch: int) -> float:
    broker.publish(topic, b"warm-up")
    start = time.perf_counter()
    bodies = [body] * batch
    for lo in range(0, len(keys), batch):
        chunk = keys[lo:lo + batch]
        broker.publish_columns(topic, bodies[:len(chunk)], keys=chunk)
    return rate(len(keys), time.perf_counter() - start)


def mq_single(broker: mqabstract.Broker, topic: str, n: int, body: bytes) -> float:
    broker.publish(topic, b"warm-up")
    start = time.perf_counter()
    for _ in range(n):
        broker.publish(topic, body)
    return rate(n, time.perf_counter() - start)


def mq_consume(broker: mqabstract.Broker, group: str, pattern: str, n: int, batch: int,
               many: bool = False, batches: bool = False) -> float:
    sub = broker.subscribe(group, pattern, lease=300.0)
    got, start = 0, None
    deadline = time.monotonic() + WAIT
    try:
        while got < n and time.monotonic() < deadline:
            if batches:
                received = sub.receive_batch(batch, 1.0)
                if received and start is None:
                    start = time.perf_counter()
                received.ack()
                got += sum(1 for body in received.bodies if body != b"warm-up")
            else:
                msgs = sub.receive(batch, 1.0)
                if msgs and start is None:
                    start = time.perf_counter()
                if many:
                    sub.ack_many(msgs)
                else:
                    for m in msgs:
                        m.ack()
                got += sum(1 for m in msgs if m.body != b"warm-up")
        took = time.perf_counter() - (start or time.perf_counter())
    finally:
        sub.close()
    return consumed(got, n, took)


# -- driver -----------------------------------------------------------------------------------
class Results:
    def __init__(self) -> None:
        self.best: dict[tuple[str, str, str], float] = {}
        self.failed: dict[tuple[str, str, str], str] = {}

    def run(self, key: tuple[str, str, str], call: Callable[[], float]) -> None:
        try:
            value = bounded(call, what=" ".join(key))
        except Exception as exc:
            self.failed.setdefault(key, reason(exc))
            return
        self.best[key] = max(self.best.get(key, 0.0), value)

    def cell(self, key: tuple[str, str, str]) -> str:
        if key in self.best:
            return f"{self.best[key]:12,.0f}"
        return f"{'n/a':>12s}" if key in self.failed else f"{'-':>12s}"


def create_topics(admin: AdminClient, names: list[str]) -> None:
    for future in admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in names]).values():
        future.result()


def delete_topics(admin: AdminClient, token: str) -> None:
    names = [t for t in admin.list_topics(timeout=30).topics if token in t]
    if names:
        for future in admin.delete_topics(names, operation_timeout=30).values():
            with contextlib.suppress(Exception):
                future.result()


def fill(url: str, topic: str, n: int, body: bytes) -> None:
    RawConfluent(url).produce(topic, [f"k{i}".encode() for i in range(n)], body)


def bench_client(args: argparse.Namespace, ops: list[str], res: Results, admin: AdminClient,
                 raw: RawConfluent | RawKafkaPython, client: str, token: str,
                 consume_topic: str) -> None:
    """One round of every operation on one client: raw first, then mqabstract."""
    body = b"x" * args.size
    keys = [f"k{i}" for i in range(args.n)]
    raw_keys = [k.encode() for k in keys]
    tag = f"{token}{client[0]}"
    try:
        broker: mqabstract.Broker | None = mqabstract.connect(
            with_client(args.url, client))
        connect_error = ""
    except Exception as exc:
        broker, connect_error = None, reason(exc)
    group, pattern = f"bench-{tag}", f"bench.{tag}.#"
    groups = {"consume": group, "many": f"bench-{tag}-m", "batch": f"bench-{tag}-b"}

    def mq(op: str, call: Callable[[mqabstract.Broker], float]) -> None:
        if broker is None:
            res.failed.setdefault((op, client, "mq"), connect_error)
        else:
            b = broker
            res.run((op, client, "mq"), lambda: call(b))

    try:
        if broker is not None:
            for name in groups.values():
                with contextlib.suppress(Exception):
                    broker.declare(name, pattern)
        for op, publish, suffix in (("publish", mq_publish, "t"), ("columns", mq_columns, "c")):
            if op not in ops:
                continue
            raw_topic = f"bench-raw-{tag}-{suffix}"
            create_topics(admin, [raw_topic])
            res.run((op, client, "raw"), lambda r=raw, t=raw_topic: r.produce(t, raw_keys, body))
            res.run((op, client, "rawc"), lambda r=raw, t=raw_topic:
                    r.produce(t, raw_keys, body, args.batch))
            res.run((op, client, "rawh"), lambda r=raw, t=raw_topic:
                    r.produce(t, raw_keys, body, args.batch, wire=True))
            mq(op, lambda b, f=publish, s=suffix: f(b, f"bench.{tag}.{s}", keys, body,
                                                    args.batch))
        published = ("publish", client, "mq") in res.best
        if "single" in ops:
            raw_topic = f"bench-raw-{tag}-s"
            create_topics(admin, [raw_topic])
            res.run(("single", client, "raw"),
                    lambda r=raw, t=raw_topic: r.single(t, args.single, body))
            mq("single", lambda b: mq_single(b, f"benchs.{tag}.s", args.single,
                                             body))
        if set(CONSUMING) & set(ops):
            res.run(("consume", client, "raw"),
                    lambda r=raw: r.consume(consume_topic, args.n, args.batch))
            if not published and broker is not None:  # untimed fill
                with contextlib.suppress(Exception):
                    bounded(lambda: mq_publish(broker, f"bench.{tag}.t", keys, body, args.batch),
                            what=f"{client} fill")
            for op in CONSUMING:
                if op in ops:
                    mq(op, lambda b, o=op: mq_consume(b, groups[o], pattern, args.n,
                                                      args.batch, many=o == "many",
                                                      batches=o == "batch"))
    finally:
        if broker is not None:
            for name in groups.values():
                with contextlib.suppress(Exception):
                    bounded(lambda g=name: broker.delete_group(g), 60, f"{client} delete_group")
            with contextlib.suppress(Exception):
                bounded(broker.close, 60, f"{client} close")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="kafka://127.0.0.1:9092")
    ap.add_argument("--n", type=int, default=50_000, help="messages for publish and consume")
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--single", type=int, default=2000, help="messages for single publish")
    ap.add_argument("--only", action="append", choices=OPS, help="repeatable; default all")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    args = ap.parse_args()
    ops = [op for op in OPS if op in (args.only or OPS)]
    clients = [c for c in args.clients.split(",") if c]
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        ap.error(f"unknown client(s) {sorted(unknown)}; known: {', '.join(CLIENTS)}")
    raws: dict[str, RawConfluent | RawKafkaPython] = {
        "confluent": RawConfluent(args.url), "kafka-python": RawKafkaPython(args.url)}
    admin = AdminClient({"bootstrap.servers": ",".join(servers(args.url))})
    res = Results()

    for _ in range(args.rounds):
        token = "b" + secrets.token_hex(4)
        try:
            consume_topic = f"bench-raw-{token}-c"
            if set(CONSUMING) & set(ops):
                # one filled topic, read by each raw client's own group
                create_topics(admin, [consume_topic])
                fill(args.url, consume_topic, args.n, b"x" * args.size)
            for client in clients:
                bench_client(args, ops, res, admin, raws[client], client, token, consume_topic)
        finally:
            delete_topics(admin, token)

    print(f"kafka bench at {mqabstract.BrokerURL.parse(args.url).redacted()}: n={args.n} "
          f"single={args.single} size={args.size} B batch={args.batch} "
          f"partitions={PARTITIONS}, best of {args.rounds} rounds (msg/s)")
    print("  raw: the client alone; /batch: the same records confirmed every --batch, as a "
          "publish_batch call of that size must;\n  +hdr: also carrying the header every "
          "mqabstract record has (mq-id)")
    print(f"  {'operation':17s} {'client':13s} {'raw':>10s} {'raw/batch':>10s} "
          f"{'+hdr':>10s} {'mqabstract':>10s}  mq/raw  /batch   +hdr")
    for op in ops:
        for client in clients:
            raw_op = RAW_OF.get(op, op)
            bases = [(raw_op, client, side) for side in ("raw", "rawc", "rawh")]
            mq_key = (op, client, "mq")

            def ratio(base: tuple[str, str, str], mq_key: tuple[str, str, str] = mq_key) -> str:
                return (f"{res.best[mq_key] / res.best[base]:6.2f}"
                        if mq_key in res.best and res.best.get(base) else f"{'-':>6s}")
            print(f"  {OP_NAMES[op]:17s} {client:13s} "
                  + " ".join(res.cell(k)[2:] for k in (*bases, mq_key))
                  + "  " + " ".join(ratio(k) for k in bases))
    for (op, client, side), why in res.failed.items():
        who = "mqabstract" if side == "mq" else "raw"
        some = " (in some rounds; the best of the others is shown)" if (
            (op, client, side) in res.best) else ""
        print(f"  {OP_NAMES[op]} {client} {who}: {why}{some}")
    if HUNG:  # threads left in client calls: do not wait for them at exit
        print(f"  hung calls left behind: {', '.join(HUNG)}")
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
