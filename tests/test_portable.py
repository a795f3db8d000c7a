"""The portable layer over the memory reference, with a fake clock (no long sleeps)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import mqabstract
from mqabstract import Backoff, FakeClock, Feature, OutgoingMessage, Support
from mqabstract.backends.memory import MemoryDriver
from mqabstract.errors import ConnectionFailed, NotSent, PublishError
from mqabstract.model import Envelope
from mqabstract.options import CLOCK, Option, parse_options
from mqabstract.url import BrokerURL


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mq(clock: FakeClock) -> mqabstract.Broker:
    broker = mqabstract.connect(f"memory://unit-{uuid.uuid4().hex}", clock=clock)
    yield broker
    broker.close()


def test_lease_expiry_and_extend_on_fake_clock(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=30)
    mq.publish("a.b", b"x")
    [m] = sub.receive(1, 0)
    clock.advance(29)
    assert sub.receive(1, 0) == []
    m.extend(60)
    clock.advance(59)
    assert sub.receive(1, 0) == []
    clock.advance(2)
    [again] = sub.receive(1, 0)
    assert again.id == m.id and again.attempt == 2
    with pytest.raises(mqabstract.LeaseExpired):  # stale: never reaches the driver
        m.ack()
    again.ack()
    clock.advance(3600)
    assert sub.receive(1, 0) == []


@pytest.mark.parametrize("op", ["ack", "nack", "ack_many", "extend"])
def test_a_settle_after_the_deadline_waits_for_an_extend_in_flight(
        mq: mqabstract.Broker, clock: FakeClock, op: str) -> None:
    """An extend admitted before the deadline whose driver call ends after it takes
    effect; a settle on another thread judged late meanwhile must wait for its outcome,
    not be refused while the broker holds the message for the new lease (it would come
    back a whole extension late, after the caller was told it comes again)."""
    sub = mq.subscribe("g", "a.#", lease=30)
    mq.publish("a.b", b"x")
    [m] = sub.receive(1, 0)
    inner = sub._inner  # type: ignore[attr-defined]
    real, entered, go = inner.extend, threading.Event(), threading.Event()

    def slow(receipt: Any, seconds: float) -> None:
        entered.set()
        go.wait(30)
        real(receipt, seconds)

    inner.extend = slow
    extender = threading.Thread(target=m.extend, args=(60,))
    extender.start()
    assert entered.wait(30)
    clock.advance(31)  # past the deadline while the extend is in flight
    inner.extend = real
    errors: list[BaseException] = []

    def settle() -> None:
        try:
            if op == "ack_many":
                sub.ack_many([m])
            elif op == "extend":
                m.extend(60)
            else:
                getattr(m, op)()
        except BaseException as exc:  # (asserted below)
            errors.append(exc)

    settler = threading.Thread(target=settle)
    settler.start()
    try:
        settler.join(0.3)
        assert settler.is_alive() and not errors, errors  # waiting for the extend
    finally:
        go.set()
    extender.join(30)
    settler.join(30)
    assert not errors, errors
    if op == "extend":
        m.ack()
    if op == "nack":
        [again] = sub.receive(1, 0)
        assert (again.id, again.attempt) == (m.id, 2)
        again.ack()
    clock.advance(3600)
    assert sub.receive(1, 0) == []


def test_messages_returned_after_their_lease_ended_are_not_handed_out(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    """A driver call that outlasts the lease (here the clock jumps 31 s while the receive
    waits) returns messages nobody could settle: they are not handed out, and come back
    with the next attempt once the backend's own lease on them ends."""
    sub = mq.subscribe("g", "a.#", lease=30)
    got: list[mqabstract.Message] = []
    calling = threading.Event()

    def receive() -> None:
        calling.set()
        got.extend(sub.receive(1, 3.0))

    waiter = threading.Thread(target=receive)
    waiter.start()
    calling.wait()
    time.sleep(0.3)  # inside the driver's receive, its lease deadline taken
    clock.advance(31)
    mq.publish("a.b", b"x")
    waiter.join()
    assert got == []
    clock.advance(31)
    [m] = sub.receive(1, 0)
    assert m.attempt == 2
    m.ack()


