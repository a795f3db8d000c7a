"""Kafka backend: interop with plain kafka-python, name mapping, a consumer killed mid-batch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

kafka = pytest.importorskip("kafka")

import mqabstract  # noqa: E402
from mqabstract import wire  # noqa: E402
from mqabstract.backends.kafka import kafka_topic_name, topic_regex  # noqa: E402
from mqabstract.names import topic_matches  # noqa: E402
from tests.brokers import resolve_url  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def url() -> str:
    return resolve_url("kafka")


def _bootstrap(url: str) -> list[str]:
    return [f"{h}:{p or 9092}" for h, p in mqabstract.BrokerURL.parse(url).hosts]


def test_mqabstract_publish_is_readable_by_plain_consumer(url, mq, names) -> None:
    _, root = names
    topic = f"{root}.created"
    body = bytes(range(256)) + b"\xff\xfe not utf-8"
    mid = mq.publish(topic, body, key="order-7", headers={"trace": "abc", "lang": "fr"})
    consumer = kafka.KafkaConsumer(bootstrap_servers=_bootstrap(url), group_id=None,
                                   enable_auto_commit=False)
    try:
        name = kafka_topic_name(topic)
        parts = [kafka.TopicPartition(name, p) for p in consumer.partitions_for_topic(name)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        records = []
        deadline = time.monotonic() + 15
        while not records and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    [rec] = records
    assert rec.value == body
    assert rec.key == b"order-7"
    headers = dict(rec.headers)
    assert headers["trace"] == b"abc" and headers["lang"] == b"fr"
    assert headers[wire.ID] == mid.encode()  # the wire schema, readable by any client
    assert abs(float(headers[wire.PUBLISHED_AT]) - time.time()) < 60
    assert not any(k.startswith(wire.PREFIX) and k not in wire.NAMES for k in headers)


def test_plain_producer_writing_the_wire_schema(url, mq, names) -> None:
    """A plain client that writes mq-id / mq-attempt / mq-published-at is understood."""
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    producer = kafka.KafkaProducer(bootstrap_servers=_bootstrap(url), acks="all")
    try:
        producer.send(kafka_topic_name(f"{root}.wire"), value=b"w", headers=[
            (wire.ID, b"order-42"), (wire.ATTEMPT, b"2"), (wire.PUBLISHED_AT, b"1700000000.5"),
        ]).get(timeout=15)
    finally:
        producer.close()
    [msg] = sub.receive(1, 20)
    assert (msg.id, msg.attempt, msg.published_at.timestamp()) == ("order-42", 3, 1700000000.5)
    assert msg.headers == {}
    msg.ack()
    sub.close()


def test_plain_producer_reaches_mqabstract_group(url, mq, names) -> None:
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    producer = kafka.KafkaProducer(bootstrap_servers=_bootstrap(url), acks="all")
    try:
        producer.send(kafka_topic_name(f"{root}.raw"), value=b"\x00plain\xff", key=b"k1",
                      headers=[("origin", b"raw"), ("n", b"1")]).get(timeout=15)
    finally:
        producer.close()
    [msg] = sub.receive(1, 20)
    assert (msg.body, msg.key, msg.topic) == (b"\x00plain\xff", "k1", f"{root}.raw")
    assert msg.headers == {"origin": "raw", "n": "1"}
    assert msg.attempt == 1 and msg.id  # no mq-id header: the record's coordinates
    msg.ack()
    sub.close()


@pytest.mark.parametrize(
    "pattern, topic",
    [("a.*", "a.b"), ("a.#", "a"), ("#.z", "z"), ("a.#.z", "a.b-c.d_e.z"), ("x-y.*", "x-y.q"),
     ("a.*", "a"), ("a.*", "a.b.c"), ("#.z", "z.a"), ("a_b.#", "a-b"), ("a-b.#", "a--b")],
)
def test_topic_regex_agrees_with_portable_matcher(pattern: str, topic: str) -> None:
    regex = re.compile(topic_regex(pattern, "pre."))
    assert bool(regex.match(kafka_topic_name(topic, "pre."))) == topic_matches(pattern, topic)


def test_long_topic_names_are_hashed_within_kafka_limit() -> None:
    topic = ".".join(["w" * 60] * 6)
    name = kafka_topic_name(topic)
    assert len(name) <= 249 and name != kafka_topic_name(topic + "x")


_VICTIM = textwrap.dedent(
    """
    import os, signal, sys
    import mqabstract
    url, group, pattern = sys.argv[1:4]
    broker = mqabstract.connect(url)
    sub = broker.subscribe(group, pattern, lease=60.0)
    print("READY", flush=True)
    got = []
    for _ in range(600):
        got += sub.receive(50, 0.2)
        if len(got) >= 10:
            break
    for msg in got:
        print("GOT", msg.id, flush=True)
    for msg in got[: len(got) // 2]:
        msg.ack()
        print("ACKED", msg.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-batch: the other half is never settled
    """
)


def test_consumer_killed_mid_batch_loses_nothing(url, mq, names) -> None:
    group, root = names
    pattern = f"{root}.#"
    mq.declare(group, pattern, lease=60.0)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    victim = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, url, group, pattern],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert victim.stdout is not None
        for line in victim.stdout:
            lines.append(line.strip())
            if line.startswith("READY"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert ready.wait(60), victim.stderr.read() if victim.stderr else ""
    brokers = [mqabstract.connect(url) for _ in range(2)]
    try:
        survivors = [b.subscribe(group, pattern, lease=60.0) for b in brokers]
        ids = set(mq.publish_batch(
            [{"topic": f"{root}.k", "body": f"{i}", "key": f"k{i}"} for i in range(300)]))
        acked: set[str] = set()
        lock = threading.Lock()
        stop = threading.Event()

        def work(sub: mqabstract.Subscription) -> None:
            while not stop.is_set():
                for msg in sub.receive(50, 0.5):
                    msg.ack()
                    with lock:
                        acked.add(msg.id)

        threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in survivors]
        for t in threads:
            t.start()
        assert victim.wait(60) == -signal.SIGKILL, victim.stderr.read() if victim.stderr else ""
        reader.join(10)
        got = {ln.split()[1] for ln in lines if ln.startswith("GOT ")}
        victim_acked = {ln.split()[1] for ln in lines if ln.startswith("ACKED ")}
        assert got and got - victim_acked, "the victim must die holding unsettled messages"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                if ids <= acked | victim_acked and got - victim_acked <= acked:
                    break
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(10)
        assert not ids - acked - victim_acked, f"lost {len(ids - acked - victim_acked)}"
        assert not (got - victim_acked) - acked, "the victim's unsettled messages came back"
        for sub in survivors:
            sub.close()
    finally:
        if victim.poll() is None:
            victim.kill()
        for b in brokers:
            b.close()
