"""Idempotent consumers on every backend: ``consume(dedupe=store)`` runs each id's handler
once and acks its duplicates, whether they were published twice or delivered again after
the handler succeeded (a crash before the ack: here a nack); ``SQLiteStore.transaction``
commits a handler's side effect with its id.

The dedupe logic is the portable layer's; these scenarios prove each backend's ids survive
the trip (a publisher-set id, the same on every redelivery) and its acks of duplicates land.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import mqabstract
from mqabstract.dedupe import MemoryStore, SQLiteStore

from .harness import Ctx


def test_published_twice_is_handled_once(mq_ctx: Ctx, tmp_path: Path) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    topic = mq_ctx.topic("d")
    for mid in ("a", "b", "a", "c", "b", "a"):
        mq_ctx.broker.publish(topic, mid.encode(), id=f"{mq_ctx.group('id')}-{mid}")
    calls: list[str] = []
    with SQLiteStore(tmp_path / "dedupe.db") as store:
        stats = sub.consume(lambda m: calls.append(m.id), max_messages=6,
                            idle_timeout=mq_ctx.wait, dedupe=store)
    assert sorted(c.rsplit("-", 1)[1] for c in calls) == ["a", "b", "c"], calls
    assert (stats.received, stats.acked, stats.duplicates) == (6, 6, 3), stats
    mq_ctx.expect_none(sub)


def test_a_redelivery_after_success_is_not_handled_again(mq_ctx: Ctx) -> None:
    """The handler succeeded and the store recorded the id, but the message came back
    (the consumer died before its ack; a nack here): acked, handler not called."""
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    mid = mq_ctx.broker.publish(mq_ctx.topic("r"), b"once")
    store = MemoryStore()
    first = mq_ctx.drain(sub, 1, ack=False)
    assert [m.id for m in first] == [mid]
    store.record(first[0].group, mid)
    first[0].nack()
    calls: list[int] = []
    stats = sub.consume(lambda m: calls.append(m.attempt), max_messages=1,
                        idle_timeout=mq_ctx.wait, dedupe=store)
    assert calls == [] and (stats.duplicates, stats.acked) == (1, 1), (calls, stats)
    mq_ctx.expect_none(sub)


def test_transaction_side_effects_happen_once(mq_ctx: Ctx, tmp_path: Path) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), max_attempts=5)
    topic = mq_ctx.topic("t")
    ids = [f"{mq_ctx.group('tx')}-{n}" for n in (1, 2, 1, 3)]
    for mid in ids:
        mq_ctx.broker.publish(topic, b"x", id=mid)
    path = tmp_path / "effects.db"
    with SQLiteStore(path) as store:
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE effects (id TEXT, attempt INT)")

        def handler(msg: mqabstract.Message) -> None:
            with store.transaction(msg) as db:
                db.execute("INSERT INTO effects VALUES (?, ?)", (msg.id, msg.attempt))

        stats = sub.consume(handler, max_messages=4, idle_timeout=mq_ctx.wait, dedupe=store)
    rows = sqlite3.connect(path).execute(
        "SELECT id, count(*) FROM effects GROUP BY id ORDER BY id").fetchall()
    assert rows == [(mid, 1) for mid in sorted(set(ids))], rows
    assert (stats.acked, stats.duplicates, stats.failed) == (4, 1, 0), stats
