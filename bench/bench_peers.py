"""mqabstract (sync and asyncio) next to kombu, FastStream and raw clients, in one run.

    eval "$(MQ_BROKERS_DIR=/tmp/bwarm scripts/brokers env)"
    .venv/bin/python bench/bench_peers.py [--single 500] [--n 5000] [--batch 1000]
        [--rounds 1] [--only rabbitmq|kafka]

Brokers come from ``MQ_TEST_RABBITMQ_URL`` / ``MQ_TEST_KAFKA_URL``. Every library gets
fresh names per round, 100-byte bodies, persistent messages (RabbitMQ: durable topic
exchange -> durable quorum queue, the shape of an mqabstract group; delivery mode 2) or
acks=all + idempotence (Kafka: every topic has 4 partitions, the count mqabstract creates;
peers' topics are created up front with it). Prints msg/s, best of ``--rounds``, and
mqabstract / best of (kombu, FastStream) per operation. Numbers, not assertions.

single publish: one message per call, its confirmation awaited before the next.
  mqabstract ``publish`` / ``await publish``; kombu ``Producer.publish`` (RabbitMQ:
  ``confirm_publish``; Kafka: the transport flushes each); FastStream ``await
  broker.publish``; pika ``confirm_delivery`` channel; aio-pika confirming channel;
  confluent-kafka ``produce`` + ``flush``; kafka-python ``send().get()``; aiokafka
  ``send_and_wait``.
batch publish (N, confirmed): mqabstract ``publish_batch`` in chunks of ``--batch``;
  kombu and pika have no batch API: a loop, one confirm each; FastStream Kafka
  ``publish_batch`` per chunk; confluent-kafka produce all + ``flush``; kafka-python send
  all + ``flush`` + every future; aiokafka ``send_batch`` per chunk (partitions in turn),
  then every future.
concurrent publish (N): ``asyncio.gather`` of single publishes, at most 100 in flight
  (mqabstract async, FastStream, aio-pika, aiokafka).
publish N, fastest: each column's best of the two rows above.
consume + ack: N messages already in the queue/topic (what the publish rows left there),
  each acked; timed from the first message to the last ack, so consumer start and Kafka
  group joins are not counted. mqabstract ``Subscription.consume(handler,
  max_messages=N)`` / ``await AsyncSubscription.consume(async_handler, max_messages=N)``
  (no-op handler, defaults: batch 10, concurrency 1); kombu ``Consumer`` callback with
  ``message.ack()`` + ``drain_events``; FastStream subscriber, ``AckPolicy.ACK``, broker
  started in the bench; pika ``basic_consume`` + ``basic_ack`` each; aio-pika
  ``queue.iterator`` + ``await message.ack()``; confluent-kafka ``poll`` + async
  ``commit`` per message; kafka-python ``poll`` + ``commit_async`` per poll; aiokafka
  ``getmany`` + ``commit`` per batch. RabbitMQ prefetch 100 everywhere.

Caveats: kombu's ``confluentkafka://`` transport works here, but it is kombu's virtual
transport (JSON envelope with a base64 body, routing in process), polls one record per
``drain_events`` and commits per ack; its flush does not report delivery errors.
FastStream runs with ``logger=None`` (no per-message log lines) and acks after the
handler (``AckPolicy.ACK``: on Kafka a commit per message). mqabstract's asyncio API runs
the sync client on a thread pool. A library that fails shows ``n/a`` with the reason as a
footnote; the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pika
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.rabbit import (
    Channel,
    ExchangeType,
    QueueType,
    RabbitBroker,
    RabbitExchange,
    RabbitQueue,
)
from kafka import KafkaConsumer, KafkaProducer
from kombu import Connection, Exchange, Queue
from kombu import Consumer as KombuConsumer
from kombu import Producer as KombuProducer

import mqabstract
from mqabstract import aio

BODY = b"x" * 100
CONC = 100  # concurrent publishes in flight
PREFETCH = 100
PARTITIONS = 4  # mqabstract's Kafka default; peers' topics get the same
WAIT = 60.0  # a consume that has not got its messages by then fails
OP_LIMIT = 300.0  # an async operation not done by then fails
DASH = "\u2013"  # the cell of an operation a library does not do

SINGLE, BATCH, CONCURRENT, FASTEST, CONSUME = "single", "batch", "concurrent", "fastest", "consume"
OPS = (SINGLE, BATCH, CONCURRENT, FASTEST, CONSUME)
OP_NAMES = {SINGLE: "single publish (confirm each)", BATCH: "batch publish N",
            CONCURRENT: f"concurrent publish N ({CONC} in flight)",
            FASTEST: "publish N, fastest way", CONSUME: "consume + ack N"}
MQ_SYNC, MQ_ASYNC, KOMBU, FASTSTREAM = ("mqabstract sync", "mqabstract async", "kombu",
                                        "FastStream")
PEERS = (KOMBU, FASTSTREAM)


# -- results ----------------------------------------------------------------------------------
@dataclass
class Table:
    """Best rate per (operation, column), with footnotes (caveats and failures)."""

    title: str
    columns: list[str]
    best: dict[tuple[str, str], float] = field(default_factory=dict)
    notes: dict[tuple[str, str], str] = field(default_factory=dict)

    def keep(self, op: str, col: str, value: float) -> None:
        self.best[op, col] = max(self.best.get((op, col), 0.0), value)

    def fail(self, op: str, col: str, exc: BaseException) -> None:
        why = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:160]
        self.notes.setdefault((op, col), f"failed: {why}")

    def note(self, op: str, col: str, text: str) -> None:
        self.notes.setdefault((op, col), text)

    def run(self, op: str, col: str, call: Callable[[], float]) -> None:
        try:
            self.keep(op, col, call())
        except Exception as exc:
            self.fail(op, col, exc)

    async def arun(self, op: str, col: str, call: Callable[[], Awaitable[float]]) -> None:
        try:
            self.keep(op, col, await asyncio.wait_for(call(), OP_LIMIT))
        except Exception as exc:
            self.fail(op, col, exc)

    def value(self, op: str, col: str) -> float | None:
        if op == FASTEST:
            got = [v for o in (BATCH, CONCURRENT) if (v := self.best.get((o, col)))]
            return max(got) if got else None
        return self.best.get((op, col))

    def render(self) -> str:
        heads = [*self.columns, "sync/best peer", "async/best peer"]
        lines = [self.title, "", "| operation | " + " | ".join(heads) + " |",
                 "|---|" + "---:|" * len(heads)]
        marks: dict[str, int] = {}
        for op in OPS:
            cells = []
            for col in self.columns:
                v = self.value(op, col)
                text = f"{v:,.0f}" if v is not None else DASH
                note = self.notes.get((op, col))
                if note is not None and op != FASTEST:
                    if v is None and note.startswith("failed"):
                        text = "n/a"
                    mark = marks.setdefault(f"{col}, {OP_NAMES[op]}: {note}", len(marks) + 1)
                    text += f" [{mark}]"
                cells.append(text)
            peers = [(v, p) for p in PEERS if (v := self.value(op, p))]
            best = max(peers) if peers else None
            for mine in (MQ_SYNC, MQ_ASYNC):
                v = self.value(op, mine)
                cells.append(f"{v / best[0]:.2f} ({best[1]})" if v and best else DASH)
            lines.append(f"| {OP_NAMES[op]} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += [f"[{i}] {text}" for text, i in marks.items()]
        return "\n".join(lines)


# -- shared helpers ---------------------------------------------------------------------------
@dataclass
class Run:
    """One round's settings and names."""

    url: str
    single: int
    n: int
    batch: int
    token: str
    table: Table

    def name(self, lib: str, sep: str = "-") -> str:
        return sep.join(("bp", self.token, lib))

    def chunks(self) -> list[int]:
        return [min(self.batch, self.n - lo) for lo in range(0, self.n, self.batch)]


