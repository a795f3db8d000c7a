"""Delivery: ack, nack, redelivery, leases, delays, priority, order, close, crashes."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timedelta, timezone

import pytest

import mqabstract
from mqabstract import Backoff, Feature

from .harness import RELEASE_SLACK, Ctx


def test_ack_removes_message(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=mq_ctx.lease)
    mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    [msg] = mq_ctx.drain(sub, 1)
    assert msg.settled
    mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)


def test_nack_redelivers_with_next_attempt(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    mid = mq_ctx.broker.publish(mq_ctx.topic("a"), b"x", headers={"h": "v"})
    [first] = mq_ctx.drain(sub, 1, ack=False)
    first.nack()
    [second] = mq_ctx.drain(sub, 1, ack=False)
    assert (second.id, second.attempt, second.body) == (mid, 2, b"x")
    assert second.headers.get("h") == "v"
    second.nack()
    [third] = mq_ctx.drain(sub, 1)
    assert third.attempt == 3 and third.id == mid


def test_double_ack_is_noop_and_conflicting_settle_raises(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    msg.ack()
    msg.ack()
    with pytest.raises(mqabstract.AlreadySettled):
        msg.nack()
    with pytest.raises(mqabstract.AlreadySettled):
        msg.extend(5)
    mq_ctx.expect_none(sub)


def test_ack_many(mq_ctx: Ctx) -> None:
    """One call acks many; an invalid member of the batch stops it before any ack."""
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=mq_ctx.lease)
    ids = mq_ctx.broker.publish_batch([(mq_ctx.topic("a"), f"m{i}".encode())
                                       for i in range(6)])
    msgs = mq_ctx.drain(sub, 6, ack=False)
    assert sorted(m.id for m in msgs) == sorted(ids)
    msgs[5].nack()
    with pytest.raises(mqabstract.AlreadySettled):
        sub.ack_many(msgs)
    assert not any(m.settled for m in msgs[:5])
    sub.ack_many(msgs[:3])
    sub.ack_many(msgs[:5])  # the first three again: no-ops
    assert all(m.settled for m in msgs)
    [again] = mq_ctx.drain(sub, 1, ack=False)  # only the nacked one comes back
    assert (again.id, again.attempt) == (msgs[5].id, 2)
    sub.ack_many(iter([again]))
    mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)


def test_lease_expiry_redelivers(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=mq_ctx.lease)
    mid = mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    leased_at = time.monotonic()
    # Not before the lease expires...
    early = sub.receive(1, mq_ctx.lease * 0.5)
    assert not early, f"redelivered before the lease expired: {early}"
    # ...but after it, with attempt + 1.
    [again] = mq_ctx.drain(sub, 1, ack=False)
    # One more than the delivery we saw (not 2: a receive that returned after its 2 s
    # lease on a loaded machine is a delivery nobody saw, and counted, as the lease rule
    # says; CI's moto once took that long).
    assert again.id == mid and again.attempt == msg.attempt + 1
    assert time.monotonic() - leased_at >= mq_ctx.lease * 0.9
    again.ack()
    with pytest.raises(mqabstract.LeaseExpired):  # the lease rule: never reaches the broker
        msg.ack()
    mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)


def test_extend_keeps_lease(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.LEASE_EXTEND)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=mq_ctx.lease)
    mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    for _ in range(3):
        time.sleep(mq_ctx.lease * 0.5)
        msg.extend(mq_ctx.lease * 2)
    # 1.5 leases have passed since receive: without extend it would be back by now.
    assert not sub.receive(1, mq_ctx.lease * 0.5)
    msg.ack()
    mq_ctx.expect_none(sub, mq_ctx.lease * 1.5)


def test_extend_rejects_bad_values(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.LEASE_EXTEND)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    for bad in (0, -1, float("inf"), mq_ctx.caps.max_lease + 1):
        with pytest.raises(mqabstract.InvalidArgument):
            msg.extend(bad)
    msg.ack()


def test_delay_not_delivered_before_time(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.DELAY)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    sent = time.time()
    slow = mq_ctx.broker.publish(mq_ctx.topic("d"), b"slow", delay=mq_ctx.delay * 2)
    fast = mq_ctx.broker.publish(mq_ctx.topic("d"), b"fast", delay=mq_ctx.delay)
    now = mq_ctx.broker.publish(mq_ctx.topic("d"), b"now")
    [first] = mq_ctx.drain(sub, 1)
    assert first.id == now
    [second] = mq_ctx.drain(sub, 1)
    assert second.id == fast and time.time() - sent >= mq_ctx.delay - 0.05
    [third] = mq_ctx.drain(sub, 1)
    assert third.id == slow and time.time() - sent >= mq_ctx.delay * 2 - 0.05
    # A short delay never waits behind a long one.
    assert time.time() - sent < mq_ctx.delay * 2 + mq_ctx.wait


def test_deliver_at(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.DELAY)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    when = datetime.now(timezone.utc) + timedelta(seconds=mq_ctx.delay)
    mid = mq_ctx.broker.publish(mq_ctx.topic("d"), b"x", deliver_at=when)
    past = mq_ctx.broker.publish(mq_ctx.topic("d"), b"p", deliver_at=when - timedelta(hours=1))
    [first] = mq_ctx.drain(sub, 1)
    assert first.id == past
    [msg] = mq_ctx.drain(sub, 1)
    assert msg.id == mid
    assert datetime.now(timezone.utc) >= when - timedelta(milliseconds=50)


def test_nack_with_delay(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.NACK_DELAY)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    nacked = time.monotonic()
    msg.nack(delay=mq_ctx.delay)
    [again] = mq_ctx.drain(sub, 1)
    assert again.attempt == 2
    assert time.monotonic() - nacked >= mq_ctx.delay - 0.05


def test_priority_highest_first(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.PRIORITY)
    group = mq_ctx.declare("g", mq_ctx.pattern("#"), priority=True)
    for prio in (0, 3, 9, 1, 5, 9, 0):
        mq_ctx.broker.publish(mq_ctx.topic("p"), str(prio).encode(), priority=prio)
    time.sleep(0.5 * mq_ctx.scale)  # let every message be enqueued before the first receive
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), priority=True)
    assert sub.group == group
    got = [m.priority for m in mq_ctx.drain(sub, 7)]
    assert got == sorted(got, reverse=True) and len(got) == 7, got


def test_per_key_order(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.ORDERING)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), ordered=True)
    n = 30
    mq_ctx.broker.publish_batch(
        [{"topic": mq_ctx.topic("o"), "body": f"{k}:{i}", "key": k}
         for i in range(n) for k in ("a", "b", "c")]
    )
    for i in range(n // 2):
        mq_ctx.broker.publish(mq_ctx.topic("o"), f"d:{i}", key="d")
    got = mq_ctx.drain(sub, 3 * n + n // 2)
    seqs: dict[str, list[int]] = {}
    for m in got:
        key, _, seq = m.value.partition(":")
        assert m.key == key
        seqs.setdefault(key, []).append(int(seq))
    for key, seq in seqs.items():
        assert seq == sorted(seq), f"key {key} out of order: {seq}"
    assert {k: len(v) for k, v in seqs.items()} == {"a": n, "b": n, "c": n, "d": n // 2}


def test_ordered_key_one_at_a_time_across_consumers(mq_ctx: Ctx) -> None:
    """Two consumers of one ordered group: a key's next message goes to neither while an
    earlier one is leased; after that one's ack it goes out (to either); after a
    nack(delay) the nacked one comes again before the key's later ones."""
    mq_ctx.require(Feature.ORDERING, Feature.NACK_DELAY)
    pattern, topic = mq_ctx.pattern("#"), mq_ctx.topic("o")
    lease = max(10.0 * mq_ctx.scale, mq_ctx.caps.min_lease)  # outlasts the quiet windows
    subs = (mq_ctx.subscribe("g", pattern, ordered=True, lease=lease),
            mq_ctx.subscribe("g", pattern, ordered=True, lease=lease,
                             broker=mq_ctx.connect()))
    # Both consumers in the group before the scenario (Kafka assigns partitions to the
    # members it knows, and a rebalance redelivers what was not committed): messages of
    # other keys, drained by both until all came and a quiet second passed.
    warm = 16
    mq_ctx.broker.publish_batch([{"topic": mq_ctx.topic("w"), "body": "w", "key": f"w{i}"}
                                 for i in range(warm)])
    seen: set[str] = set()
    deadline, quiet_until = time.monotonic() + mq_ctx.wait, math.inf
    while time.monotonic() < min(deadline, quiet_until):
        for sub in subs:
            batch = sub.receive(warm, 0.2)
            with contextlib.suppress(mqabstract.LeaseExpired):  # moved by a rebalance
                sub.ack_many(batch)
            seen.update(m.id for m in batch)
            if batch:
                quiet_until = time.monotonic() + 1.0 if len(seen) == warm else math.inf
    assert len(seen) == warm, f"warm-up: {len(seen)} of {warm}"

    for i in (1, 2, 3):
        mq_ctx.broker.publish(topic, str(i), key="k")

    def take(within: float) -> tuple[mqabstract.Subscription, mqabstract.Message]:
        """The next message of the key, from whichever consumer gets it."""
        until = time.monotonic() + within
        while time.monotonic() < until:
            for sub in subs:
                batch = sub.receive(10, 0.2)
                if batch:
                    assert len(batch) == 1, [m.value for m in batch]
                    return sub, batch[0]
        raise AssertionError("no message of the key arrived")

    def other(holder: mqabstract.Subscription) -> mqabstract.Subscription:
        return subs[1] if holder is subs[0] else subs[0]

    def nothing_while(holder: mqabstract.Subscription, held: mqabstract.Message) -> None:
        # the holder idles meanwhile (RabbitMQ: an idle consumer gives up its turn)
        for sub in (other(holder), holder):
            got = sub.receive(10, mq_ctx.quiet)
            assert not got, (f"{[m.value for m in got]} delivered while {held.value} "
                             f"(attempt {held.attempt}) is leased")
        assert held.lease_remaining > 0

    holder, first = take(mq_ctx.wait)
    assert (first.value, first.attempt) == ("1", 1)
    nothing_while(holder, first)
    first.ack()
    holder, second = take(mq_ctx.wait)
    assert (second.value, second.attempt) == ("2", 1)
    second.nack(delay=mq_ctx.delay)
    # The holder idles through the delay; the other consumer may get "2" again, never "3".
    early = other(holder).receive(10, mq_ctx.delay + mq_ctx.quiet)
    assert [m.value for m in early] in ([], ["2"]), [m.value for m in early]
    holder, again = (other(holder), early[0]) if early else take(mq_ctx.wait)
    assert (again.value, again.attempt) == ("2", 2)
    nothing_while(holder, again)
    again.ack()
    _, third = take(mq_ctx.wait)
    # (attempt 2 where the broker keeps a key behind any of its messages that is out, SQS
    # FIFO, and the other consumer gets it: "3" was received beside "2" and handed back
    # with it, and the broker counted that receive: Capabilities.key_gate)
    assert third.value == "3" and third.attempt <= 2, (third.value, third.attempt)
    third.ack()


