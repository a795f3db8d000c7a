"""RabbitMQ backend: interop with plain pika both ways, and a broker restart mid-run.

The shared broker comes from ``tests/brokers.py:resolve_url("rabbitmq")``; the restart test
runs a private node (``scripts/brokerctl.py:PrivateRabbit``) on a spare port that it may
stop and start. Names are unique per test and groups are deleted afterwards.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import mqabstract
from tests.brokers import in_ci, resolve_url

pika = pytest.importorskip("pika")


@pytest.fixture
def url() -> str:
    return resolve_url("rabbitmq")


@pytest.fixture
def token() -> str:
    return "t" + secrets.token_hex(4)


@pytest.fixture
def raw(url: str) -> Iterator[object]:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    yield conn.channel()
    conn.close()


def test_mqabstract_to_plain_pika_consumer(mq: mqabstract.Broker, raw: object, token: str) -> None:
    ch = raw
    queue = f"interop-{token}"
    ch.queue_declare(queue, exclusive=True)  # type: ignore[attr-defined]
    ch.queue_bind(queue, "mqabstract", routing_key=f"{token}.#")  # type: ignore[attr-defined]
    body = bytes(range(256)) * 3  # not UTF-8
    mid = mq.publish(f"{token}.orders.created", body, headers={"tenant": "acme", "x-trace": "1"},
                     key="cust-7", priority=3)
    mq.publish(f"{token}.orders.note", "héllo")
    method, props, got = _get(ch, queue)
    assert got == body
    assert method.routing_key == f"{token}.orders.created"
    assert props.message_id == mid
    assert props.headers["tenant"] == "acme" and props.headers["x-trace"] == "1"
    assert props.priority == 3 and props.delivery_mode == 2
    assert props.content_type is None
    method, props, got = _get(ch, queue)
    assert got == "héllo".encode() and props.content_type == "text/plain; charset=utf-8"


def test_plain_pika_publisher_to_mqabstract_group(mq: mqabstract.Broker, raw: object,
                                                  token: str) -> None:
    group = f"interop-{token}"
    sub = mq.subscribe(group, f"{token}.*")
    try:
        ch = raw
        props = pika.BasicProperties(message_id="from-pika-1", content_type="application/json",
                                     headers={"origin": "pika", "n": 7}, delivery_mode=2)
        ch.basic_publish("mqabstract", f"{token}.evt", b'{"a": 1}', props)  # type: ignore[attr-defined]
        ch.basic_publish("mqabstract", f"{token}.evt", b"\xff\x00",  # type: ignore[attr-defined]
                         pika.BasicProperties())
        got = _drain(sub, 2)
        first, second = got
        assert first.id == "from-pika-1" and first.topic == f"{token}.evt"
        assert first.value == {"a": 1} and first.attempt == 1
        assert dict(first.headers) == {"origin": "pika", "n": "7",
                                       "content-type": "application/json"}
        assert second.body == b"\xff\x00" and second.id and dict(second.headers) == {}
        # A foreign message survives our redelivery path with its id pinned.
        second_id = second.id
        first.ack()
        second.nack()
        [again] = _drain(sub, 1)
        assert again.id == second_id and again.attempt == 2 and again.body == b"\xff\x00"
        again.ack()
    finally:
        sub.close()
        mq.delete_group(group)


def _get(ch: object, queue: str, timeout: float = 10.0) -> tuple[object, object, bytes]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        method, props, body = ch.basic_get(queue, auto_ack=True)  # type: ignore[attr-defined]
        if method is not None:
            return method, props, body
        time.sleep(0.05)
    raise AssertionError(f"nothing arrived in {queue} within {timeout}s")


def _drain(sub: mqabstract.Subscription, count: int, timeout: float = 15.0,
           ack: bool = False) -> list[mqabstract.Message]:
    deadline = time.monotonic() + timeout
    got: list[mqabstract.Message] = []
    while len(got) < count and time.monotonic() < deadline:
        for msg in sub.receive(count - len(got), max(0.0, deadline - time.monotonic())):
            got.append(msg)
            if ack:
                msg.ack()
    assert len(got) == count, f"got {len(got)} of {count}"
    return got


# ----------------------------------------------------------------------------------------
# restart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def private_rabbit(tmp_path: Path) -> Iterator[object]:
    import brokerctl  # on sys.path through tests/brokers.py

    try:
        brokerctl.rabbit_script("rabbitmq-server")
    except Exception as exc:  # no rabbitmq-server on this machine
        reason = f"no rabbitmq-server to run a private node: {exc}"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    port = _free_port()
    node = brokerctl.PrivateRabbit(port=port, state_dir=tmp_path, dist_port=_free_port())
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.mark.slow
def test_restart_mid_run_loses_no_confirmed_message(private_rabbit: object) -> None:
    """Publisher and consumer keep running while the node stops and starts again: every
    message whose publish returned is received afterwards (duplicates are allowed)."""
    node = private_rabbit
    mq = mqabstract.connect(node.url, publish_timeout=90, connect_timeout=5)  # type: ignore[attr-defined]
    group = "restart-" + secrets.token_hex(3)
    sub = mq.subscribe(group, "r.#", lease=30)
    confirmed: list[str] = []
    received: set[str] = set()
    errors: list[BaseException] = []
    stop = threading.Event()
    total = 1000

    def publish() -> None:
        try:
            for i in range(total):
                if i % 10 == 0:
                    confirmed.extend(mq.publish_batch([(f"r.{i}", f"{j}") for j in range(5)]))
                else:
                    confirmed.append(mq.publish(f"r.{i}", f"{i}"))
                time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    def consume() -> None:
        while not stop.is_set():
            try:
                for msg in sub.receive(50, 0.5):
                    received.add(msg.id)
                    msg.ack()
            except mqabstract.MQError as exc:
                if not exc.retryable:
                    errors.append(exc)
                    return
                time.sleep(0.2)

    threads = [threading.Thread(target=publish), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    try:
        while len(confirmed) < 100 and threads[0].is_alive():
            time.sleep(0.05)
        at_restart = len(confirmed)
        assert threads[0].is_alive(), "the publisher finished before the restart: no test"
        node.restart()  # type: ignore[attr-defined]
        threads[0].join(180)
        assert not threads[0].is_alive(), "publisher hung"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not set(confirmed) <= received:
            time.sleep(0.2)
    finally:
        stop.set()
        threads[1].join(30)
    assert not errors, errors
    assert len(confirmed) == total + total // 10 * 4 > at_restart
    missing = set(confirmed) - received
    assert not missing, f"{len(missing)} confirmed messages never arrived"
    sub.close()
    mq.delete_group(group)
    mq.close()
