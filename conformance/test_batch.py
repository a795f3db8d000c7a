"""Batch receive: ``receive_batch`` holds every rule of ``receive`` on every backend.

Few scenarios, each folding related checks into one publish / receive / wait: columns and
whole-batch ack beside per-message settles; nack with a delay, the final attempt and dead
letters; extend and a batch whose leases ran out in part; ordered keys. Leases and
delays are the harness's (``mq_ctx.lease``, ``mq_ctx.delay``), and every wait on them is
bounded by them. Messages meant to come in one batch share a key: on Kafka that is one
partition, so they come in one fetch (a new topic's partitions come about a second apart).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

import mqabstract
from mqabstract import Feature, Subscription

from .harness import Ctx

_HAS_ARROW = importlib.util.find_spec("pyarrow") is not None


def _batches(mq_ctx: Ctx, sub: Subscription, count: int,
             each: Callable[[Any], None] | None = None) -> list[Any]:
    """Receive batches until ``count`` messages came (or ``wait`` passed without any),
    calling ``each`` on a batch as it arrives: under its lease (a backend may deliver
    a few at a time, a second apart: Kafka, one partition after another)."""
    got: list[Any] = []
    n = 0
    deadline = time.monotonic() + mq_ctx.wait
    while n < count and (left := deadline - time.monotonic()) > 0:
        batch = sub.receive_batch(count - n, left)
        if batch:
            if each is not None:
                each(batch)
            got.append(batch)
            n += len(batch)
            deadline = time.monotonic() + mq_ctx.wait
    assert n == count, f"received {n} of {count} messages"
    return got


def _expect_empty(mq_ctx: Ctx, sub: Subscription, wait: float) -> None:
    """Nothing comes within ``wait``: an empty batch, falsy, whose settles do nothing."""
    empty = sub.receive_batch(10, wait)
    assert not empty and len(empty) == 0 and empty.ids == [], empty.ids
    empty.ack()
    empty.nack()


def test_batch_columns_and_whole_batch_ack(mq_ctx: Ctx) -> None:
    """Columns match the messages; half acked one by one, the rest by the batch; nothing
    comes back; bad arguments raise before anything is received."""
    lease = mq_ctx.lease
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=lease)
    for bad in ((0, 0.0), (-1, 0.0), (10, -1.0)):
        with pytest.raises(mqabstract.InvalidArgument):
            sub.receive_batch(*bad)
    before = datetime.now().astimezone()
    sent = {mq_ctx.broker.publish(mq_ctx.topic("c", str(i)), f"b{i}".encode(),
                                  headers={"n": str(i)}, key=f"k{i}" if i % 2 else None): i
            for i in range(6)}

    def check_and_ack(batch: Any) -> None:
        msgs = list(batch)
        assert batch.ids == [m.id for m in msgs] and set(batch.ids) <= set(sent)
        numbers = [sent[mid] for mid in batch.ids]
        assert batch.topics == [mq_ctx.topic("c", str(i)) for i in numbers]
        assert batch.bodies == [f"b{i}".encode() for i in numbers]
        assert batch.keys == [f"k{i}" if i % 2 else None for i in numbers]
        assert [h.get("n") for h in batch.headers] == [str(i) for i in numbers]
        assert batch.attempts == [1] * len(batch)
        assert all(abs((t - before).total_seconds()) < 60 for t in batch.published_at)
        assert 0 < batch.lease_remaining <= lease
        for msg in msgs[::2]:
            msg.ack()
        batch.ack()  # the rest, in one call; the acked ones neither raise nor go twice
        batch.ack()  # again: a no-op
        assert batch.settled
        with pytest.raises(mqabstract.AlreadySettled):
            batch.nack()

    batches = _batches(mq_ctx, sub, 6, check_and_ack)
    assert sorted(mid for b in batches for mid in b.ids) == sorted(sent)
    for batch in batches:  # columns stay readable once settled (pyarrow's import is slow)
        if _HAS_ARROW:
            assert batch.to_arrow().column("id").to_pylist() == batch.ids
        else:
            with pytest.raises(mqabstract.MissingDependency, match="pyarrow"):
                batch.to_arrow()
    _expect_empty(mq_ctx, sub, lease + mq_ctx.quiet)


def test_batch_nack_delay_final_attempt_and_dead_letter(mq_ctx: Ctx) -> None:
    """A batch nacked with a delay comes back after it, each message with attempt + 1 (one
    dead-lettered on its own first stays dead); on the final attempt a nack dead-letters;
    a batch dead-lettered lands with its reason."""
    mq_ctx.require(Feature.NACK_DELAY, Feature.DEAD_LETTER)
    delay = mq_ctx.delay
    # The group's default lease: this scenario is not about leases, and its first round
    # settles twice (a dead letter, then a nack: two transactions on Kafka), which under
    # load outlasted the short lease of the lease scenarios.
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), max_attempts=2)
    ids = mq_ctx.broker.publish_batch([{"topic": mq_ctx.topic("n"), "body": f"m{i}".encode(),
                                        "key": "one"} for i in range(3)])
    alone: list[str] = []  # dead-lettered on its own, on attempt 1
    final: list[str] = []  # nacked on its own, on the final attempt
    nacked: list[float] = []

    def nack_later(batch: Any) -> None:
        # A first round longer than the delay would meet a nacked one again, and nack it
        # on its final attempt: not what this round is for.
        assert batch.attempts == [1] * len(batch), "the first round outlasted the delay"
        if not alone:
            alone.append(batch[0].id)
            batch[0].dead_letter("one by one")
        nacked.append(time.monotonic())
        batch.nack(delay)  # the dead-lettered one is skipped, not nacked too

    def dead_letter(batch: Any) -> None:
        assert time.monotonic() - nacked[0] >= delay - 0.05
        assert batch.attempts == [2] * len(batch)
        if not final:
            final.append(batch[0].id)
            batch[0].nack()  # the final attempt: dead-lettered
        batch.dead_letter("whole batch")

    _batches(mq_ctx, sub, 3, nack_later)
    again = _batches(mq_ctx, sub, 2, dead_letter)
    assert sorted(m for b in again for m in b.ids) == sorted(set(ids) - set(alone))
    _expect_empty(mq_ctx, sub, mq_ctx.quiet)  # (a plain nack would be back at once)
    dead = {d.id: d for d in mq_ctx.broker.dead_letters(sub.group)}
    assert sorted(dead) == sorted(ids)
    assert (dead[alone[0]].reason, dead[alone[0]].attempts) == ("one by one", 1)
    assert dead[final[0]].attempts == 2 and "final attempt" in dead[final[0]].reason
    [last] = set(ids) - {alone[0], final[0]}
    assert (dead[last].reason, dead[last].attempts) == ("whole batch", 2)


def test_batch_extend_and_partial_expiry(mq_ctx: Ctx) -> None:
    """Extended batches stay ours past their first lease; once the extension runs out on
    all but each batch's first message (extended further), a batch ack acks that one and
    raises LeaseExpired naming the others, which come again with attempt 2."""
    mq_ctx.require(Feature.LEASE_EXTEND)
    lease = mq_ctx.lease
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=lease)
    mq_ctx.broker.publish_batch([{"topic": mq_ctx.topic("e"), "body": f"m{i}".encode(),
                                  "key": "one"} for i in range(4)])
    batches = _batches(mq_ctx, sub, 4, lambda batch: batch.extend(4 * lease))
    # (one key: they come together; a batch of one would have nothing to expire in part)
    assert len(batches) < 4, "every batch held one message: nothing expires in part"
    # Past the first lease, well within the extension (batches may have come apart):
    # nothing comes back.
    watch = min(lease + mq_ctx.quiet, min(b.lease_remaining for b in batches) - lease)
    assert not sub.receive_batch(10, max(0.0, watch))
    rest = [m for b in batches for m in list(b)[1:]]
    ends = max(m.lease_remaining for m in rest)
    for batch in batches:  # outlives the others' leases and the acks below
        batch[0].extend(ends + 2 * lease)
    time.sleep(max(0.0, ends) + 0.05)
    for batch in batches:
        if len(batch) == 1:
            batch.ack()
            continue
        with pytest.raises(mqabstract.LeaseExpired) as info:
            batch.ack()
        assert sorted(info.value.ids) == sorted(batch.ids[1:])
        assert batch[0].settled and not any(m.settled for m in list(batch)[1:])
    back = _batches(mq_ctx, sub, len(rest))
    assert sorted(m for b in back for m in b.ids) == sorted(m.id for m in rest)
    assert all(b.attempts == [2] * len(b) for b in back)
    for batch in back:
        batch.ack()
    _expect_empty(mq_ctx, sub, lease + mq_ctx.quiet)


def test_batch_keeps_ordered_keys(mq_ctx: Ctx) -> None:
    """In an ordered group a batch holds at most one message of a key; a nacked batch's
    messages come again before their keys' later ones; each key in publish order."""
    mq_ctx.require(Feature.ORDERING)
    lease = max(10.0 * mq_ctx.scale, mq_ctx.caps.min_lease)  # never waited on
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), ordered=True, lease=lease)
    items = ["a:1", "b:1", "a:2", "b:2", "a:3", "b:3"]
    mq_ctx.broker.publish_batch([{"topic": mq_ctx.topic("o"), "body": item,
                                  "key": item[0]} for item in items])
    first = sub.receive_batch(10, mq_ctx.wait)
    assert first and len(set(first.keys)) == len(first), first.keys
    assert all(m.value.endswith(":1") for m in first), [m.value for m in first]
    heads = set(first.ids)
    first.nack()
    seen: dict[str, list[tuple[str, int]]] = {}
    done = 0
    deadline = time.monotonic() + mq_ctx.wait
    while done < len(items) and (left := deadline - time.monotonic()) > 0:
        batch = sub.receive_batch(10, left)
        assert len(set(batch.keys)) == len(batch), batch.keys  # one of a key at a time
        for msg in batch:
            seen.setdefault(msg.key, []).append((msg.value, msg.attempt))
            assert (msg.attempt == 2) == (msg.id in heads), (msg.value, msg.attempt)
        batch.ack()
        done += len(batch)
    for key in "ab":
        assert [v for v, _ in seen.get(key, [])] == [f"{key}:{i}" for i in (1, 2, 3)], seen