def test_use_after_close_raises(mq_ctx: Ctx) -> None:
    broker = mq_ctx.connect()
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), broker=broker)
    broker.publish(mq_ctx.topic("a"), b"x")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    sub.close()
    sub.close()  # idempotent
    with pytest.raises(mqabstract.Closed):
        sub.receive()
    with pytest.raises(mqabstract.Closed):
        msg.ack()
    broker.close()
    broker.close()
    assert broker.closed
    with pytest.raises(mqabstract.Closed):
        broker.publish(mq_ctx.topic("a"), b"x")
    with pytest.raises(mqabstract.Closed):
        broker.subscribe(mq_ctx.group("g2"), mq_ctx.pattern("#"))
    with pytest.raises(mqabstract.Closed):
        broker.publish_batch([(mq_ctx.topic("a"), b"x")])


def test_close_releases_unsettled_and_keeps_published(mq_ctx: Ctx) -> None:
    broker = mq_ctx.connect()
    pattern = mq_ctx.pattern("#")
    sub = mq_ctx.subscribe("g", pattern, broker=broker, lease=60.0)
    with broker:
        ids = [broker.publish(mq_ctx.topic("a"), f"{i}".encode()) for i in range(3)]
        held = mq_ctx.drain(sub, 3, ack=False)
        assert len(held) == 3
    assert sub.closed
    # Closed consumer's messages come back long before their 60 s lease.
    other = mq_ctx.subscribe("g", pattern, lease=60.0)
    again = mq_ctx.drain(other, 3)
    assert sorted(m.id for m in again) == sorted(ids)
    # The release counts as a delivery. Exactly attempt 2 is the aim; RabbitMQ rarely
    # over-counts one (a known gap, docs/backends/rabbitmq.md), so only "counted" is required.
    assert all(m.attempt >= 2 for m in again), [m.attempt for m in again]


