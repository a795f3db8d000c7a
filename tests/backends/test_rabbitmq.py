"""RabbitMQ backend: interop with plain pika both ways, a broker restart mid-run, and
consumers that are frozen (SIGSTOP), killed or just busy while they hold messages.

The shared broker comes from ``tests/brokers.py:resolve_url("rabbitmq")``; the restart test
runs a private node (``scripts/brokerctl.py:PrivateRabbit``) on a spare port that it may
stop and start. Names are unique per test and groups are deleted afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    message whose publish returned is received afterwards (duplicates are allowed). A
    publish the restart caught between its send and its confirm is in doubt: it raises a
    retryable error, and the publisher sends it again with the same id (the documented
    recovery; the broker may then hold it twice)."""
    node = private_rabbit
    mq = mqabstract.connect(node.url, publish_timeout=90, connect_timeout=5)  # type: ignore[attr-defined]
    group = "restart-" + secrets.token_hex(3)
    sub = mq.subscribe(group, "r.#", lease=30)
    confirmed: list[str] = []
    received: set[str] = set()
    errors: list[BaseException] = []
    stop = threading.Event()
    total = 1000

    retried: list[BaseException] = []

    def publish() -> None:
        try:
            for i in range(total):
                while True:
                    try:
                        if i % 10 == 0:
                            confirmed.extend(mq.publish_batch([
                                mqabstract.OutgoingMessage(f"r.{i}", f"{j}", id=f"r{i}-{j}")
                                for j in range(5)]))
                        else:
                            confirmed.append(mq.publish(f"r.{i}", f"{i}", id=f"r{i}"))
                        break
                    except mqabstract.MQError as exc:
                        if not exc.retryable or len(retried) >= 20:
                            raise
                        retried.append(exc)  # in doubt or not sent: again, same ids
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
    assert len(set(confirmed)) == total + total // 10 * 4 > at_restart
    missing = set(confirmed) - received
    assert not missing, f"{len(missing)} confirmed messages never arrived"
    sub.close()
    mq.delete_group(group)
    mq.close()


@pytest.mark.slow
def test_a_restart_between_publishes_puts_nothing_in_doubt(private_rabbit: object) -> None:
    """The node restarts while the publisher's connection sits idle: the next publish finds
    the connection closed before it sends anything (it reads the broker's close first), so
    it opens a new one and returns, instead of sending into the dead connection and
    raising "may have been published"."""
    node = private_rabbit
    with mqabstract.connect(node.url, publish_timeout=90, connect_timeout=5) as mq:  # type: ignore[attr-defined]
        mq.declare("idle-restart", "i.#", lease=30)
        mq.publish("i.a", b"before", id="before")
        node.restart()  # type: ignore[attr-defined]
        mq.publish("i.a", b"after", id="after")  # no ConnectionFailed
        with mq.subscribe("idle-restart", "i.#", lease=30) as sub:
            got = _drain(sub, 2, timeout=30.0, ack=True)
        assert sorted(m.id for m in got) == ["after", "before"]


# ----------------------------------------------------------------------------------------
# frozen and killed consumers (the lease watchdog)

HOLDER = r"""
import os, sys, time, mqabstract
url, group, pattern, lease, count = sys.argv[1:6]
priority = sys.argv[6] == "1"
def out(*w):
    sys.stdout.write(" ".join(map(str, w)) + "\n"); sys.stdout.flush()
with mqabstract.connect(url) as mq:
    sub = mq.subscribe(group, pattern, lease=float(lease), max_attempts=50, priority=priority)
    while True:
        started = time.monotonic()
        msgs = sub.receive(int(count), 1.0)
        if msgs:
            break
    out("RECVAT", repr(started))
    for m in msgs:
        out("RECV", m.id, m.attempt)
    from mqabstract.backends import rabbitmq
    dog = rabbitmq._Watchdog._current
    out("HELD", dog.proc.pid if dog is not None else 0)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(0)
    for m in msgs:
        try:
            m.ack()
            out("ACKED", m.id)
        except mqabstract.LeaseExpired:
            out("EXPIRED", m.id)
    end = time.monotonic() + 15
    while time.monotonic() < end:
        for m in sub.receive(10, 0.5):
            out("LATER", m.id, m.attempt)
            m.ack()
            if m.id.endswith("-after"):
                end = 0
    out("DONE")
"""


