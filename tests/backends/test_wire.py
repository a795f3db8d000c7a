"""The wire schema (mqabstract/wire.py) read and written by plain clients: pika and boto3.

(The Kafka side is in test_kafka.py.) A plain producer that writes ``mq-attempt`` and
``mq-published-at`` is understood; what mqabstract writes carries those names.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator

import pytest

import mqabstract
from mqabstract import wire
from tests.brokers import resolve_url

pika = pytest.importorskip("pika")
boto3 = pytest.importorskip("boto3")


@pytest.fixture
def token() -> str:
    return "w" + secrets.token_hex(4)


@pytest.fixture(scope="module")
def rabbit() -> Iterator[tuple[mqabstract.Broker, object]]:
    url = resolve_url("rabbitmq")
    conn = pika.BlockingConnection(pika.URLParameters(url))
    with mqabstract.connect(url) as mq:
        yield mq, conn.channel()
    conn.close()


@pytest.fixture(scope="module")
def sqs() -> Iterator[tuple[mqabstract.Broker, object]]:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(var, "testing")
    url = resolve_url("sqs")
    params = mqabstract.BrokerURL.parse(url).param_dict()
    client = boto3.client("sqs", region_name=params.get("region"),
                          endpoint_url=params.get("endpoint_url"))
    with mqabstract.connect(url) as mq:
        yield mq, client


def test_pika_reads_the_wire_headers(rabbit: tuple[mqabstract.Broker, object],
                                     token: str) -> None:
    mq, ch = rabbit
    queue = f"wire-{token}"
    ch.queue_declare(queue, exclusive=True)  # type: ignore[attr-defined]
    ch.queue_bind(queue, "mqabstract", routing_key=f"{token}.#")  # type: ignore[attr-defined]
    before = time.time()
    mid = mq.publish(f"{token}.a", b"x", id="order-1")
    deadline = time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:
        method, props, body = ch.basic_get(queue, auto_ack=True)  # type: ignore[attr-defined]
        got = (props, body) if method is not None else None
        time.sleep(0.05)
    assert got is not None, "nothing arrived"
    props, body = got
    assert mid == "order-1" and props.message_id == "order-1" and body == b"x"
    assert before - 1 <= float(props.headers[wire.PUBLISHED_AT]) <= time.time() + 1
    assert not any(k.startswith(wire.PREFIX) and k not in wire.NAMES for k in props.headers)


def test_pika_writing_the_wire_schema_is_understood(rabbit: tuple[mqabstract.Broker, object],
                                                    token: str) -> None:
    mq, ch = rabbit
    group = f"wire-{token}"
    with mq.subscribe(group, f"{token}.#") as sub:
        try:
            ch.basic_publish("mqabstract", f"{token}.b", b"y",  # type: ignore[attr-defined]
                             pika.BasicProperties(message_id="order-2", delivery_mode=2,
                                                  headers={wire.ATTEMPT: "2",
                                                           wire.PUBLISHED_AT: "1700000000.5",
                                                           "user": "u"}))
            [msg] = sub.receive(1, 10)
            assert (msg.id, msg.attempt, msg.published_at.timestamp()) == (
                "order-2", 3, 1700000000.5)
            assert dict(msg.headers) == {"user": "u"}
            msg.ack()
        finally:
            mq.delete_group(group)


def test_boto3_reads_the_packed_wire_schema(sqs: tuple[mqabstract.Broker, object],
                                            token: str) -> None:
    mq, client = sqs
    group = f"wire-{token}"
    mq.declare(group, f"{token}.#")
    try:
        before = time.time()
        mq.publish(f"{token}.a", b"x", id="order-3", key="k")
        resp = client.receive_message(  # type: ignore[attr-defined]
            QueueUrl=mq._driver.queue_url(group), WaitTimeSeconds=5,  # type: ignore[attr-defined]
            MessageAttributeNames=["All"])
        [raw] = resp["Messages"]
        meta = json.loads(raw["MessageAttributes"]["mq"]["StringValue"])
        assert meta[wire.PACKED[wire.ID]] == "order-3"
        assert meta[wire.PACKED[wire.KEY]] == "k"
        assert before - 1 <= meta[wire.PACKED[wire.PUBLISHED_AT]] <= time.time() + 1
    finally:
        mq.delete_group(group)


def test_boto3_writing_the_packed_schema_is_understood(sqs: tuple[mqabstract.Broker, object],
                                                       token: str) -> None:
    mq, client = sqs
    group = f"wire-{token}"
    with mq.subscribe(group, f"{token}.#") as sub:
        try:
            meta = {"v": 1, wire.PACKED[wire.ID]: "order-4", wire.PACKED[wire.ATTEMPT]: 2,
                    wire.PACKED[wire.PUBLISHED_AT]: 1700000000.5}
            client.send_message(  # type: ignore[attr-defined]
                QueueUrl=mq._driver.queue_url(group), MessageBody="z",  # type: ignore[attr-defined]
                MessageAttributes={
                    "mq": {"DataType": "String", "StringValue": json.dumps(meta)},
                    wire.TOPIC: {"DataType": "String", "StringValue": f"{token}.c"},
                    "user": {"DataType": "String", "StringValue": "u"}})
            [msg] = sub.receive(1, 10)
            assert (msg.id, msg.attempt, msg.topic, msg.published_at.timestamp()) == (
                "order-4", 3, f"{token}.c", 1700000000.5)
            assert dict(msg.headers) == {"user": "u"}
            msg.ack()
        finally:
            mq.delete_group(group)
