"""The production consume loop on every backend: handlers at once, a slow handler keeping
its message by ``auto_extend``, and a stop handing back what never started.

The loop is the portable layer's; these scenarios prove each backend's receive, extend,
ack and release carry it (an extend the backend ignores, or a release that waits for the
lease, fails them)."""

from __future__ import annotations

import threading
import time

import mqabstract
from mqabstract import Feature

from .harness import Ctx


def test_concurrent_handlers_take_every_message_once(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    ids = mq_ctx.broker.publish_batch([(mq_ctx.topic("c"), {"n": i}) for i in range(16)])
    lock = threading.Lock()
    seen: list[str] = []
    running = [0, 0]  # now, most

    def handler(msg: mqabstract.Message) -> None:
        with lock:
            seen.append(msg.id)
            running[0] += 1
            running[1] = max(running)
        time.sleep(0.1)
        with lock:
            running[0] -= 1

    stats = sub.consume(handler, concurrency=4, max_messages=16, idle_timeout=mq_ctx.wait)
    assert stats.acked == 16 and sorted(seen) == sorted(ids), stats
    assert 2 <= running[1] <= 4, running
    mq_ctx.expect_none(sub)


def test_auto_extend_keeps_a_handler_three_times_the_lease_long_from_redelivery(
        mq_ctx: Ctx) -> None:
    """The handler runs 3 leases; the loop (free to take more, concurrency=2) must never
    see the message again, and its ack must land."""
    mq_ctx.require(Feature.LEASE_EXTEND)
    lease = mq_ctx.lease
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=lease)
    mid = mq_ctx.broker.publish(mq_ctx.topic("slow"), b"slow")
    calls: list[tuple[str, int]] = []

    def slow(msg: mqabstract.Message) -> None:
        calls.append((msg.id, msg.attempt))
        time.sleep(3 * lease)

    stats = sub.consume(slow, concurrency=2, idle_timeout=3 * lease + 0.5, wait=lease / 4)
    assert calls == [(mid, 1)], calls
    assert stats.acked == 1 and stats.expired == 0 and stats.extended >= 2, stats
    mq_ctx.expect_none(sub)


def test_stop_hands_back_unstarted_messages_at_once(mq_ctx: Ctx) -> None:
    """Stopped with 2 handlers running and more messages held: the 2 finish and are acked;
    the rest come back long before their (long) lease would have ended."""
    lease = 60.0 * mq_ctx.scale
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), lease=lease)
    ids = mq_ctx.broker.publish_batch([(mq_ctx.topic("s"), {"n": i}) for i in range(8)])
    started = threading.Semaphore(0)
    done: list[str] = []

    def work(msg: mqabstract.Message) -> None:
        started.release()
        time.sleep(0.5)
        done.append(msg.id)

    def stop_after_two() -> None:
        for _ in range(2):
            started.acquire()
        sub.stop()

    threading.Thread(target=stop_after_two, daemon=True).start()
    stats = sub.consume(work, concurrency=2, batch=8, grace=lease / 2)
    assert stats.acked == len(done) >= 2 and stats.released == stats.received - len(done)
    rest = mq_ctx.drain(sub, len(ids) - len(done))
    assert sorted([m.id for m in rest] + done) == sorted(ids)
    mq_ctx.expect_none(sub)


def test_ordered_keys_one_handler_at_a_time_in_publish_order(mq_ctx: Ctx) -> None:
    """concurrency=4 over an ordered group: keys run side by side, one handler per key at
    a time, each key's messages in publish order (the loop does nothing per key: receive
    never hands out a key's next message while the previous is unsettled)."""
    mq_ctx.require(Feature.ORDERING)
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"), ordered=True)
    keys, per_key = ("a", "b", "c"), 6
    mq_ctx.broker.publish_batch([{"topic": mq_ctx.topic("o"), "body": f"{k}:{i}", "key": k}
                                 for i in range(per_key) for k in keys])
    lock = threading.Lock()
    running = dict.fromkeys(keys, 0)
    overlaps: list[str] = []
    seen: dict[str, list[int]] = {k: [] for k in keys}

    def handler(msg: mqabstract.Message) -> None:
        key, _, n = msg.value.partition(":")
        with lock:
            running[key] += 1
            if running[key] > 1:
                overlaps.append(msg.value)
            seen[key].append(int(n))
        time.sleep(0.02)
        with lock:
            running[key] -= 1

    stats = sub.consume(handler, concurrency=4, max_messages=len(keys) * per_key,
                        idle_timeout=mq_ctx.wait, wait=0.5)
    assert stats.acked == len(keys) * per_key, stats
    assert not overlaps, f"two handlers of one key at once: {overlaps}"
    assert seen == {k: list(range(per_key)) for k in keys}, seen