def test_a_late_receive_tells_middleware_its_messages_expired(clock: FakeClock) -> None:
    """A batch a driver call returned after its lease ended is handed to nobody, yet each
    of its messages was a counted delivery: middleware hears of them as ``expired`` (what
    telemetry counts and the reliability suite records as deliveries nobody saw)."""
    heard: list[tuple[str, str, int]] = []

    class Listen(mqabstract.Middleware):
        def settled(self, sub: object, op: str, messages: Any, started_ns: int,
                    error: object) -> None:
            heard.extend((op, m.id, m.attempt) for m in messages)

    with mqabstract.connect(f"memory://late-{uuid.uuid4().hex}", clock=clock,
                            middleware=[Listen()]) as mq:
        sub = mq.subscribe("g", "a.#", lease=30)
        mid = mq.publish("a.b", b"x")
        inner = sub._inner  # type: ignore[attr-defined]
        real_receive = inner.receive

        def slow_receive(n: int, wait: float) -> list[object]:
            got = real_receive(n, wait)
            clock.advance(31)  # the driver call outlasted the lease
            return got

        inner.receive = slow_receive
        assert sub.receive(1, 0) == []
        assert heard == [("expired", mid, 1)]
        inner.receive = real_receive
        [msg] = sub.receive(1, 0)
        assert msg.attempt == 2  # the unseen delivery counted
        msg.ack()


@pytest.mark.parametrize("what", ["exhausted", "ttl-ended"])
def test_a_late_receive_settles_nothing(mq: mqabstract.Broker, clock: FakeClock,
                                        what: str) -> None:
    """The portable layer's own settles (dead-lettering a message past max_attempts or
    past its TTL) are settles too: from a receive that returned after the lease ended they
    must not reach the driver (on SQS such a late dead-lettering moved a message twice).
    A timely receive settles them later."""
    sub = mq.subscribe("g", "a.#", lease=30, max_attempts=1 if what == "exhausted" else 5)
    mq.publish("a.b", b"x", **({"ttl": 10} if what == "ttl-ended" else {}))
    if what == "exhausted":
        [_held] = sub.receive(1, 0)  # attempt 1 of 1, never settled
        clock.advance(31)
    else:
        clock.advance(11)
    inner = sub._inner  # type: ignore[attr-defined]
    real_receive, settled = inner.receive, []

    def slow_receive(n: int, wait: float) -> list[object]:
        got = real_receive(n, wait)
        clock.advance(31)  # the driver call outlasted the lease
        return got

    for op in ("dead_letter", "ack"):
        real = getattr(inner, op)
        setattr(inner, op, lambda *a, _op=op, _real=real: (settled.append(_op), _real(*a))[1])
    inner.receive = slow_receive
    assert sub.receive(1, 0) == []
    assert settled == [] and mq.dead_letters("g") == []
    inner.receive = real_receive
    clock.advance(31)
    assert sub.receive(1, 0) == []  # a timely receive: now it is dead-lettered
    [dl] = mq.dead_letters("g")
    assert dl.reason.startswith("expired" if what == "ttl-ended" else "max attempts")


