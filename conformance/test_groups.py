"""Groups: fan-out, competing consumers, patterns, isolation, late declaration."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from mqabstract import Feature

from .harness import Ctx


def test_fanout_to_several_groups(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.FANOUT)
    subs = [mq_ctx.subscribe(f"g{i}", mq_ctx.pattern("#")) for i in range(3)]
    ids = {mq_ctx.broker.publish(mq_ctx.topic("e"), f"m{i}".encode()) for i in range(10)}
    for sub in subs:
        got = mq_ctx.drain(sub, 10)
        assert {m.id for m in got} == ids, f"group {sub.group} missed messages"


def test_competing_consumers_share_without_duplicates(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.COMPETING)
    limit = mq_ctx.caps.max_consumers_per_group or 4
    n_consumers, n_messages = min(4, limit), 200
    group_pattern = mq_ctx.pattern("#")
    brokers = [mq_ctx.broker] + [mq_ctx.connect() for _ in range(n_consumers - 1)]
    subs = [mq_ctx.subscribe("g", group_pattern, broker=b) for b in brokers]
    counts: Counter[str] = Counter()
    per_consumer = [0] * n_consumers
    lock = threading.Lock()
    done = threading.Event()

    def work(i: int) -> None:
        while not done.is_set():
            for msg in subs[i].receive(5, 0.5):
                time.sleep(0.002)  # some work per message, so one consumer cannot take all
                with lock:
                    counts[msg.id] += 1
                    per_consumer[i] += 1
                    if len(counts) >= n_messages:
                        done.set()
                msg.ack()

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n_consumers)]
    for t in threads:
        t.start()
    # Distinct keys spread the work on partitioned backends (Kafka's sticky partitioner).
    ids = mq_ctx.broker.publish_batch(
        [{"topic": mq_ctx.topic("w"), "body": f"{i}", "key": f"k{i}"} for i in range(n_messages)]
    )
    done.wait(mq_ctx.wait * 2)
    # Keep consuming briefly: a duplicate delivery after ack would show up now.
    threading.Event().wait(mq_ctx.quiet)
    done.set()
    for t in threads:
        t.join(10)
    assert set(counts) == set(ids), f"missing {len(set(ids) - set(counts))} messages"
    dupes = {k: v for k, v in counts.items() if v > 1}
    assert not dupes, f"acked messages delivered twice: {dupes}"
    assert sum(1 for c in per_consumer if c) >= 2, f"work not shared: {per_consumer}"


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        ("orders.*", ["orders.eu"], ["orders", "orders.eu.created", "other.eu"]),
        ("orders.#", ["orders", "orders.eu", "orders.eu.created"], ["order", "other.orders"]),
        ("*.created", ["eu.created"], ["created", "eu.x.created", "eu.updated"]),
        ("#.created", ["created", "eu.created", "a.b.created"], ["created.eu"]),
        ("orders.*.created", ["orders.eu.created"], ["orders.created", "orders.a.b.created"]),
        ("a.#.z", ["a.z", "a.b.z", "a.b.c.z"], ["a.b", "b.z"]),
        ("exact.topic", ["exact.topic"], ["exact.topic.more", "exact"]),
    ],
)
def test_wildcard_patterns(
    mq_ctx: Ctx, pattern: str, matching: list[str], not_matching: list[str]
) -> None:
    mq_ctx.require(Feature.WILDCARDS)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern(pattern))
    for topic in not_matching + matching:
        mq_ctx.broker.publish(mq_ctx.topic(topic), topic.encode())
    got = mq_ctx.drain(sub, len(matching))
    assert sorted(m.body.decode() for m in got) == sorted(matching)
    mq_ctx.expect_none(sub)


def test_many_topics_isolated(mq_ctx: Ctx) -> None:
    n = 12
    subs = [mq_ctx.subscribe(f"g{i}", mq_ctx.pattern(f"t{i}")) for i in range(n)]
    for rnd in range(2):
        mq_ctx.broker.publish_batch(
            [(mq_ctx.topic(f"t{i}"), f"{i}:{rnd}".encode()) for i in range(n)]
        )
    for i, sub in enumerate(subs):
        got = mq_ctx.drain(sub, 2)
        assert sorted(m.body.decode() for m in got) == [f"{i}:0", f"{i}:1"]
    for sub in subs[:3]:
        mq_ctx.expect_none(sub, 0.3)


def test_group_declared_late_gets_no_old_messages(mq_ctx: Ctx) -> None:
    early = mq_ctx.subscribe("early", mq_ctx.pattern("#"))
    old = mq_ctx.broker.publish(mq_ctx.topic("x"), b"old")
    late = mq_ctx.subscribe("late", mq_ctx.pattern("#"))
    new = mq_ctx.broker.publish(mq_ctx.topic("x"), b"new")
    assert [m.id for m in mq_ctx.drain(late, 1)] == [new]
    mq_ctx.expect_none(late)
    assert sorted(m.id for m in mq_ctx.drain(early, 2)) == sorted([old, new])


def test_declared_group_keeps_messages_until_consumer_attaches(mq_ctx: Ctx) -> None:
    mq_ctx.declare("g", mq_ctx.pattern("#"))
    ids = [mq_ctx.broker.publish(mq_ctx.topic("x"), f"{i}".encode()) for i in range(3)]
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    assert sorted(m.id for m in mq_ctx.drain(sub, 3)) == sorted(ids)


def test_publish_to_topic_without_groups_succeeds(mq_ctx: Ctx) -> None:
    assert mq_ctx.broker.publish(mq_ctx.topic("nobody", "listens"), b"x")
    assert mq_ctx.broker.publish_batch([(mq_ctx.topic("nobody"), b"y")])


@pytest.mark.parametrize("call", ["declare", "subscribe"])
def test_unknown_group_keyword_is_refused_before_declaring(mq_ctx: Ctx, call: str) -> None:
    """A typo (``leas=5``) used to be accepted silently and the group ran with the default
    lease; now it is ``InvalidArgument`` naming the closest keyword, and nothing is made:
    a correct declaration afterwards gets the lease it asks for."""
    import mqabstract

    fn = mq_ctx.declare if call == "declare" else mq_ctx.subscribe
    with pytest.raises(mqabstract.InvalidArgument, match=r"leas\b.*did you mean lease"):
        fn("typo", mq_ctx.pattern("#"), leas=5)
    with pytest.raises(mqabstract.InvalidArgument, match="bogus_option"):
        fn("typo", mq_ctx.pattern("#"), bogus_option=1)
    sub = mq_ctx.subscribe("typo", mq_ctx.pattern("#"), lease=5)
    mq_ctx.broker.publish(mq_ctx.topic("x"), b"x")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    assert 0 < msg.lease_remaining <= 5
    msg.ack()