def test_abandoned_consumer_message_comes_back(mq_ctx: Ctx) -> None:
    """A consumer that hangs without settling: the lease returns its message, to another
    consumer, after the lease ends and within the backend's declared ``release_margin``."""
    broker = mq_ctx.connect()
    pattern = mq_ctx.pattern("#")
    hung = mq_ctx.subscribe("g", pattern, broker=broker, lease=mq_ctx.lease)
    live = mq_ctx.subscribe("g", pattern, lease=mq_ctx.lease)
    mid = mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    deadline = time.monotonic() + mq_ctx.wait
    taken = []
    while not taken and time.monotonic() < deadline:
        taken = hung.receive(1, 0.5)
    assert taken and taken[0].id == mid
    ends = time.monotonic() + taken[0].lease_remaining  # no later than the lease's end
    [back] = mq_ctx.drain(live, 1)  # the hung consumer never settles
    came = time.monotonic()
    # The delivery after the hung one's (which is attempt 2 when its first receive came
    # back after the lease: SQS on CI's loaded moto, a counted delivery nobody saw).
    assert back.id == mid and back.attempt == taken[0].attempt + 1
    margin = mq_ctx.caps.release_margin
    assert came <= ends + margin + RELEASE_SLACK, (
        f"the abandoned message came back {came - ends:.2f}s after the lease ended; "
        f"{mq_ctx.broker.backend} declares release_margin={margin}s")