def test_deliveries_the_lease_ran_out_on_while_others_settled_are_told(
        clock: FakeClock) -> None:
    """Dead-lettering a batch's exhausted messages one by one may use up the lease (a slow
    broker): the exhausted ones after that and the fresh ones of the batch are handed to
    nobody and come again, and middleware hears of each as ``expired``, as of a late batch
    (an SQS chaos run saw dead letters with more attempts than the deliveries it knew of)."""
    heard: list[tuple[str, str, int]] = []

    class Listen(mqabstract.Middleware):
        def settled(self, sub: object, op: str, messages: Any, started_ns: int,
                    error: object) -> None:
            heard.extend((op, m.id, m.attempt) for m in messages)

    with mqabstract.connect(f"memory://slowdl-{uuid.uuid4().hex}", clock=clock,
                            middleware=[Listen()]) as mq:
        sub = mq.subscribe("g", "a.#", lease=30, max_attempts=1)
        old = [mq.publish("a.b", b"old") for _ in range(2)]
        assert len(sub.receive(2, 0)) == 2  # attempt 1 of 1, never settled
        clock.advance(31)
        new = mq.publish("a.b", b"new")
        inner = sub._inner  # type: ignore[attr-defined]
        real = inner.dead_letter

        def slow_dead_letter(*args: Any) -> None:
            real(*args)
            clock.advance(31)  # the first dead-lettering took the rest of the lease

        inner.dead_letter = slow_dead_letter
        assert sub.receive(3, 0) == []
        first, second = old  # the memory reference returns them in publish order
        assert heard == [("dead_letter", first, 2), ("expired", new, 1),
                         ("expired", second, 2)]
        inner.dead_letter = real
        clock.advance(31)
        # Back, the second at attempt 3 and the new one at 2 (its unseen delivery counted):
        # both past max_attempts now, dead-lettered with the deliveries they had.
        assert sub.receive(3, 0) == []
        assert sorted((d.id, d.attempts) for d in mq.dead_letters("g")) == sorted(
            [(first, 1), (second, 2), (new, 1)])


@pytest.mark.parametrize("op", ["ack", "nack", "dead_letter", "extend"])
def test_driver_reported_lost_lease_leaves_the_message_unsettled(
        mq: mqabstract.Broker, op: str) -> None:
    """A driver that learns before the deadline that a lease is gone (connection or
    partition lost) raises LeaseExpired; the message is then expired, not settled."""
    sub = mq.subscribe("g", "a.#", lease=30)
    mq.publish("a.b", b"x")
    [m] = sub.receive(1, 0)
    inner = sub._inner  # type: ignore[attr-defined]

    def lost(*_args: object) -> None:
        raise mqabstract.LeaseExpired("connection lost with the lease")

    setattr(inner, op, lost)
    call = {"ack": m.ack, "nack": m.nack, "dead_letter": m.dead_letter,
            "extend": lambda: m.extend(10)}[op]
    with pytest.raises(mqabstract.LeaseExpired):
        call()
    assert not m.settled
    with pytest.raises(mqabstract.LeaseExpired):  # and stays so: nothing reaches the driver
        m.ack()


