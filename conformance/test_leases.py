"""The lease rule: a settle at or after the deadline never reaches the broker.

The deadline of a received message is the start of the ``receive`` call plus the group's
lease, renewed by ``extend``. Every backend keeps it the same way because the portable
layer enforces it: ``ack``/``nack``/``dead_letter``/``extend`` then raise ``LeaseExpired``
and the message comes back with attempt + 1; just before it they take effect.
"""

from __future__ import annotations

import time

import pytest

import mqabstract
from mqabstract import Feature, Message

from .harness import Ctx

OPS = ("ack", "nack", "dead_letter", "extend")
_NEEDS = {"dead_letter": Feature.DEAD_LETTER, "extend": Feature.LEASE_EXTEND}


def _apply(msg: Message, op: str, lease: float) -> None:
    if op == "extend":
        msg.extend(lease * 2)
    elif op == "dead_letter":
        msg.dead_letter("conformance: settled near the deadline")
    else:
        getattr(msg, op)()


def _received(mq_ctx: Ctx, op: str) -> tuple[mqabstract.Subscription, str, Message]:
    if op in _NEEDS:
        mq_ctx.require(_NEEDS[op])
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=mq_ctx.lease)
    mid = mq_ctx.broker.publish(mq_ctx.topic("l"), b"leased")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    assert msg.id == mid
    assert 0 < msg.lease_remaining <= mq_ctx.lease
    return sub, mid, msg


def test_settle_after_deadline_raises_lease_expired(mq_ctx: Ctx) -> None:
    """Every settle of ``OPS`` the backend supports, each on its own message, once the
    lease has passed: ``LeaseExpired`` (twice: it never reaches the broker), and each
    message comes back with attempt 2. (The ops share one subscription and one lease
    wait: the late settles never reach the broker, so they cannot disturb each other.)"""
    ops = [op for op in OPS if op not in _NEEDS or mq_ctx.caps.supports(_NEEDS[op])]
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=mq_ctx.lease)
    op_of = {mq_ctx.broker.publish(mq_ctx.topic("l"), op.encode()): op for op in ops}
    got = mq_ctx.drain(sub, len(ops), ack=False)
    assert sorted(m.id for m in got) == sorted(op_of)
    assert all(0 < m.lease_remaining <= mq_ctx.lease for m in got)
    time.sleep(max(m.lease_remaining for m in got) + 0.05)
    wrong: dict[str, str] = {}
    for msg in got:
        op = op_of[msg.id]
        for time_ in ("first", "second"):  # and again: it never reaches the broker
            try:
                _apply(msg, op, mq_ctx.lease)
            except mqabstract.LeaseExpired as exc:
                if exc.retryable:
                    wrong[op] = f"{time_} LeaseExpired is retryable"
            except Exception as exc:
                wrong[op] = f"{time_} settle raised {type(exc).__name__}: {exc}"
            else:
                wrong[op] = f"{time_} settle after the deadline took effect"
        if msg.settled:
            wrong.setdefault(op, "the message counts as settled")
    assert not wrong, wrong
    again = mq_ctx.drain(sub, len(ops), ack=False)
    assert sorted((m.id, m.attempt) for m in again) == sorted((mid, 2) for mid in op_of)
    for msg in again:
        msg.ack()
    mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)
    if mq_ctx.caps.supports(Feature.DEAD_LETTER):
        assert not mq_ctx.broker.dead_letters(sub.group)


@pytest.mark.parametrize("op", OPS)
def test_settle_just_before_deadline_takes_effect(mq_ctx: Ctx, op: str) -> None:
    sub, mid, msg = _received(mq_ctx, op)
    margin = 0.4 * mq_ctx.scale
    time.sleep(max(0.0, msg.lease_remaining - margin))
    _apply(msg, op, mq_ctx.lease)
    if op == "ack":
        mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)
    elif op == "nack":
        [again] = mq_ctx.drain(sub, 1)
        assert (again.id, again.attempt) == (mid, 2)
    elif op == "dead_letter":
        mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)
        [dead] = mq_ctx.broker.dead_letters(sub.group)
        assert (dead.id, dead.attempts) == (mid, 1)
    else:  # extended by two leases: still ours one lease later, and the ack counts
        assert not sub.receive(1, mq_ctx.lease)
        assert msg.lease_remaining > 0
        msg.ack()
        mq_ctx.expect_none(sub, mq_ctx.lease + mq_ctx.quiet)


def test_lease_below_the_backend_minimum_is_rejected(mq_ctx: Ctx) -> None:
    minimum = mq_ctx.caps.min_lease
    assert 0 < minimum <= mq_ctx.lease
    for bad in (1e-9, minimum / 2):
        with pytest.raises(mqabstract.InvalidArgument, match="minimum lease"):
            mq_ctx.broker.subscribe(mq_ctx.group("short"), mq_ctx.pattern("#"), lease=bad)