_CRASHER = textwrap.dedent(
    """
    import os, signal, sys
    import mqabstract
    url, group, pattern, lease = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    broker = mqabstract.connect(url)
    sub = broker.subscribe(group, pattern, lease=lease)
    for _ in range(120):
        got = sub.receive(1, 0.5)
        if got:
            print("GOT", got[0].id, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    print("NOTHING", flush=True)
    """
)


def test_killed_consumer_message_comes_back(mq_ctx: Ctx) -> None:
    if not mq_ctx.caps.shared_between_processes:
        pytest.skip(f"{mq_ctx.broker.backend} is process-local (see the abandoned-consumer test)")
    pattern = mq_ctx.pattern("#")
    group = mq_ctx.declare("g", pattern, lease=mq_ctx.lease)
    mid = mq_ctx.broker.publish(mq_ctx.topic("a"), b"x")
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHER, mq_ctx.url, group, pattern, str(mq_ctx.lease)],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    assert f"GOT {mid}" in proc.stdout
    sub = mq_ctx.subscribe("g", pattern, lease=mq_ctx.lease)
    [back] = mq_ctx.drain(sub, 1)
    assert back.id == mid and back.attempt >= 2


def test_consume_loop_acks_retries_and_dead_letters(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), max_attempts=3)
    ok = [mq_ctx.broker.publish(mq_ctx.topic("c"), {"n": i, "fail": False}) for i in range(5)]
    bad = mq_ctx.broker.publish(mq_ctx.topic("c"), {"n": 99, "fail": True})
    seen: list[tuple[str, int]] = []

    def handler(msg: mqabstract.Message) -> None:
        seen.append((msg.id, msg.attempt))
        if msg.value["fail"]:
            raise ValueError("poison")

    stats = sub.consume(
        handler,
        max_messages=8,
        idle_timeout=mq_ctx.wait,
        backoff=Backoff(initial=0.2, maximum=1.0, jitter=0),
    )
    assert stats.acked == 5 and stats.retried == 2 and stats.dead_lettered == 1, stats
    assert [a for i, a in seen if i == bad] == [1, 2, 3]
    assert {i for i, _ in seen} == {*ok, bad}
    if mq_ctx.caps.supports(Feature.DEAD_LETTER):
        dead = mq_ctx.broker.dead_letters(sub.group)
        assert [d.id for d in dead] == [bad]
        assert "ValueError: poison" in dead[0].reason and dead[0].attempts == 3
    mq_ctx.expect_none(sub)
