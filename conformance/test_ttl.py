"""Message TTL: a message whose TTL ended before a group received it is never delivered to
that group; it is dead-lettered with reason ``expired`` (or dropped, ``expired="drop"``).
The check is the portable layer's; these scenarios prove each backend carries
``mq-expires-at`` through and settles the expired copy it handed over."""

from __future__ import annotations

import math
import time

import pytest

import mqabstract
from mqabstract import Feature, Subscription, Support

from .harness import Ctx


@pytest.fixture(autouse=True)
def _needs_ttl(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.TTL)


def test_expired_messages_are_dead_lettered_not_delivered(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.DEAD_LETTER)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    short = mq_ctx.broker.publish(mq_ctx.topic("x"), b"stale", ttl=0.5)
    long = mq_ctx.broker.publish(mq_ctx.topic("x"), b"fresh", ttl=600)
    plain = mq_ctx.broker.publish(mq_ctx.topic("x"), b"plain", headers={"h": "1"})
    time.sleep(1.0)
    got = mq_ctx.drain(sub, 2)
    assert sorted(m.id for m in got) == sorted([long, plain]), got
    fresh = next(m for m in got if m.id == long)
    assert fresh.expires_at is not None and fresh.expires_at > fresh.published_at
    assert "mq-expires-at" not in fresh.headers  # wire metadata, not a user header
    assert next(m for m in got if m.id == plain).expires_at is None
    mq_ctx.expect_none(sub)
    dead = mq_ctx.broker.dead_letters(sub.group)
    assert [(d.id, d.reason, d.attempts) for d in dead] == [(short, "expired", 0)], dead


def test_where_expiry_happens_is_what_the_backend_declares(mq_ctx: Ctx) -> None:
    """NATIVE: the broker moves an expired message to the group's dead letters with no
    consumer receiving; EMULATED: it stays until a receive of the group dead-letters it."""
    mq_ctx.require(Feature.DEAD_LETTER)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    stale = mq_ctx.broker.publish(mq_ctx.topic("x"), b"stale", ttl=0.3)
    time.sleep(0.6)
    if mq_ctx.caps.support(Feature.TTL) is Support.NATIVE:
        deadline = time.monotonic() + mq_ctx.wait
        while not mq_ctx.broker.dead_letters(sub.group) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        assert mq_ctx.broker.dead_letters(sub.group) == []
        _receive_until_dead_lettered(mq_ctx, sub)
    dead = mq_ctx.broker.dead_letters(sub.group)
    assert [(d.id, d.reason, d.attempts) for d in dead] == [(stale, "expired", 0)], dead


def _receive_until_dead_lettered(mq_ctx: Ctx, sub: Subscription) -> None:
    """Receive (nothing may come back: the message expired) until a receive has met the
    expired message and dead-lettered it. One 0.5 s receive assumed the consumer had it
    by then; a loaded kafka-python consumer once had not (a CI rehearsal, session 23),
    and nothing received again, so nothing dead-lettered it."""
    deadline = time.monotonic() + mq_ctx.wait
    while time.monotonic() < deadline:
        mq_ctx.expect_none(sub, 0.2)
        if mq_ctx.broker.dead_letters(sub.group):
            return


def test_a_replayed_expired_message_is_delivered_without_its_ttl(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.DEAD_LETTER)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    stale = mq_ctx.broker.publish(mq_ctx.topic("x"), b"stale", ttl=0.3, headers={"h": "1"})
    time.sleep(0.6)
    _receive_until_dead_lettered(mq_ctx, sub)
    assert mq_ctx.broker.replay_dead_letters(sub.group) == 1
    [msg] = mq_ctx.drain(sub, 1)
    assert (msg.id, msg.body, dict(msg.headers), msg.expires_at) == (
        stale, b"stale", {"h": "1"}, None)
    assert mq_ctx.broker.dead_letters(sub.group) == []


def test_a_group_may_drop_expired_messages(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), expired="drop")
    mq_ctx.broker.publish(mq_ctx.topic("x"), b"stale", ttl=0.5)
    time.sleep(1.0)
    mq_ctx.expect_none(sub)
    if mq_ctx.caps.supports(Feature.DEAD_LETTER):
        assert mq_ctx.broker.dead_letters(sub.group) == []


def test_bad_ttl_is_a_typed_error_and_nothing_is_sent(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    topic = mq_ctx.topic("x")
    for ttl in (0, -1, math.nan, math.inf, "5", True, mq_ctx.caps.max_ttl + 1):
        with pytest.raises(mqabstract.InvalidArgument):
            mq_ctx.broker.publish(topic, b"x", ttl=ttl)  # type: ignore[arg-type]
        with pytest.raises(mqabstract.InvalidArgument):
            mq_ctx.broker.publish_batch([
                mqabstract.OutgoingMessage(topic, b"ok"),
                mqabstract.OutgoingMessage(topic, b"x", ttl=ttl)])  # type: ignore[arg-type]
    if mq_ctx.caps.supports(Feature.DELAY):  # it would expire before it could be delivered
        with pytest.raises(mqabstract.InvalidArgument):
            mq_ctx.broker.publish(topic, b"x", ttl=5, delay=10)
    with pytest.raises(mqabstract.InvalidArgument):
        mq_ctx.subscribe("h", mq_ctx.pattern("#"), expired="later")
    mq_ctx.expect_none(sub, 0.5)