def test_ack_many_acks_the_live_and_reports_the_expired(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    """Messages whose lease ran out are not acked (they come again); the rest are."""
    sub = mq.subscribe("g", "a.#", lease=30)
    mq.publish("a.b", b"old")
    [old] = sub.receive(1, 0)
    clock.advance(20)
    for i in range(3):
        mq.publish("a.b", f"new{i}".encode())
    new = sub.receive(3, 0)
    clock.advance(15)  # old's lease is over, the new ones have 15 s left
    with pytest.raises(mqabstract.LeaseExpired, match=old.id):
        sub.ack_many([*new, old])
    assert all(m.settled for m in new) and not old.settled
    sub.ack_many(new)  # acked already: nothing to do
    clock.advance(31)
    [again] = sub.receive(5, 0)
    assert (again.id, again.attempt) == (old.id, 2)
    sub.ack_many([again])
    clock.advance(60)
    assert sub.receive(5, 0) == []


def test_ack_many_checks_every_message_before_acking_any(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "a.#", lease=30)
    other = mq.subscribe("h", "a.#", lease=30)
    mq.publish_batch([("a.b", b"1"), ("a.b", b"2"), ("a.b", b"3")])
    msgs = sub.receive(3, 0)
    [foreign] = other.receive(1, 0)
    msgs[2].nack()
    with pytest.raises(mqabstract.AlreadySettled):
        sub.ack_many(msgs)
    with pytest.raises(mqabstract.InvalidArgument):
        sub.ack_many([msgs[0], foreign])
    assert not msgs[0].settled and not msgs[1].settled
    sub.ack_many(msgs[:2])
    assert msgs[0].settled and msgs[1].settled


def test_ack_many_marks_only_the_receipts_the_driver_lost(mq: mqabstract.Broker) -> None:
    """A driver reporting some receipts of a batch as lost (``LeaseExpired.receipts``):
    those messages are expired, the others acked."""
    sub = mq.subscribe("g", "a.#", lease=30)
    mq.publish_batch([("a.b", b"1"), ("a.b", b"2")])
    kept, lost = sub.receive(2, 0)
    inner = sub._inner  # type: ignore[attr-defined]
    ack = inner.ack

    def partly(receipts: list[object]) -> None:
        ack([r for r in receipts if r != lost._receipt])  # type: ignore[attr-defined]
        raise mqabstract.LeaseExpired("channel lost", receipts=(lost._receipt,))  # type: ignore[attr-defined]

    inner.ack = partly
    with pytest.raises(mqabstract.LeaseExpired):
        sub.ack_many([kept, lost])
    assert kept.settled and not lost.settled
    with pytest.raises(mqabstract.LeaseExpired):
        lost.ack()


def _held(mq: mqabstract.Broker) -> tuple[mqabstract.Subscription, mqabstract.Message, Any]:
    """A subscription holding one message, and its driver subscription (to break)."""
    sub = mq.subscribe("g", "a.#", lease=30)
    mq.publish("a.b", b"x")
    [m] = sub.receive(1, 0)
    return sub, m, sub._inner  # type: ignore[attr-defined]


def test_failed_ack_leaves_the_message_unsettled(mq: mqabstract.Broker) -> None:
    """An ack the driver failed (not a lost lease) can be tried again."""
    _, m, inner = _held(mq)
    ack = inner.ack

    def down(receipts: list[object]) -> None:
        raise mqabstract.ConnectionFailed("broker away")

    inner.ack = down
    with pytest.raises(mqabstract.ConnectionFailed):
        m.ack()
    assert not m.settled
    inner.ack = ack
    m.ack()
    assert m.settled


@pytest.mark.parametrize("single", [True, False])
def test_a_stray_driver_error_on_ack_is_translated_and_leaves_it_unsettled(
        mq: mqabstract.Broker, single: bool) -> None:
    """``Message.ack`` (its own short path) and ``ack_many`` alike: a driver's stray
    exception comes out as an ``MQError`` and the message can be acked again."""
    sub, m, inner = _held(mq)
    ack = inner.ack

    def broken(receipts: list[object]) -> None:
        raise RuntimeError("driver bug")

    inner.ack = broken
    with pytest.raises(mqabstract.MQError) as caught:
        m.ack() if single else sub.ack_many([m])
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert not m.settled
    inner.ack = ack
    m.ack()
    m.ack()  # a second ack: nothing to do
    assert m.settled and sub.receive(1, 0) == []


@pytest.mark.parametrize("op", ["ack", "nack", "dead_letter", "extend"])
def test_lease_rule_on_fake_clock(mq: mqabstract.Broker, clock: FakeClock, op: str) -> None:
    """At the deadline a settle raises LeaseExpired, even before anyone else received the
    message (the memory reference used to honour it then); a tick before, it counts."""
    sub = mq.subscribe("g", "a.#", lease=30)
    mid = mq.publish("a.b", b"x")
    [m] = sub.receive(1, 0)
    assert m.lease_remaining == 30
    clock.advance(30)  # exactly at the deadline
    call = (lambda: m.extend(10)) if op == "extend" else getattr(m, op)
    with pytest.raises(mqabstract.LeaseExpired):
        call()
    assert not m.settled
    [again] = sub.receive(1, 0)
    assert (again.id, again.attempt) == (mid, 2)
    clock.advance(29.999)
    call = (lambda: again.extend(10)) if op == "extend" else getattr(again, op)
    call()  # just before the deadline: it takes effect
    clock.advance(5)
    if op == "nack":
        [third] = sub.receive(1, 0)
        assert third.attempt == 3
    elif op == "extend":
        assert sub.receive(1, 0) == [] and again.lease_remaining == pytest.approx(5.0)
    else:
        assert sub.receive(1, 0) == []
    assert not mq.dead_letters("g") if op != "dead_letter" else mq.dead_letters("g")


def test_consume_counts_settles_after_the_deadline(
    mq: mqabstract.Broker, clock: FakeClock
) -> None:
    """A handler that outlives its lease: LeaseExpired is counted, not a handler failure."""
    sub = mq.subscribe("g", "#", lease=10)
    mq.publish("t", b"slow")

    def slow(msg: mqabstract.Message) -> None:
        clock.advance(11)

    stats = sub.consume(slow, max_messages=1)
    assert (stats.received, stats.acked, stats.failed, stats.expired) == (1, 0, 0, 1)
    [again] = sub.receive(1, 0)
    assert again.attempt == 2


def test_close_never_releases_an_expired_message(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "#", lease=10)
    other = mq.subscribe("g", "#", lease=10)
    mq.publish("t", b"x")
    [m] = sub.receive(1, 0)
    clock.advance(10)
    [taken] = other.receive(1, 0)  # the lease moved on
    sub.close()  # must not nack the stale copy out from under `other`
    taken.ack()
    clock.advance(60)
    assert other.receive(1, 0) == [] and m.attempt == 1 and taken.attempt == 2


@pytest.mark.parametrize("lease", [1e-9, 0.001, 0.0099])
def test_lease_below_minimum_rejected(mq: mqabstract.Broker, lease: float) -> None:
    assert mq.capabilities.min_lease == 0.01
    with pytest.raises(mqabstract.InvalidArgument, match="minimum lease"):
        mq.subscribe("g", "#", lease=lease)
    sub = mq.subscribe("g", "#", lease=1)
    mq.publish("t", b"x")
    [m] = sub.receive(1, 0)
    with pytest.raises(mqabstract.InvalidArgument, match="minimum lease"):
        m.extend(lease)


def test_delay_deliver_at_and_nack_delay(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "#")
    mq.publish("t", b"later", delay=3600)
    at = datetime.fromtimestamp(clock.time(), timezone.utc) + timedelta(minutes=10)
    mq.publish("t", b"at", deliver_at=at)
    assert sub.receive(10, 0) == []
    clock.advance(600)
    [m] = sub.receive(10, 0)
    assert m.body == b"at"
    m.nack(delay=120)
    clock.advance(119)
    assert sub.receive(10, 0) == []
    clock.advance(1)
    [again] = sub.receive(10, 0)
    assert again.body == b"at" and again.attempt == 2
    again.ack()
    clock.advance(3000)
    assert [x.body for x in sub.receive(10, 0)] == [b"later"]


def test_blocking_receive_wakes_on_publish(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "#")
    threading.Timer(0.2, lambda: mq.publish("t", b"x")).start()
    got = sub.receive(1, 5.0)
    assert [m.body for m in got] == [b"x"]


def test_blocking_receive_wakes_on_clock_advance(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "#", lease=300)  # the jump stays inside the receive's lease
    mq.publish("t", b"x", delay=100)
    threading.Timer(0.2, lambda: clock.advance(100)).start()
    assert [m.body for m in sub.receive(1, 5.0)] == [b"x"]


def test_priority_and_ordered_groups(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "#", ordered=True)
    for i in range(3):
        mq.publish("t", f"a{i}", key="a", priority=i)
    mq.publish("t", "b0", key="b", priority=9)
    first = sub.receive(10, 0)
    # Only the head of each key is deliverable; b0 has the higher priority.
    assert [m.value for m in first] == ["b0", "a0"]
    assert sub.receive(10, 0) == []
    for m in first:
        m.ack()
    assert [m.value for m in sub.receive(10, 0)] == ["a1"]


def test_consume_stats_and_dead_letter(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "#", max_attempts=2)
    mq.publish("t", {"ok": True})
    mq.publish("t", {"ok": False})

    def handler(m: mqabstract.Message) -> None:
        if not m.value["ok"]:
            raise RuntimeError("nope")

    stats = sub.consume(handler, max_messages=2, idle_timeout=0.5,
                        backoff=Backoff(initial=0, jitter=0))
    assert (stats.acked, stats.retried, stats.failed) == (1, 1, 1)
    stats = sub.consume(handler, max_messages=1, idle_timeout=0.5)
    assert stats.dead_lettered == 1
    [dead] = mq.dead_letters("g")
    assert dead.reason == "RuntimeError: nope" and dead.attempts == 2
    assert mq.stats("g").dead == 1


def test_consume_stops_on_event(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "#")
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    stats = sub.consume(lambda m: None, stop=stop, wait=0.1)
    assert stats.received == 0


def test_nack_on_final_attempt_dead_letters(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "#", max_attempts=1)
    mq.publish("t", b"x")
    [m] = sub.receive(1, 0)
    m.nack()
    assert sub.receive(1, 0) == []
    assert "final attempt" in mq.dead_letters("g")[0].reason


def test_redeclare_with_other_pattern_rejected(mq: mqabstract.Broker) -> None:
    mq.declare("g", "a.#")
    mq.declare("g", "a.#", lease=5)
    with pytest.raises(mqabstract.InvalidArgument):
        mq.declare("g", "b.#")


def test_unknown_group_is_not_found(mq: mqabstract.Broker) -> None:
    with pytest.raises(mqabstract.NotFound):
        mq.dead_letters("missing")
    with pytest.raises(mqabstract.NotFound):
        mq.delete_group("missing")


def test_receive_argument_checks(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "#")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(mqabstract.InvalidArgument):
            sub.receive(bad)  # type: ignore[arg-type]
    with pytest.raises(mqabstract.InvalidArgument):
        sub.receive(1, -1)


# -- a driver that confirms only part of a batch, to check PublishError bookkeeping --------
class _Flaky(MemoryDriver):
    name = "flaky"
    CAPABILITIES = MemoryDriver.CAPABILITIES.with_features()
    calls = 0

    @property
    def capabilities(self) -> mqabstract.Capabilities:
        from dataclasses import replace

        return replace(self.CAPABILITIES, max_batch=4)

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        type(self).calls += 1
        if type(self).calls == 2:
            raise ConnectionFailed("flaky: connection dropped")
        super().publish(envelopes)


def test_batch_chunks_and_partial_failure() -> None:
    mqabstract.register("flaky", _Flaky)
    _Flaky.calls = 0
    with mqabstract.connect(f"flaky://{uuid.uuid4().hex}") as mq:
        sub = mq.subscribe("g", "#")
        with pytest.raises(PublishError) as info:
            mq.publish_batch([OutgoingMessage("t", f"{i}") for i in range(10)])
        err = info.value
        assert len(err.published) == 4 and sorted(err.failed) == list(range(4, 10))
        assert err.retryable and isinstance(err.failed[4], ConnectionFailed)
        got = sub.receive(100, 0)
        assert sorted(m.id for m in got) == sorted(err.published)


class _Partial(MemoryDriver):
    """Confirms every other message of its second call (a driver's own PublishError)."""

    name = "partial"
    CAPABILITIES = _Flaky.CAPABILITIES
    capabilities = _Flaky.capabilities
    calls = 0

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        type(self).calls += 1
        if type(self).calls != 2:
            return super().publish(envelopes)
        super().publish(envelopes[::2])
        raise PublishError.from_outcomes(
            [e.id for e in envelopes],
            [None if i % 2 == 0 else ConnectionFailed(f"lost {i}") for i in range(len(envelopes))])


def test_a_driver_partial_failure_is_merged_into_the_batch() -> None:
    mqabstract.register("partial", _Partial)
    _Partial.calls = 0
    with mqabstract.connect(f"partial://{uuid.uuid4().hex}") as mq:
        sub = mq.subscribe("g", "#")
        with pytest.raises(PublishError) as info:
            mq.publish_batch([OutgoingMessage("t", f"{i}") for i in range(10)])
        err = info.value
        assert sorted(err.failed) == [5, 7, 8, 9] and len(err.published) == 6
        assert str(err.failed[5]) == "lost 1" and isinstance(err.failed[8], NotSent)
        assert str(err) == "4 of 10 messages not confirmed: lost 1"
        got = sub.receive(100, 0)
        assert sorted(m.id for m in got) == sorted(err.published)


class _Limited(MemoryDriver):
    name = "limited"
    CAPABILITIES = MemoryDriver.CAPABILITIES.with_features(
        **{f.value: Support.UNSUPPORTED for f in Feature if f not in (Feature.FANOUT,
           Feature.COMPETING, Feature.BATCH)}
    )


def test_unsupported_features_raise_in_portable_layer() -> None:
    mqabstract.register("limited", _Limited)
    with mqabstract.connect(f"limited://{uuid.uuid4().hex}") as mq:
        with pytest.raises(mqabstract.Unsupported, match="limited"):
            mq.subscribe("g", "a.*")
        with pytest.raises(mqabstract.Unsupported):
            mq.subscribe("g", "a", ordered=True)
        with pytest.raises(mqabstract.Unsupported):
            mq.publish("a", b"x", delay=1)
        with pytest.raises(mqabstract.Unsupported):
            mq.publish("a", b"x", priority=1)
        mq.publish("a", b"x", priority=0, delay=0)  # the defaults are always fine
        sub = mq.subscribe("g", "a")
        mq.publish("a", b"x")
        [m] = sub.receive(1, 1)
        with pytest.raises(mqabstract.Unsupported):
            m.nack(delay=1)
        with pytest.raises(mqabstract.Unsupported):
            m.extend(5)
        with pytest.raises(mqabstract.Unsupported):
            m.dead_letter("x")
        with pytest.raises(mqabstract.Unsupported):
            mq.dead_letters("g")
        m.nack()  # plain nack still works


class _Leaky(MemoryDriver):
    name = "leaky"

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        raise RuntimeError("socket error talking to amqp://u:hunter2@h/")


def test_stray_driver_exceptions_are_translated_and_redacted() -> None:
    mqabstract.register("leaky", _Leaky)
    with (
        mqabstract.connect(f"leaky://{uuid.uuid4().hex}") as mq,
        pytest.raises(mqabstract.MQError) as info,
    ):
        mq.publish("t", b"x")
    assert "hunter2" not in str(info.value) and "RuntimeError" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_options_parsing() -> None:
    spec: Mapping[str, Option] = {
        "timeout": Option(float, 5.0), "confirm": Option(bool, True), "name": Option(str, "x"),
        "password": Option(str, None),
    }
    url = BrokerURL.parse("x://h?timeout=2.5&confirm=no")
    assert parse_options(url, {"name": "y"}, spec, "x") == {
        "timeout": 2.5, "confirm": False, "name": "y", "password": None}
    with pytest.raises(mqabstract.InvalidArgument, match=r"unknown x option.*known: confirm"):
        parse_options(url, {"bogus": 1}, spec, "x")
    with pytest.raises(mqabstract.InvalidArgument) as info:
        parse_options(BrokerURL.parse("x://h?password=hunter2&timeout=soon"), {}, spec, "x")
    assert "soon" in str(info.value)
    with pytest.raises(mqabstract.InvalidArgument) as info2:
        parse_options(BrokerURL.parse("x://h"), {"password": 5}, spec, "x")
    assert "5" not in str(info2.value).replace("x://", "")


def test_option_specs_refuse_out_of_range_values_before_anything_connects() -> None:
    spec = {
        "wait": Option(float, 1.0, "seconds", above=0, max=60),
        "count": Option(int, 4, "how many", min=1),
        "mode": Option(str, "full", "full or normal", choices=("full", "normal")),
        "clock": CLOCK,
    }
    url = BrokerURL.parse("x://h")
    fake = FakeClock()
    got = parse_options(url, {"wait": "60", "count": 1, "mode": " NORMAL ", "clock": fake},
                        spec, "x")
    assert got == {"wait": 60.0, "count": 1, "mode": "normal", "clock": fake}
    bad = [({"wait": 0}, r"wait=0.0 must be > 0 and ≤ 60 \(seconds\)"),
           ({"wait": "nan"}, "must be a finite number"), ({"wait": "inf"}, "finite"),
           ({"count": 0}, "count=0 must be ≥ 1"), ({"mode": "fast"}, "one of full, normal"),
           ({"clock": "system"}, "clock='system' is not a valid Clock"),
           ({"clock": object()}, "not a valid Clock")]
    for given, message in bad:
        with pytest.raises(mqabstract.InvalidArgument, match=message):
            parse_options(url, given, spec, "x")
    # Every driver's numeric options go through the same check: a typo'd value is refused
    # before a connection is tried (memory and SQLite need no broker).
    with pytest.raises(mqabstract.InvalidArgument, match=r"poll_max=-1\.0 must be ≥ 0"):
        mqabstract.connect("sqlite:///:memory:?poll_max=-1")
    with pytest.raises(mqabstract.InvalidArgument, match="not a valid Clock"):
        mqabstract.connect("memory://opts", clock="now")


def test_connect_uses_mq_url_then_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("MQ_URL", "memory://from-env")
    with mqabstract.connect() as mq:
        assert mq.url == "memory://from-env"
    monkeypatch.delenv("MQ_URL")
    monkeypatch.setenv("MQ_HOME", str(tmp_path))
    assert mqabstract.default_url() in (f"sqlite:///{tmp_path}/default.db", "memory://")


def test_capabilities_must_declare_every_feature() -> None:
    with pytest.raises(ValueError, match="missing"):
        mqabstract.Capabilities(features={Feature.DELAY: Support.NATIVE}, max_body_bytes=1)


class _NativeFail(MemoryDriver):
    name = "nativefail"

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        try:
            raise OSError("native boom")
        except OSError as exc:
            raise ConnectionFailed("nativefail: broker unreachable") from exc


def test_driver_mqerrors_keep_their_native_cause() -> None:
    mqabstract.register("nativefail", _NativeFail)
    with (
        mqabstract.connect(f"nativefail://{uuid.uuid4().hex}") as mq,
        pytest.raises(ConnectionFailed) as info,
    ):
        mq.publish("t", b"x")
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize("bad", [{"batch": 0}, {"batch": True}, {"max_messages": 0},
                                 {"max_messages": 2.5}])
def test_consume_rejects_bad_counts_before_receiving(mq: mqabstract.Broker,
                                                     bad: dict[str, object]) -> None:
    sub = mq.subscribe("g", "#")
    mid = mq.publish("t", b"x")
    with pytest.raises(mqabstract.InvalidArgument):
        sub.consume(lambda m: None, idle_timeout=0.1, **bad)  # type: ignore[arg-type]
    assert [m.id for m in sub.receive(1)] == [mid]  # nothing was taken
