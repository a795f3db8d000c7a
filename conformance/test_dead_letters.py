"""Dead letters: after max attempts, explicit, list / replay / purge."""

from __future__ import annotations

import time

import pytest

import mqabstract
from mqabstract import Feature

from .harness import RELEASE_SLACK, Ctx


@pytest.fixture(autouse=True)
def _needs_dead_letters(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.DEAD_LETTER)


def test_dead_letter_after_max_attempts_by_nack(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), max_attempts=2)
    mid = mq_ctx.broker.publish(mq_ctx.topic("x"), b"poison", headers={"h": "1"}, key="k")
    for attempt in (1, 2):
        [msg] = mq_ctx.drain(sub, 1, ack=False)
        assert msg.attempt == attempt
        msg.nack()
    mq_ctx.expect_none(sub)
    [dead] = mq_ctx.broker.dead_letters(sub.group)
    assert (dead.id, dead.body, dead.attempts) == (mid, b"poison", 2)
    assert dead.headers.get("h") == "1" and dead.key == "k" and dead.topic == mq_ctx.topic("x")
    assert dead.reason
    stats = mq_ctx.broker.stats(sub.group)
    assert stats.dead in (None, 1)


def test_dead_letter_after_max_attempts_by_lease_expiry(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), max_attempts=1, lease=mq_ctx.lease)
    mid = mq_ctx.broker.publish(mq_ctx.topic("x"), b"slow")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    assert msg.attempt == 1
    ends = time.monotonic() + msg.lease_remaining
    mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)
    # The exhausted message is dead-lettered by the receive its redelivery reaches (the
    # portable layer's decision), and the backend owes that redelivery only within the
    # lease + its release_margin (the lease rule): keep a receive open, with nothing
    # delivered, until the dead letter is listed or that bound has passed.
    dead = mq_ctx.broker.dead_letters(sub.group)
    while not dead and time.monotonic() < ends + mq_ctx.caps.release_margin + RELEASE_SLACK:
        mq_ctx.expect_none(sub, mq_ctx.quiet / 3)
        dead = mq_ctx.broker.dead_letters(sub.group)
    assert [d.id for d in dead] == [mid] and dead[0].attempts == 1


def test_explicit_dead_letter_with_reason(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    mid = mq_ctx.broker.publish(mq_ctx.topic("x"), {"bad": True})
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    msg.dead_letter("schema mismatch: field x")
    msg.dead_letter("again")  # same outcome twice: no-op
    with pytest.raises(mqabstract.AlreadySettled):
        msg.ack()
    mq_ctx.expect_none(sub)
    [dead] = mq_ctx.broker.dead_letters(sub.group)
    assert dead.id == mid and dead.reason == "schema mismatch: field x"
    assert dead.attempts == 1 and dead.value == {"bad": True}


def test_replay_and_purge(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    ids = [mq_ctx.broker.publish(mq_ctx.topic("x"), f"{i}".encode()) for i in range(4)]
    for msg in mq_ctx.drain(sub, 4, ack=False):
        msg.dead_letter(f"reason {msg.body.decode()}")
    listed = mq_ctx.broker.dead_letters(sub.group)
    assert sorted(d.id for d in listed) == sorted(ids)
    assert len(mq_ctx.broker.dead_letters(sub.group, limit=2)) == 2
    # Replay one by id: delivered again as a fresh message (attempt 1), same id and body.
    assert mq_ctx.broker.replay_dead_letters(sub.group, [ids[0]]) == 1
    [back] = mq_ctx.drain(sub, 1)
    assert (back.id, back.body, back.attempt) == (ids[0], b"0", 1)
    # Purge one by id, then replay the rest.
    assert mq_ctx.broker.purge_dead_letters(sub.group, [ids[1]]) == 1
    assert sorted(d.id for d in mq_ctx.broker.dead_letters(sub.group)) == sorted(ids[2:])
    assert mq_ctx.broker.replay_dead_letters(sub.group) == 2
    assert sorted(m.id for m in mq_ctx.drain(sub, 2)) == sorted(ids[2:])
    assert mq_ctx.broker.dead_letters(sub.group) == []
    # Purge all.
    mid = mq_ctx.broker.publish(mq_ctx.topic("x"), b"z")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    msg.dead_letter("z")
    assert [d.id for d in mq_ctx.broker.dead_letters(sub.group)] == [mid]
    assert mq_ctx.broker.purge_dead_letters(sub.group) == 1
    assert mq_ctx.broker.dead_letters(sub.group) == []
    mq_ctx.expect_none(sub)


def test_dead_letters_are_per_group(mq_ctx: Ctx) -> None:
    a = mq_ctx.subscribe("a", mq_ctx.pattern("#"))
    b = mq_ctx.subscribe("b", mq_ctx.pattern("#"))
    mid = mq_ctx.broker.publish(mq_ctx.topic("x"), b"x")
    [ma] = mq_ctx.drain(a, 1, ack=False)
    ma.dead_letter("only in a")
    [mb] = mq_ctx.drain(b, 1)
    assert mb.id == mid
    assert [d.id for d in mq_ctx.broker.dead_letters(a.group)] == [mid]
    assert mq_ctx.broker.dead_letters(b.group) == []
    assert mq_ctx.broker.replay_dead_letters(a.group) == 1
    mq_ctx.expect_none(b)  # replay goes to the group, not to the topic
    assert [m.id for m in mq_ctx.drain(a, 1)] == [mid]