class _Holder:
    """A consumer process that receives one batch, reports it and waits (to be frozen)."""

    def __init__(self, url: str, group: str, pattern: str, lease: float, count: int,
                 priority: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, url, group, pattern, str(lease), str(count),
             "1" if priority else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[list[str]] = []
        while True:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            assert line, f"holder died: {self.proc.stderr.read()}"  # type: ignore[union-attr]
            self.lines.append(line.split())
            if self.lines[-1][0] == "HELD":
                break
        self.started = next(float(x[1]) for x in self.lines if x[0] == "RECVAT")
        self.held = {x[1]: int(x[2]) for x in self.lines if x[0] == "RECV"}
        self.watchdog = int(self.lines[-1][1])

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self, go: bool = True) -> list[list[str]]:
        out, err = self.proc.communicate("go\n" if go else "stop\n", timeout=60)
        assert self.proc.returncode == 0, err
        return [line.split() for line in out.splitlines()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process dies once resumed
            self.proc.wait()


def _take_back(sub: mqabstract.Subscription, ids: set[str], limit: float
               ) -> dict[str, tuple[float, int]]:
    """Receive (and ack) until every id in ``ids`` arrived: {id: (when, attempt)}."""
    arrived: dict[str, tuple[float, int]] = {}
    end = time.monotonic() + limit
    while not ids <= set(arrived) and time.monotonic() < end:
        for msg in sub.receive(50, 0.2):
            arrived.setdefault(msg.id, (time.monotonic(), msg.attempt))
            msg.ack()
    return arrived


@pytest.mark.parametrize("priority", [False, True], ids=["quorum", "classic"])
def test_frozen_consumer_releases_after_its_lease(mq: mqabstract.Broker, url: str,
                                                  token: str, priority: bool) -> None:
    """SIGSTOP a consumer holding messages: another consumer gets them after the lease
    deadline, within the declared margin, with attempt 2; the woken one's acks raise
    LeaseExpired and it goes on consuming on a new connection."""
    from mqabstract.backends.rabbitmq import RELEASE_MARGIN

    assert mq.capabilities.release_margin == RELEASE_MARGIN
    lease = 1.0
    group, pattern, topic = f"freeze-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease, priority=priority)
    holder = None
    try:
        ids = set(mq.publish_batch([mqabstract.OutgoingMessage(topic, b"x", id=f"{token}-{i}")
                                    for i in range(20)]))
        holder = _Holder(url, group, pattern, lease, 5, priority)
        holder.signal(signal.SIGSTOP)
        with mq.subscribe(group, pattern, lease=lease) as sub:
            arrived = _take_back(sub, ids, 30)
        assert set(holder.held) <= set(arrived), "held messages did not come back"
        first = min(arrived[m][0] for m in holder.held) - holder.started
        took = max(arrived[m][0] for m in holder.held) - holder.started
        assert lease <= first and took <= lease + RELEASE_MARGIN, (first, took)
        assert {arrived[m][1] for m in holder.held} == {2}
        assert ids == set(arrived)
        holder.signal(signal.SIGCONT)
        time.sleep(0.3)
        mq.publish(topic, b"y", id=f"{token}-after")
        lines = holder.finish()
        assert [x[0] for x in lines if x[0] in ("ACKED", "EXPIRED")] == ["EXPIRED"] * 5
        # Nothing stale from the cut connection, only the new message, as a first delivery.
        assert [x[1:] for x in lines if x[0] == "LATER"] == [[f"{token}-after", "1"]]
    finally:
        if holder is not None:
            holder.kill()
        mq.delete_group(group)


def test_classic_attempts_count_on_after_two_freezes(mq: mqabstract.Broker, url: str,
                                                     token: str) -> None:
    """A classic queue only flags a redelivery; the driver writes the attempt down before
    handing it out, so a second frozen holder's message comes back with attempt 3."""
    lease = 0.5
    group, pattern, topic = f"freeze2-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease, priority=True)
    holders: list[_Holder] = []
    try:
        mid = mq.publish(topic, b"x", id=f"{token}-m")
        for attempt in (1, 2):
            holder = _Holder(url, group, pattern, lease, 1, priority=True)
            holders.append(holder)
            assert holder.held == {mid: attempt}
            holder.signal(signal.SIGSTOP)
        with mq.subscribe(group, pattern, lease=lease) as sub:
            arrived = _take_back(sub, {mid}, 20)
        assert arrived[mid][1] == 3
    finally:
        for holder in holders:
            holder.kill()
        mq.delete_group(group)


def test_killed_consumer_releases_at_once_and_its_watchdog_exits(
        mq: mqabstract.Broker, url: str, token: str) -> None:
    """SIGKILL: the watchdog's copy of the socket must not keep the connection open."""
    lease = 30.0
    group, pattern, topic = f"kill-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease)
    holder = None
    try:
        ids = set(mq.publish_batch([mqabstract.OutgoingMessage(topic, b"x", id=f"{token}-{i}")
                                    for i in range(5)]))
        holder = _Holder(url, group, pattern, lease, 5)
        assert holder.watchdog > 0
        holder.signal(signal.SIGKILL)
        killed = time.monotonic()
        with mq.subscribe(group, pattern, lease=lease) as sub:
            arrived = _take_back(sub, ids, 20)
        assert set(arrived) == ids
        assert max(t for t, _ in arrived.values()) - killed < 5.0
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                os.kill(holder.watchdog, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the watchdog outlived its process")
    finally:
        if holder is not None:
            holder.kill()
        mq.delete_group(group)


def test_busy_handler_keeps_its_lease(mq: mqabstract.Broker, token: str) -> None:
    """A CPU-bound handler (pure Python, so the GIL switches) inside its lease is not taken
    for a frozen one: nobody else gets its message and its ack takes effect."""
    lease = 4.0
    group, pattern, topic = f"busy-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease)
    try:
        mid = mq.publish(topic, b"x")
        with mq.subscribe(group, pattern, lease=lease) as sub, \
                mq.subscribe(group, pattern, lease=lease) as other:
            [msg] = _drain(sub, 1)
            end = time.monotonic() + 3.0
            n = 0
            while time.monotonic() < end:  # busy: the I/O thread only gets GIL switches
                n += sum(i * i for i in range(1000))
            assert other.receive(1, 0.0) == []
            msg.ack()
            assert other.receive(1, lease + 2.0) == [], "the acked message came back"
        assert mq.stats(group).ready == 0
        assert mid == msg.id
    finally:
        mq.delete_group(group)


# ----------------------------------------------------------------------------------------
# native TTL


def _until(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_expired_messages_leave_the_queue_without_a_consumer(
        mq: mqabstract.Broker, raw: object, names: tuple[str, str]) -> None:
    group, root = names
    assert mq.capabilities.support(mqabstract.Feature.TTL) is mqabstract.Support.NATIVE
    sub = mq.subscribe(group, f"{root}.#")
    stale = mq.publish(f"{root}.a", b"stale", ttl=0.3, headers={"h": "1"})
    mq.publish(f"{root}.b", b"plain")
    # The broker's copy carries what is left of the TTL as its AMQP expiration.
    queue = f"interop-{root.split('.')[1]}-peek"
    ch = raw
    ch.queue_declare(queue, exclusive=True)  # type: ignore[attr-defined]
    ch.queue_bind(queue, "mqabstract", routing_key=f"{root}.#")  # type: ignore[attr-defined]
    mq.publish(f"{root}.c", b"peeked", ttl=30)
    _m, props, _b = _get(ch, queue)
    assert 29_000 <= int(props.expiration) <= 30_000  # type: ignore[attr-defined]
    # Nobody receives: the group queue still drops the stale one into its dead letters.
    _until(lambda: mq.dead_letters(group))
    [dead] = mq.dead_letters(group)
    assert (dead.id, dead.reason, dead.attempts, dead.topic, dead.headers) == (
        stale, "expired", 0, f"{root}.a", {"h": "1"})
    assert dead.dead_lettered_at is not None and dead.dead_lettered_at >= dead.published_at
    assert mq.stats(group).ready == 2
    # A replay restores the topic and drops the TTL (it would expire again at once).
    assert mq.replay_dead_letters(group) == 1
    got = {m.body: m for m in _drain(sub, 3, ack=True)}
    assert got[b"stale"].topic == f"{root}.a" and got[b"stale"].expires_at is None


def test_a_retried_message_keeps_what_is_left_of_its_ttl(
        mq: mqabstract.Broker, names: tuple[str, str]) -> None:
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    mid = mq.publish(f"{root}.a", b"x", ttl=1.0)
    [msg] = _drain(sub, 1)
    msg.nack()  # back in the queue at once, with attempt 1 and the TTL's rest
    _until(lambda: mq.dead_letters(group))
    [dead] = mq.dead_letters(group)
    assert (dead.id, dead.reason, dead.attempts) == (mid, "expired", 1)


def test_drop_groups_lose_expired_messages_in_the_broker(
        mq: mqabstract.Broker, names: tuple[str, str]) -> None:
    group, root = names
    mq.subscribe(group, f"{root}.#", expired="drop")
    mq.publish(f"{root}.a", b"x", ttl=0.2)
    _until(lambda: mq.stats(group).ready == 0)
    assert mq.stats(group).dead == 0 and mq.dead_letters(group) == []


def test_native_ttl_off_keeps_queues_without_dead_letter_routing(
        url: str, names: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    """``native_ttl=false`` declares queues as before native TTL and leaves expiry to the
    receive check; a native broker meeting such a queue keeps it as it is (logged) rather
    than failing, and its publishes would be dropped there, hence the option."""
    group, root = names
    legacy = mqabstract.connect(url, native_ttl=False)
    native = mqabstract.connect(url)
    try:
        assert legacy.capabilities.support(mqabstract.Feature.TTL) is mqabstract.Support.EMULATED
        sub = legacy.subscribe(group, f"{root}.#")
        legacy.publish(f"{root}.a", b"stale", ttl=0.2)
        time.sleep(0.6)
        assert legacy.stats(group).ready == 1  # still there: nothing expired it
        assert sub.receive(1, 0.5) == []  # the receive check dead-letters it
        assert [d.reason for d in legacy.dead_letters(group)] == ["expired"]
        with caplog.at_level("INFO", logger="mqabstract.rabbitmq"):
            native.subscribe(group, f"{root}.#")  # other queue arguments: kept as it is
        assert "other queue arguments" in caplog.text
        # ... and told loudly: its expired messages would be dropped, not dead-lettered
        assert [r.levelname for r in caplog.records if "no dead-letter routing" in r.message
                ] == ["WARNING"]
        caplog.clear()
        with caplog.at_level("INFO", logger="mqabstract.rabbitmq"):
            native.subscribe(group + "p", f"{root}.#", priority=True)
            with mqabstract.connect(url) as again:  # other hints, routing in place
                again.subscribe(group + "p", f"{root}.#")
        assert "other queue arguments" in caplog.text
        assert "no dead-letter routing" not in caplog.text
        native.delete_group(group + "p")
    finally:
        legacy.close()
        native.close()


@pytest.mark.parametrize(("expires_in", "expected"), [
    (1.5, "1500"), (0.0001, "1"), (-3.0, "0"), (50 * 86400.0, None)])
def test_expiration_is_what_is_left_of_the_ttl(expires_in: float, expected: str | None) -> None:
    from backends.rabbitmq.wire import _expiration
    now = 1_000_000.0
    assert _expiration({"mq-expires-at": repr(now + expires_in)}, now) == expected
    assert _expiration({}, now) is None
    assert _expiration({"mq-expires-at": "soon"}, now) is None


# ----------------------------------------------------------------------------------------
# pausing an idle consumer


@pytest.mark.parametrize("priority", [False, True], ids=["quorum", "classic"])
def test_a_pause_hands_back_deliveries_on_the_wire_uncounted(mq: mqabstract.Broker,
                                                             token: str, priority: bool) -> None:
    """An idle consumer is paused (basic.cancel, its unread buffer handed back). Deliveries
    already on the wire arrive between the cancel and its cancel-ok; pika would reject them
    (requeue), which counts a delivery on a quorum queue (x-delivery-count) and flags a
    redelivery on a classic one: their next delivery would skip an attempt. Here the pause
    starts inside the first delivery's callback, the rest of the prefetch still unread:
    every message still comes with attempt 1."""
    lease, count = 30.0, 60
    group, pattern, topic = f"pause-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease, priority=priority)
    try:
        mq.publish_batch([mqabstract.OutgoingMessage(topic, b"x", id=f"{token}-{i}")
                          for i in range(count)])
        with mq.subscribe(group, pattern, lease=lease) as sub:
            inner = sub._inner
            pausing = threading.Event()
            while_cancelling = []  # deliveries between the cancel and its cancel-ok

            class PauseAtFirstDelivery(threading.Condition):
                def notify(self, n: int = 1) -> None:  # on the I/O thread, in on_message
                    super().notify(n)
                    if inner._io._cancelling:  # type: ignore[attr-defined]
                        while_cancelling.append(1)
                    if not pausing.is_set():
                        pausing.set()
                        inner._io.pause()  # type: ignore[attr-defined]

            inner._held.cond = PauseAtFirstDelivery(inner._held.lock)  # type: ignore[attr-defined]
            got = _drain(sub, count, ack=True)
            assert pausing.is_set()
            assert sorted(m.id for m in got) == sorted(f"{token}-{i}" for i in range(count))
            assert {m.id: m.attempt for m in got if m.attempt != 1} == {}
            assert while_cancelling  # the case at hand: some were on the wire
            assert sub.receive(1, 1.0) == []
    finally:
        mq.delete_group(group)


def test_a_receive_that_restarts_an_idle_consumer_is_not_paused_at_once(
        mq: mqabstract.Broker, token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The I/O thread's tick pauses a consumer nobody received from for a while. A receive
    that restarts it must not look idle to a tick that lands between the restart and the
    receive's wait: that paused it at once, cancelling what was on the wire (a message
    whose lease had run out, as in conformance ``test_settle_after_deadline``)."""
    lease = 2.0
    group, pattern, topic = f"restart-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease)
    try:
        mid = mq.publish(topic, b"x")
        with mq.subscribe(group, pattern, lease=lease) as sub:
            inner: Any = sub._inner
            [msg] = _drain(sub, 1)
            time.sleep(msg.lease_remaining + 0.05)
            with pytest.raises(mqabstract.LeaseExpired):
                msg.nack()
            # paused (idle), and the copy of the expired message is in the queue
            _until(lambda: not inner._held.want and inner._held.inflight == 0
                   and inner._held.leases.next_deadline() is None)
            pauses: list[int] = []
            pause = inner._io.pause
            call = inner._link.call

            def counted(*args: Any) -> None:
                pauses.append(1)
                pause(*args)

            def start_then_tick(fn: Any) -> None:
                """The receive's thread descheduled right after it asked for the restart:
                the I/O thread restarts the consumer and ticks before that thread goes on."""
                ran = threading.Event()

                def both() -> None:
                    try:
                        fn()
                        if fn == inner._io.start:
                            inner._io.tick(time.monotonic())
                    finally:
                        ran.set()

                call(both)
                assert ran.wait(10)

            monkeypatch.setattr(inner._io, "pause", counted)
            monkeypatch.setattr(inner._link, "call", start_then_tick)
            [again] = _drain(sub, 1)
            assert (again.id, again.attempt) == (mid, 2)
            assert pauses == []
    finally:
        mq.delete_group(group)


# ----------------------------------------------------------------------------------------
# a connection cut while a message goes back to the queue by copy


@pytest.mark.parametrize("held", ["lease", "buffer"])
def test_a_consumer_woken_near_its_watchdogs_cut_copies_nothing_until_it_cannot_come(
        mq: mqabstract.Broker, token: str, monkeypatch: pytest.MonkeyPatch, held: str) -> None:
    """The I/O thread stalls (as in a frozen process) past what it reported to the watchdog:
    a lease deadline (``lease``: the message's lease runs out meanwhile) or the release
    time of an unread buffer (``buffer``: it looks idle when it wakes). Woken, it would
    hand those back by copy while the watchdog may cut the socket any moment: a copy the
    broker got just before the cut stands beside its original, which the cut hands back
    too, for any consumer to get (both at attempt 2, or 2 then 1). It must send no copy
    until the cut can no longer come (it reports a copy in flight, the watchdog holding off,
    and waits out the window), and each message come again once: an expired lease counted
    (attempt 2; given back by the broker, not by copy), the unread buffer at attempt 1 if
    it went back by copy after the window or 2 if the watchdog cut."""
    lease = 1.0
    group, pattern, topic = f"wake-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease)
    try:
        ids = mq.publish_batch([mqabstract.OutgoingMessage(topic, b"x", id=f"{token}-{i}")
                                for i in range(2)])
        with mq.subscribe(group, pattern, lease=lease) as sub:
            inner: Any = sub._inner
            [first] = _drain(sub, 1)
            _until(lambda: len(inner._held.buf) == 1)  # the other one waits, unread
            if held == "buffer":
                first.ack()
                _until(lambda: not inner._held.acks)
            sent: list[float] = []
            send = inner._io._send
            monkeypatch.setattr(inner._io, "_send", lambda items, pend: (
                sent.append(time.monotonic()), send(items, pend)))
            with inner._held.lock:
                reported = inner._held.dog_sent
            assert reported == reported, "no watchdog"  # (nan)
            from mqabstract.backends.rabbitmq import watchdog
            cut_by = reported + watchdog._WATCH_GRACE + watchdog._WATCH_SLACK
            stall = reported + 0.38 - time.monotonic()  # past the risk point, before the cut
            inner._link.call(lambda: time.sleep(stall))
            time.sleep(stall + 0.1)
            back = _attempts_in_order(sub, set(ids[1:]) if held == "buffer" else set(ids),
                                      quiet=1.5)
        assert [t for t in sent if t < cut_by] == [], "copied while the watchdog may cut"
        assert len(back) == len({m for m, _ in back}), back  # each once
        if held == "lease":
            assert dict(back)[ids[0]] == 2
        assert {m for m, _ in back} == set(ids[1:] if held == "buffer" else ids)
    finally:
        mq.delete_group(group)


def test_superseded_drops_only_the_message_a_copy_stands_for() -> None:
    """(No broker.) The consumer's memory of originals whose copies are confirmed: the
    original is dropped only as a redelivery of that very message (id, copy token and
    publish time), once; a replay or a later publish of the same id is not; a copy in
    doubt is dropped on its first delivery."""
    from mqabstract.backends.rabbitmq.consumer import _Superseded
    from mqabstract.backends.rabbitmq.wire import H_COPY

    s = _Superseded()
    assert not s
    first = {"mq-published-at": "1.5"}
    s.add(_Superseded.key("m", first), True, 1, 0.0)
    assert not s.take("m", first, redelivered=False)  # not a redelivery: not the original
    assert not s.take("m", {"mq-published-at": "2.5"}, True)  # published again
    assert not s.take("m", {**first, H_COPY: "r1"}, True)  # a replay (its own token)
    assert not s.take(None, first, True)
    assert s.take("m", first, True)
    assert not s.take("m", first, True)  # once
    copy = {**first, H_COPY: "c.1"}
    s.add(_Superseded.key("m", copy), False, 1, 0.0)
    assert s.take("m", copy, redelivered=False)


def test_superseded_forgets_on_the_clock_and_past_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(No broker, a fake clock.) Entries of the live channel go after
    ``_SUPERSEDED_LIVE_S``, those of a channel that was cut after ``_SUPERSEDED_CUT_S``,
    and the oldest go over ``_SUPERSEDED_MAX``."""
    from mqabstract.backends.rabbitmq import consumer

    monkeypatch.setattr(consumer, "_SUPERSEDED_MAX", 3)
    cut_s, live_s = consumer._SUPERSEDED_CUT_S, consumer._SUPERSEDED_LIVE_S
    assert live_s < cut_s

    def kept(s: consumer._Superseded, *names: str) -> list[str]:
        return [n for n in names if s.take(n, None, True)]

    s = consumer._Superseded()
    s.add(("cut", None, None), True, 1, 0.0)  # waits on channel 1, since cut
    s.add(("live", None, None), True, 2, 0.0)  # waits on channel 2, still open
    s.prune(2, live_s + 1)  # (the oldest first: the cut one still counts)
    assert kept(s, "cut", "live") == ["cut", "live"]
    s.add(("cut", None, None), True, 1, 0.0)
    s.add(("live", None, None), True, 2, 0.0)
    s.prune(2, cut_s + 1)
    assert kept(s, "cut", "live") == []
    for n in "abcd":
        s.add((n, None, None), True, 2, 0.0)
    assert kept(s, "a", "b", "c", "d") == ["b", "c", "d"]


def _cut_at_original_ack(inner: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Arm a cut: the first basic.ack on the consumer's channel is not sent; its connection's
    socket is shut down instead, as by a network cut or the lease watchdog. Returns a list
    that gets one entry when the cut happened."""
    cut: list[int] = []
    real_ack = pika.channel.Channel.basic_ack

    def ack(ch: Any, delivery_tag: int = 0, multiple: bool = False) -> None:
        if not cut and ch is inner._io.ch:
            cut.append(delivery_tag)
            inner._io.conn._transport._sock.shutdown(socket.SHUT_RDWR)
            return
        real_ack(ch, delivery_tag, multiple)

    monkeypatch.setattr(pika.channel.Channel, "basic_ack", ack)
    return cut


def _attempts_in_order(sub: mqabstract.Subscription, ids: set[str], quiet: float = 2.0,
                       limit: float = 30.0) -> list[tuple[str, int]]:
    """Receive and ack until every id came and then nothing more for ``quiet`` seconds."""
    seen: list[tuple[str, int]] = []
    end = time.monotonic() + limit
    last = time.monotonic()
    while time.monotonic() < end:
        if ids <= {m for m, _ in seen} and time.monotonic() - last >= quiet:
            break
        for msg in sub.receive(50, 0.2):
            seen.append((msg.id, msg.attempt))
            last = time.monotonic()
            with contextlib.suppress(mqabstract.LeaseExpired):
                msg.ack()
    return seen


def _going_back(seen: list[tuple[str, int]]) -> dict[str, list[int]]:
    by_id: dict[str, list[int]] = {}
    for mid, attempt in seen:
        by_id.setdefault(mid, []).append(attempt)
    return {m: a for m, a in by_id.items() if any(x >= y for x, y in itertools.pairwise(a))}


@pytest.mark.parametrize("priority", [False, True], ids=["quorum", "classic"])
@pytest.mark.parametrize("path", ["pause", "nack-delay"])
def test_a_cut_between_copy_and_ack_never_sends_attempts_back(
        mq: mqabstract.Broker, token: str, monkeypatch: pytest.MonkeyPatch, path: str,
        priority: bool) -> None:
    """A message goes back to the queue as a copy and its original is acked: a consumer's
    unread buffer when it pauses (same attempt), a nack with a delay (attempt + 1, through
    a wait tier). (An expired lease and a nack without delay go back in one step, a
    requeue the broker counts: no copy.) The connection is cut just when the original's
    ack would go out, after the copy was confirmed: the broker redelivers the original
    (counted: attempt + 1) beside the copy, and the consumer must drop the original.
    Whatever then comes, one
    id's attempts must strictly increase in delivery order, and nothing is lost."""
    lease = 30.0
    group, pattern, topic = f"cut-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=lease, priority=priority)
    try:
        count = 5 if path == "pause" else 1
        ids = set(mq.publish_batch([mqabstract.OutgoingMessage(topic, b"x", id=f"{token}-{i}")
                                    for i in range(count)]))
        with mq.subscribe(group, pattern, lease=lease) as sub:
            inner: Any = sub._inner
            [first] = _drain(sub, 1)
            seen = [(first.id, first.attempt)]
            if path == "pause":  # the other four wait in the buffer, unread
                first.ack()
                _until(lambda: not inner._held.acks)
                cut = _cut_at_original_ack(inner, monkeypatch)
                _until(lambda: bool(cut))  # idle: paused, buffer handed back
            else:
                cut = _cut_at_original_ack(inner, monkeypatch)
                with contextlib.suppress(mqabstract.MQError):
                    first.nack(delay=0.1)
                _until(lambda: bool(cut))
            # (the pause path acked the first one: waiting for it again ran to the limit)
            again = ids - {first.id} if path == "pause" else ids
            seen += _attempts_in_order(sub, again)
        assert ids <= {m for m, _ in seen}, "lost"
        assert _going_back(seen) == {}, seen
    finally:
        mq.delete_group(group)


def _cut_after_commit(inner: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Arm a cut: once copies went out (publishes on the consumer's copy channel) and the
    consumer channel then sent a tx.commit (their originals' acks) and the frames left
    the socket, shut the socket down, as a lease watchdog racing a woken process, a kill
    or a network cut may. The broker gets the whole transaction and then the end of the
    connection. Returns a list that gets the number of copies when the cut happened."""
    cut: list[int] = []
    copies: list[int] = [0]
    real_publish = pika.channel.Channel.basic_publish
    real_commit = pika.channel.Channel.tx_commit

    def publish(ch: Any, *args: Any, **kwargs: Any) -> None:
        if ch is inner._io._pub_ch:
            copies[0] += 1
        real_publish(ch, *args, **kwargs)

    def commit(ch: Any, *args: Any, **kwargs: Any) -> None:
        real_commit(ch, *args, **kwargs)
        if cut or ch is not inner._io.ch or not copies[0]:
            return
        cut.append(copies[0])
        transport = inner._io.conn._transport

        def when_written() -> None:
            if transport.get_write_buffer_size():
                inner._link.ioloop.call_later(0.001, when_written)
                return
            transport._sock.shutdown(socket.SHUT_RDWR)

        when_written()

    monkeypatch.setattr(pika.channel.Channel, "basic_publish", publish)
    monkeypatch.setattr(pika.channel.Channel, "tx_commit", commit)
    return cut


@pytest.mark.parametrize("count", [5, 60])
def test_a_cut_after_a_big_commit_never_sends_attempts_back(
        mq: mqabstract.Broker, token: str, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """An idle consumer hands its unread buffer (up to ``prefetch`` messages) back by copy,
    and the connection is cut right after the broker got the tx.commit of their originals'
    acks. When the copies and the acks were one transaction, RabbitMQ 3.10's quorum queues
    could apply acks and drop copies (a few per cent of runs lost one) or, with 32 copies
    or more, enqueue the copies and drop the acks (every original back beside its copy).
    Now the copies are confirmed first, and an original that comes back beside its copy is
    dropped. Whatever comes, one id's attempts must strictly increase in delivery order,
    and nothing is lost."""
    group, pattern, topic = f"cutc-{token}", f"{token}.#", f"{token}.w"
    mq.declare(group, pattern, lease=30.0)
    try:
        ids = set(mq.publish_batch([mqabstract.OutgoingMessage(topic, b"x", id=f"{token}-{i}")
                                    for i in range(count + 1)]))
        with mq.subscribe(group, pattern, lease=30.0) as sub:
            inner: Any = sub._inner
            [first] = _drain(sub, 1)
            _until(lambda: len(inner._held.buf) == count)  # the rest wait, unread
            first.ack()
            _until(lambda: not inner._held.acks)
            cut = _cut_after_commit(inner, monkeypatch)
            _until(lambda: bool(cut))  # idle: paused, buffer handed back, then cut
            seen = [(first.id, first.attempt), *_attempts_in_order(sub, ids - {first.id})]
        assert ids <= {m for m, _ in seen}, "lost"
        assert _going_back(seen) == {}, {m: a for m, a in _going_back(seen).items()}
    finally:
        mq.delete_group(group)


def _cut_after_publish_written(mq: mqabstract.Broker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Arm a cut of the publisher's connection: the first time a publish waits for its
    confirms, its frames are written out, the broker is given time to route it, and the
    socket is shut down before the confirm is read (a confirm lost in a network cut)."""
    pub: Any = mq._driver._pub  # type: ignore[attr-defined]
    real_wait = type(pub)._wait
    cut: list[int] = []

    def wait(self: Any, pend: Any, deadline: float) -> None:
        if not cut:
            cut.append(1)
            transport = self.conn._impl._transport
            while transport.get_write_buffer_size():  # the publish leaves the socket
                transport._on_socket_writable()
            sock = self.conn._impl._transport._sock
            until = time.monotonic() + 0.3  # routed and stored; its confirm is lost
            while time.monotonic() < until:
                with contextlib.suppress(BlockingIOError):
                    sock.recv(65536)
                time.sleep(0.01)
            sock.shutdown(socket.SHUT_RDWR)
        real_wait(self, pend, deadline)

    monkeypatch.setattr(type(pub), "_wait", wait)
    return cut


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
def test_a_publish_whose_confirm_was_lost_is_not_sent_twice(
        mq: mqabstract.Broker, token: str, monkeypatch: pytest.MonkeyPatch,
        batch: bool) -> None:
    """The publisher's connection is lost after the broker stored a message and before its
    confirm came back. The driver cannot know whether it was stored: it must not send it
    again on a new connection by itself (each copy would count attempts from 1: one id
    delivered at attempt 2 and then at attempt 1, test_container_fault[rabbitmq-cut]), but
    report it as not confirmed (retryable), leaving the choice to the caller."""
    group, pattern, topic = f"pubcut-{token}", f"{token}.#", f"{token}.p"
    mq.declare(group, pattern, lease=30.0)
    try:
        cut = _cut_after_publish_written(mq, monkeypatch)
        sent = [f"{token}-{i}" for i in range(3 if batch else 1)]
        error: mqabstract.MQError | None = None
        try:
            if batch:
                mq.publish_batch([mqabstract.OutgoingMessage(topic, b"x", id=mid)
                                  for mid in sent])
            else:
                mq.publish(topic, b"x", id=sent[0])
        except mqabstract.MQError as exc:
            error = exc
        assert cut
        mq.publish(topic, b"after", id=f"{token}-after")  # the publisher reconnects
        with mq.subscribe(group, pattern, lease=30.0) as sub:
            seen = _attempts_in_order(sub, {f"{token}-after", *sent})
        ids = [m for m, _ in seen]
        assert len(ids) == len(set(ids)), f"sent twice: {seen}"
        assert isinstance(error, (mqabstract.ConnectionFailed, mqabstract.PublishError))
        assert error.retryable and "may have been published" in str(error), error
    finally:
        mq.delete_group(group)


@pytest.mark.parametrize("n", [1, 200])
def test_a_publish_leaves_in_as_few_sends_as_its_bytes_need(
        mq: mqabstract.Broker, token: str, n: int) -> None:
    """pika writes each AMQP frame with a send of its own (method, header, body: three per
    message). The publisher joins what one publish buffered and writes it at once: one
    send for a lone message, one per 256 KiB for a batch (a send the socket took only in
    part is continued by the next, not counted). Counts the sends on the live connection."""
    mq.publish(f"{token}.warm", b"w")  # the publisher's connection is open from here on
    transport: Any = mq._driver._pub.conn._impl._transport  # type: ignore[attr-defined]
    real = transport._sigint_safe_send
    sends: list[tuple[int, int]] = []  # (bytes offered, bytes taken)

    def send(sock: Any, data: bytes) -> int:
        taken: int = real(sock, data)
        sends.append((len(data), taken))
        return taken

    transport._sigint_safe_send = send
    try:
        if n == 1:
            mq.publish(f"{token}.one", b"x" * 100)
        else:
            mq.publish_batch([(f"{token}.many", b"x" * 100)] * n)
    finally:
        del transport._sigint_safe_send
    chunks = [offered for (offered, _), before in zip(sends, [(0, 0), *sends[:-1]], strict=True)
              if before[0] == before[1]]  # not the rest of a partial send
    total = sum(chunks)
    assert total > 100 * n
    assert len(chunks) == 1 + total // (1 << 18), sends
