"""``stats()`` tells the truth: a group left with known numbers of ready, leased, delayed
and dead messages reports exactly those in every count its backend declares
(``Capabilities.stats``; "approximate" ones are given time to settle), None in the others;
``groups()`` lists it where the backend can list groups."""

from __future__ import annotations

import time

import pytest

import mqabstract
from mqabstract import Feature, GroupStats

from .harness import Ctx


def _fits(kind: str, value: int | None, want: int, slack: int) -> bool:
    """An exact count equals ``want``; an approximate one may be off by ``slack`` (an
    emulated delay that sits among the ready messages until a receive moves it)."""
    if value is None:
        return False
    return value == want if kind == "exact" else abs(value - want) <= slack


def _wait_for(ctx: Ctx, group: str, expected: dict[str, int], lag: tuple[int, int],
              slack: int) -> GroupStats:
    """Stats once every declared count fits ``expected`` (or the wait is over)."""
    declared = ctx.caps.stats
    deadline = time.monotonic() + ctx.wait * 2
    while True:
        stats = ctx.broker.stats(group)
        good = all(_fits(declared[name], getattr(stats, name), want, slack)
                   for name, want in expected.items() if name in declared)
        if "lag" in declared:
            good = good and stats.lag is not None and lag[0] <= stats.lag <= lag[1]
        if good or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_stats_count_ready_leased_delayed_and_dead(mq_ctx: Ctx) -> None:
    caps = mq_ctx.caps
    sub = mq_ctx.subscribe("s", mq_ctx.pattern("#"), lease=max(60.0, caps.min_lease))
    published = 5
    mq_ctx.broker.publish_batch([(mq_ctx.topic("n"), {"n": n}) for n in range(5)])
    held = mq_ctx.drain(sub, 2, ack=False)
    assert len(held) == 2
    delayed = 0
    if caps.supports(Feature.DELAY):
        for _ in range(2):
            mq_ctx.broker.publish(mq_ctx.topic("later"), b"later", delay=600)
        delayed, published = 2, published + 2
    dead = 0
    if caps.supports(Feature.DEAD_LETTER):
        held[0].dead_letter("counted")
        dead = 1
    expected = {"ready": 3, "leased": 2 - dead, "delayed": delayed, "dead": dead}
    # lag (offsets): every message past the committed position, settled or not
    stats = _wait_for(mq_ctx, sub.group, expected, (published - dead, published), delayed)
    for name in ("ready", "leased", "delayed", "dead", "lag"):
        value = getattr(stats, name)
        if name not in caps.stats:
            assert value is None, f"{name}={value} but {mq_ctx.broker.backend} declares no " \
                                  f"{name} count"
        elif name != "lag":
            assert _fits(caps.stats[name], value, expected[name], delayed), \
                (name, caps.stats[name], stats, expected)
    if "lag" in caps.stats:
        assert stats.lag is not None and published - dead <= stats.lag <= published, stats


def test_groups_lists_declared_groups(mq_ctx: Ctx) -> None:
    """Where the backend declares it cannot, ``groups()`` is a typed ``Unsupported``."""
    group = mq_ctx.declare("listed", mq_ctx.pattern("#"))
    if not mq_ctx.caps.lists_groups:
        with pytest.raises(mqabstract.Unsupported, match="groups"):
            mq_ctx.broker.groups()
        return
    groups = mq_ctx.broker.groups()
    assert group in groups and groups == sorted(groups)
    mq_ctx.broker.delete_group(group)
    deadline = time.monotonic() + mq_ctx.wait
    while group in mq_ctx.broker.groups() and time.monotonic() < deadline:
        time.sleep(0.2)  # (AWS lists a deleted queue for up to a minute)
    assert group not in mq_ctx.broker.groups()