class Counter:
    """Counts consumed messages; the rate runs from the first one to the end."""

    def __init__(self, n: int) -> None:
        self.n, self.got, self.first = n, 0, 0.0
        self.done = asyncio.Event() if _in_loop() else None

    def tick(self) -> bool:
        """Count one message; True once ``n`` have come."""
        if self.got == 0:
            self.first = time.perf_counter()
        self.got += 1
        if self.got >= self.n and self.done is not None:
            self.done.set()
        return self.got >= self.n

    def rate(self) -> float:
        end = time.perf_counter()
        if self.got < self.n:
            raise TimeoutError(f"got {self.got} of {self.n} messages in {WAIT:.0f} s")
        return (self.n - 1) / (end - self.first)


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def timed(n: int, call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return n / (time.perf_counter() - start)


async def faststream_consume(broker: Any, count: Counter) -> float:
    """Start a FastStream broker whose subscriber ticks ``count``; its rate once all came."""
    assert count.done is not None
    await broker.start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(count.done.wait(), WAIT)
    return count.rate()


async def atimed(n: int, call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return n / (time.perf_counter() - start)


async def gather_bounded(n: int, one: Callable[[], Awaitable[object]]) -> None:
    """``n`` calls of ``one`` at once, at most ``CONC`` in flight."""
    sem = asyncio.Semaphore(CONC)

    async def bounded() -> None:
        async with sem:
            await one()

    await asyncio.gather(*(bounded() for _ in range(n)))


async def sequential(n: int, one: Callable[[], Awaitable[object]]) -> None:
    for _ in range(n):
        await one()


def kafka_servers(url: str) -> str:
    return ",".join(f"{h}:{p or 9092}" for h, p in mqabstract.BrokerURL.parse(url).hosts)


# -- mqabstract (either broker) ---------------------------------------------------------------
def mq_sync(run: Run) -> None:
    t, col = run.table, MQ_SYNC
    topic, group = run.name("s", "."), run.name("s")
    mq = mqabstract.connect(run.url)
    try:
        mq.declare(group, topic, lease=60)  # the group exists before anything is published
        mq.publish(topic, BODY)  # warm-up
        t.run(SINGLE, col, lambda: timed(run.single, lambda: [
            mq.publish(topic, BODY) for _ in range(run.single)]))
        t.run(BATCH, col, lambda: timed(run.n, lambda: [
            mq.publish_batch([(topic, BODY)] * k) for k in run.chunks()]))
        sub = mq.subscribe(group, topic, lease=60)
        try:
            count = Counter(run.n)

            def consume() -> float:
                stats = sub.consume(lambda _m: count.tick(), max_messages=run.n,
                                    idle_timeout=WAIT)
                if stats.acked < run.n:
                    raise TimeoutError(f"acked {stats.acked} of {run.n}")
                return count.rate()
            t.run(CONSUME, col, consume)
        finally:
            sub.close()
    finally:
        with contextlib.suppress(Exception):
            mq.delete_group(group)
        mq.close()


async def mq_async(run: Run) -> None:
    t, col = run.table, MQ_ASYNC
    topic, group = run.name("a", "."), run.name("a")
    mq = await aio.connect(run.url)
    try:
        await mq.declare(group, topic, lease=60)
        await mq.publish(topic, BODY)

        async def one() -> None:
            await mq.publish(topic, BODY)

        async def batches() -> None:
            for k in run.chunks():
                await mq.publish_batch([(topic, BODY)] * k)
        await t.arun(SINGLE, col, lambda: atimed(run.single, lambda: sequential(run.single, one)))
        await t.arun(BATCH, col, lambda: atimed(run.n, batches))
        await t.arun(CONCURRENT, col, lambda: atimed(run.n, lambda: gather_bounded(run.n, one)))
        sub = await mq.subscribe(group, topic, lease=60)
        try:
            count = Counter(run.n)

            async def handler(_msg: aio.AsyncMessage) -> None:
                count.tick()

            async def consume() -> float:
                stats = await sub.consume(handler, max_messages=run.n, idle_timeout=WAIT)
                if stats.acked < run.n:
                    raise TimeoutError(f"acked {stats.acked} of {run.n}")
                return count.rate()
            await t.arun(CONSUME, col, consume)
        finally:
            await sub.close()
    finally:
        with contextlib.suppress(Exception):
            await mq.delete_group(group)
        await mq.close()


# -- RabbitMQ peers ---------------------------------------------------------------------------
QUORUM = {"x-queue-type": "quorum"}


def rabbit_names(run: Run, lib: str) -> tuple[str, str, str]:
    """(exchange, queue, routing key) of one library's quorum queue."""
    return run.name(lib), run.name(lib) + "-q", run.name(lib, ".")


def rabbit_cleanup(run: Run, libs: list[str]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(run.url))
    try:
        ch = conn.channel()
        for lib in libs:
            exchange, queue, _ = rabbit_names(run, lib)
            ch.queue_delete(queue)
            ch.exchange_delete(exchange)
    finally:
        conn.close()


def kombu_rabbit(run: Run) -> None:
    t, col = run.table, KOMBU
    exchange, queue, key = rabbit_names(run, "kombu")
    with Connection(run.url, transport_options={"confirm_publish": True}) as conn:
        ch = conn.channel()
        ex = Exchange(exchange, "topic", durable=True)
        q = Queue(queue, ex, routing_key=key, durable=True, queue_arguments=QUORUM)
        q(ch).declare()
        producer = KombuProducer(ch, exchange=ex, routing_key=key)

        def one() -> None:
            producer.publish(BODY, content_type="application/octet-stream",
                             content_encoding="binary", delivery_mode=2)
        one()
        t.run(SINGLE, col, lambda: timed(run.single, lambda: [one() for _ in range(run.single)]))
        t.note(BATCH, col, "no batch API: publish in a loop, one confirm each")
        t.run(BATCH, col, lambda: timed(run.n, lambda: [one() for _ in range(run.n)]))
        t.run(CONSUME, col, lambda: kombu_consume(conn, q, run.n))


def kombu_consume(conn: Connection, q: Queue, n: int) -> float:
    count = Counter(n)

    def on_message(_body: Any, message: Any) -> None:
        message.ack()
        count.tick()

    ch = conn.channel()
    consumer = KombuConsumer(ch, queues=[q], callbacks=[on_message], prefetch_count=PREFETCH,
                             accept=["application/octet-stream"])
    deadline = time.monotonic() + WAIT
    with consumer:
        while count.got < n and time.monotonic() < deadline:
            with contextlib.suppress(socket.timeout, TimeoutError):
                conn.drain_events(timeout=1)
    with contextlib.suppress(Exception):
        ch.close()
    return count.rate()


def pika_rabbit(run: Run) -> None:
    t, col = run.table, "pika"
    exchange, queue, key = rabbit_names(run, "pika")
    conn = pika.BlockingConnection(pika.URLParameters(run.url))
    try:
        ch = conn.channel()
        ch.exchange_declare(exchange, "topic", durable=True)
        ch.queue_declare(queue, durable=True, arguments=QUORUM)
        ch.queue_bind(queue, exchange, routing_key=key)
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2)

        def loop(k: int) -> None:
            for _ in range(k):
                ch.basic_publish(exchange, key, BODY, props)
        loop(1)
        t.run(SINGLE, col, lambda: timed(run.single, lambda: loop(run.single)))
        t.note(BATCH, col, "BlockingChannel confirms one publish at a time: a loop")
        t.run(BATCH, col, lambda: timed(run.n, lambda: loop(run.n)))

        def consume() -> float:
            count = Counter(run.n)
            cch = conn.channel()
            cch.basic_qos(prefetch_count=PREFETCH)

            def on_message(c: Any, method: Any, _props: Any, _body: bytes) -> None:
                c.basic_ack(method.delivery_tag)
                count.tick()
            tag = cch.basic_consume(queue, on_message)
            deadline = time.monotonic() + WAIT
            while count.got < run.n and time.monotonic() < deadline:
                conn.process_data_events(time_limit=0.5)
            rate = count.rate()
            cch.basic_cancel(tag)
            cch.close()
            return rate
        t.run(CONSUME, col, consume)
    finally:
        conn.close()


async def aio_pika_rabbit(run: Run) -> None:
    t, col = run.table, "aio-pika"
    exchange, queue, key = rabbit_names(run, "aiopika")
    conn = await aio_pika.connect(run.url)
    try:
        ch = await conn.channel(publisher_confirms=True)
        ex = await ch.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        q = await ch.declare_queue(queue, durable=True, arguments=QUORUM)
        await q.bind(ex, routing_key=key)

        async def one() -> None:
            await ex.publish(aio_pika.Message(BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                             routing_key=key)
        await one()
        await t.arun(SINGLE, col, lambda: atimed(run.single, lambda: sequential(run.single, one)))
        await t.arun(CONCURRENT, col, lambda: atimed(run.n, lambda: gather_bounded(run.n, one)))

        async def consume() -> float:
            count = Counter(run.n)
            cch = await conn.channel()
            await cch.set_qos(prefetch_count=PREFETCH)
            cq = await cch.get_queue(queue)

            async def drain() -> None:
                async with cq.iterator() as it:
                    async for message in it:
                        await message.ack()
                        if count.tick():
                            break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain(), WAIT)
            rate = count.rate()
            await cch.close()
            return rate
        await t.arun(CONSUME, col, consume)
    finally:
        await conn.close()


async def faststream_rabbit(run: Run) -> None:
    t, col = run.table, FASTSTREAM
    exchange, queue, key = rabbit_names(run, "faststream")
    broker = RabbitBroker(run.url, default_channel=Channel(prefetch_count=PREFETCH), logger=None)
    ex = RabbitExchange(exchange, type=ExchangeType.TOPIC, durable=True)
    q = RabbitQueue(queue, QueueType.QUORUM, durable=True, routing_key=key)
    count = Counter(run.n)

    @broker.subscriber(q, ex, ack_policy=AckPolicy.ACK)
    async def handle(body: bytes) -> None:
        count.tick()

    async with broker:  # connects; subscribers start with broker.start()
        rex = await broker.declare_exchange(ex)
        rq = await broker.declare_queue(q)
        await rq.bind(rex, routing_key=key)

        async def one() -> None:
            await broker.publish(BODY, exchange=ex, routing_key=key, persist=True)
        await one()
        await t.arun(SINGLE, col, lambda: atimed(run.single, lambda: sequential(run.single, one)))
        t.note(BATCH, col, "no batch publish for RabbitMQ: see concurrent")
        await t.arun(CONCURRENT, col, lambda: atimed(run.n, lambda: gather_bounded(run.n, one)))

        await t.arun(CONSUME, col, lambda: faststream_consume(broker, count))


def bench_rabbitmq(run: Run) -> None:
    libs = ["kombu", "pika", "aiopika", "faststream"]
    t = run.table
    sections: list[tuple[str, Callable[[], object]]] = [
        (MQ_SYNC, lambda: mq_sync(run)),
        (MQ_ASYNC, lambda: asyncio.run(mq_async(run))),
        (KOMBU, lambda: kombu_rabbit(run)),
        (FASTSTREAM, lambda: asyncio.run(faststream_rabbit(run))),
        ("pika", lambda: pika_rabbit(run)),
        ("aio-pika", lambda: asyncio.run(aio_pika_rabbit(run))),
    ]
    try:
        run_sections(t, sections)
    finally:
        with contextlib.suppress(Exception):
            rabbit_cleanup(run, libs)


def run_sections(t: Table, sections: list[tuple[str, Callable[[], object]]]) -> None:
    """Run each library's section; a failure outside an operation fails its missing cells."""
    for col, section in sections:
        try:
            section()
        except Exception as exc:
            for op in (SINGLE, BATCH, CONCURRENT, CONSUME):
                if (op, col) not in t.best and (op, col) not in t.notes:
                    t.fail(op, col, exc)
        print(f"  done: {col}", flush=True)


# -- Kafka peers ------------------------------------------------------------------------------
class Kafka:
    """Topic and group bookkeeping for one round."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.servers = kafka_servers(run.url)
        self.admin = AdminClient({"bootstrap.servers": self.servers})
        self.groups: list[str] = []

    def topic(self, lib: str) -> str:
        name = self.run.name(lib)
        for future in self.admin.create_topics([NewTopic(name, PARTITIONS, 1)]).values():
            future.result()
        deadline = time.monotonic() + 30  # wait for leaders: a first produce would retry
        while time.monotonic() < deadline:
            found = self.admin.list_topics(name, timeout=10).topics.get(name)
            parts = found.partitions if found is not None and found.error is None else {}
            if len(parts) == PARTITIONS and all(p.leader >= 0 for p in parts.values()):
                break
            time.sleep(0.1)
        return name

    def group(self, lib: str) -> str:
        self.groups.append(self.run.name(lib) + "-g")
        return self.groups[-1]

    def cleanup(self) -> None:
        names = [n for n in self.admin.list_topics(timeout=30).topics if self.run.token in n]
        if names:
            for future in self.admin.delete_topics(names, operation_timeout=30).values():
                with contextlib.suppress(Exception):
                    future.result()
        if self.groups:
            for future in self.admin.delete_consumer_groups(self.groups).values():
                with contextlib.suppress(Exception):
                    future.result()


def kombu_kafka(run: Run, kafka: Kafka) -> None:
    t, col = run.table, KOMBU
    name = run.name("kombu")
    options = {"num_partitions": PARTITIONS, "wait_time_seconds": 1,
               "kafka_producer_config": {"acks": "all", "enable.idempotence": True}}
    with Connection(f"confluentkafka://{kafka.servers.split(',')[0]}",
                    transport_options=options) as conn:
        ch = conn.channel()
        ex = Exchange(name, "direct")
        q = Queue(name, ex, routing_key=name)
        q(ch).declare()  # creates the topic (PARTITIONS partitions)
        kafka.groups.append(f"{name}-consumer-group")
        producer = KombuProducer(ch, exchange=ex, routing_key=name)

        def one() -> None:
            producer.publish(BODY, content_type="application/octet-stream",
                             content_encoding="binary")
        one()
        t.run(SINGLE, col, lambda: timed(run.single, lambda: [one() for _ in range(run.single)]))
        t.note(BATCH, col, "no batch API: publish in a loop, the transport flushes each")
        t.run(BATCH, col, lambda: timed(run.n, lambda: [one() for _ in range(run.n)]))
        t.run(CONSUME, col, lambda: kombu_consume(conn, q, run.n))


def confluent_kafka_raw(run: Run, kafka: Kafka) -> None:
    t, col = run.table, "confluent-kafka"
    topic = kafka.topic("ck")
    errors: list[KafkaError] = []

    def report(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    def producer(linger_ms: int) -> Producer:
        return Producer({"bootstrap.servers": kafka.servers, "acks": "all",
                         "enable.idempotence": True, "linger.ms": linger_ms,
                         "on_delivery": report})

    def confirm(p: Producer) -> None:
        if p.flush(30) or errors:
            raise RuntimeError(f"undelivered records: {errors[:1]}")

    def single() -> float:
        p = producer(0)
        p.produce(topic, BODY)
        confirm(p)
        start = time.perf_counter()
        for _ in range(run.single):
            p.produce(topic, BODY)
            confirm(p)
        return run.single / (time.perf_counter() - start)

    def batch() -> float:
        p = producer(5)
        p.produce(topic, BODY)
        confirm(p)
        start = time.perf_counter()
        for _ in range(run.n):
            try:
                p.produce(topic, BODY)
            except BufferError:  # local queue full: serve delivery reports, then retry
                p.poll(0.05)
                p.produce(topic, BODY)
        confirm(p)
        return run.n / (time.perf_counter() - start)

    def consume() -> float:
        count = Counter(run.n)
        c = Consumer({"bootstrap.servers": kafka.servers, "group.id": kafka.group("ck"),
                      "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        c.subscribe([topic])
        deadline = time.monotonic() + WAIT
        try:
            while count.got < run.n and time.monotonic() < deadline:
                msg = c.poll(0.5)
                if msg is None:
                    continue
                if msg.error() is not None:
                    raise RuntimeError(str(msg.error()))
                c.commit(message=msg, asynchronous=True)
                count.tick()
            return count.rate()
        finally:
            c.close()

    t.run(SINGLE, col, single)
    t.run(BATCH, col, batch)
    t.run(CONSUME, col, consume)


def kafka_python_raw(run: Run, kafka: Kafka) -> None:
    t, col = run.table, "kafka-python"
    topic = kafka.topic("kp")
    servers = kafka.servers.split(",")

    def producer(linger_ms: int) -> KafkaProducer:
        return KafkaProducer(bootstrap_servers=servers, acks="all", enable_idempotence=True,
                             linger_ms=linger_ms, batch_size=256 * 1024)

    def single() -> float:
        p = producer(0)
        try:
            p.send(topic, BODY).get(timeout=30)
            return timed(run.single, lambda: [p.send(topic, BODY).get(timeout=30)
                                              for _ in range(run.single)])
        finally:
            p.close()

    def batch() -> float:
        p = producer(2)
        p.send(topic, BODY).get(timeout=30)

        def send_all() -> None:
            futures = [p.send(topic, BODY) for _ in range(run.n)]
            p.flush()
            for f in futures:
                f.get(timeout=30)
        try:
            return timed(run.n, send_all)
        finally:
            p.close()

    def consume() -> float:
        count = Counter(run.n)
        c = KafkaConsumer(topic, bootstrap_servers=servers, group_id=kafka.group("kp"),
                          enable_auto_commit=False, auto_offset_reset="earliest")
        deadline = time.monotonic() + WAIT
        try:
            while count.got < run.n and time.monotonic() < deadline:
                for records in c.poll(timeout_ms=500, max_records=500).values():
                    for _ in records:
                        count.tick()
                c.commit_async()
            rate = count.rate()
            c.commit()
            return rate
        finally:
            c.close()

    t.run(SINGLE, col, single)
    t.run(BATCH, col, batch)
    t.run(CONSUME, col, consume)


async def aiokafka_raw(run: Run, kafka: Kafka) -> None:
    t, col = run.table, "aiokafka"
    topic = kafka.topic("ak")
    p = AIOKafkaProducer(bootstrap_servers=kafka.servers, acks="all", enable_idempotence=True,
                         max_batch_size=1 << 20)
    await p.start()
    try:
        async def one() -> None:
            await p.send_and_wait(topic, BODY)

        async def batches() -> None:
            futures = []
            for i, k in enumerate(run.chunks()):
                b = p.create_batch()
                for _ in range(k):
                    if b.append(key=None, value=BODY, timestamp=None) is None:
                        raise RuntimeError("batch full")
                futures.append(await p.send_batch(b, topic, partition=i % PARTITIONS))
            await asyncio.gather(*futures)
        await one()
        await t.arun(SINGLE, col, lambda: atimed(run.single, lambda: sequential(run.single, one)))
        await t.arun(BATCH, col, lambda: atimed(run.n, batches))
        await t.arun(CONCURRENT, col, lambda: atimed(run.n, lambda: gather_bounded(run.n, one)))
    finally:
        await p.stop()

    async def consume() -> float:
        count = Counter(run.n)
        c = AIOKafkaConsumer(topic, bootstrap_servers=kafka.servers, group_id=kafka.group("ak"),
                             enable_auto_commit=False, auto_offset_reset="earliest")
        await c.start()
        deadline = time.monotonic() + WAIT
        try:
            while count.got < run.n and time.monotonic() < deadline:
                got = await c.getmany(timeout_ms=500, max_records=500)
                for records in got.values():
                    for _ in records:
                        count.tick()
                if got:
                    await c.commit()
            return count.rate()
        finally:
            await c.stop()
    await t.arun(CONSUME, col, consume)


async def faststream_kafka(run: Run, kafka: Kafka) -> None:
    t, col = run.table, FASTSTREAM
    topic = kafka.topic("faststream")
    broker = KafkaBroker(kafka.servers.split(","), acks="all", enable_idempotence=True,
                         max_batch_size=1 << 20, logger=None)
    count = Counter(run.n)

    @broker.subscriber(topic, group_id=kafka.group("faststream"), auto_offset_reset="earliest",
                       ack_policy=AckPolicy.ACK)
    async def handle(body: bytes) -> None:
        count.tick()

    async with broker:
        async def one() -> None:
            await broker.publish(BODY, topic)

        async def batches() -> None:
            for k in run.chunks():
                await broker.publish_batch(*([BODY] * k), topic=topic)
        await one()
        await t.arun(SINGLE, col, lambda: atimed(run.single, lambda: sequential(run.single, one)))
        await t.arun(BATCH, col, lambda: atimed(run.n, batches))
        await t.arun(CONCURRENT, col, lambda: atimed(run.n, lambda: gather_bounded(run.n, one)))

        await t.arun(CONSUME, col, lambda: faststream_consume(broker, count))


def bench_kafka(run: Run) -> None:
    kafka = Kafka(run)
    sections: list[tuple[str, Callable[[], object]]] = [
        (MQ_SYNC, lambda: mq_sync(run)),
        (MQ_ASYNC, lambda: asyncio.run(mq_async(run))),
        (KOMBU, lambda: kombu_kafka(run, kafka)),
        (FASTSTREAM, lambda: asyncio.run(faststream_kafka(run, kafka))),
        ("confluent-kafka", lambda: confluent_kafka_raw(run, kafka)),
        ("kafka-python", lambda: kafka_python_raw(run, kafka)),
        ("aiokafka", lambda: asyncio.run(aiokafka_raw(run, kafka))),
    ]
    try:
        run_sections(run.table, sections)
    finally:
        with contextlib.suppress(Exception):
            kafka.cleanup()


# -- driver -----------------------------------------------------------------------------------
BROKERS: dict[str, tuple[str, str, list[str], Callable[[Run], None]]] = {
    "rabbitmq": ("RabbitMQ", "MQ_TEST_RABBITMQ_URL", ["pika", "aio-pika"], bench_rabbitmq),
    "kafka": ("Kafka", "MQ_TEST_KAFKA_URL", ["confluent-kafka", "kafka-python", "aiokafka"],
              bench_kafka),
}
DEFAULT_URLS = {"MQ_TEST_RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
                "MQ_TEST_KAFKA_URL": "kafka://127.0.0.1:9092"}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--single", type=int, default=500, help="messages for single publish")
    ap.add_argument("--n", type=int, default=5000, help="messages for N-message operations")
    ap.add_argument("--batch", type=int, default=1000, help="chunk size of batch APIs")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; the best is shown")
    ap.add_argument("--only", choices=sorted(BROKERS))
    args = ap.parse_args()
    started = time.perf_counter()
    tables = []
    for key, (title, env, raws, bench) in BROKERS.items():
        if args.only and key != args.only:
            continue
        url = os.environ.get(env) or DEFAULT_URLS[env]
        where = mqabstract.BrokerURL.parse(url).redacted()
        table = Table(f"### {title} ({where}): msg/s, best of {args.rounds} round(s), "
                      f"single={args.single}, N={args.n}, batch chunks of {args.batch}",
                      [MQ_SYNC, MQ_ASYNC, KOMBU, FASTSTREAM, *raws])
        for r in range(args.rounds):
            print(f"{title}, round {r + 1} of {args.rounds}", flush=True)
            bench(Run(url, args.single, args.n, args.batch, secrets.token_hex(4), table))
        tables.append(table)
    print()
    for table in tables:
        print(table.render())
        print()
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
