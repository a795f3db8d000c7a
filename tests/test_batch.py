"""``receive_batch`` and ``Batch`` over the memory reference, on a fake clock: columns, one
lease, whole-batch settles beside per-message ones, partial expiry, and every rule of
``receive`` (attempts, dead letters, TTL, ordered keys, the gatekeeper) unchanged."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

import mqabstract
import tests.test_ordered_gate  # noqa: F401  (registers loose://, memory without a key FIFO)
from mqabstract import Batch, FakeClock, Message, aio

LEASE = 30.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mq(clock: FakeClock) -> Iterator[mqabstract.Broker]:
    broker = mqabstract.connect(f"memory://batch-{uuid.uuid4().hex}", clock=clock)
    yield broker
    broker.close()


def _publish(mq: mqabstract.Broker, n: int, topic: str = "a.b", **kw: Any) -> list[str]:
    return [mq.publish(topic, f"m{i}", **kw) for i in range(n)]


def _driver_calls(sub: mqabstract.Subscription, name: str) -> list[Any]:
    """Record the arguments of each call of the driver subscription's ``name``."""
    inner = sub._inner  # type: ignore[attr-defined]
    real = getattr(inner, name)
    calls: list[Any] = []

    def spy(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    setattr(inner, name, spy)
    return calls


def test_columns_follow_the_messages(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    ids = [mq.publish("a.b", b"raw", key="k1", headers={"h": "1"}),
           mq.publish("a.c", "text"),
           mq.publish("a.b", {"n": 3}, key="k3")]
    batch = sub.receive_batch(10)
    assert isinstance(batch, Batch) and batch and len(batch) == 3
    msgs = list(batch)
    assert all(isinstance(m, Message) for m in msgs) and batch[0] is msgs[0]
    assert batch[1:] == msgs[1:]
    assert batch.ids == ids == [m.id for m in msgs]  # publish order on memory
    assert batch.topics == ["a.b", "a.c", "a.b"]
    assert batch.keys == ["k1", None, "k3"]
    assert batch.bodies == [b"raw", b"text", b'{"n":3}']
    assert batch.headers[0] == {"h": "1"} and batch.headers[1]["content-type"].startswith(
        "text/plain")
    assert batch.attempts == [1, 1, 1]
    assert batch.published_at == [m.published_at for m in msgs]
    assert all(t.tzinfo is not None for t in batch.published_at)
    batch.ids.append("x")  # a new list each time: the batch is not changed
    assert len(batch.ids) == 3
    assert batch.lease_remaining == LEASE
    assert "3 messages" in repr(batch)
    table = batch.to_arrow()
    assert table.column_names == ["id", "topic", "key", "body", "headers", "attempt",
                                  "published_at"]
    assert table.num_rows == 3
    assert table.column("id").to_pylist() == ids
    assert table.column("key").to_pylist() == ["k1", None, "k3"]
    assert table.column("body").to_pylist()[0] == b"raw"
    assert table.column("headers").to_pylist()[0] == [("h", "1")]
    assert table.column("attempt").to_pylist() == [1, 1, 1]
    assert str(table.schema.field("published_at").type) == "timestamp[us, tz=UTC]"
    assert table.column("published_at").to_pylist() == batch.published_at
    batch.ack()
    assert batch.settled and batch.lease_remaining == float("inf")
    clock.advance(3600)
    assert not sub.receive_batch(10)


def test_to_arrow_without_pyarrow_says_what_to_install(
        mq: mqabstract.Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    _publish(mq, 1)
    batch = sub.receive_batch()
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    with pytest.raises(mqabstract.MissingDependency, match=r"mqabstract\[arrow\]"):
        batch.to_arrow()
    batch.ack()


def test_empty_batch_is_falsy_and_its_settles_are_no_ops(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    calls = [_driver_calls(sub, op) for op in ("ack", "nack", "dead_letter", "extend")]
    batch = sub.receive_batch(10, 0)
    assert not batch and len(batch) == 0 and list(batch) == []
    assert batch.ids == batch.bodies == batch.headers == batch.attempts == []
    assert batch.settled and batch.lease_remaining == float("inf")
    batch.ack()
    batch.nack(5)
    batch.dead_letter("nothing")
    batch.extend(60)
    batch.ack()  # no whole-batch outcome is kept for an empty batch
    assert calls == [[], [], [], []]
    assert batch.to_arrow().num_rows == 0
    with pytest.raises(mqabstract.InvalidArgument):  # arguments are still checked
        batch.nack(-1)
    with pytest.raises(mqabstract.InvalidArgument):
        batch.extend(0)
    with pytest.raises(mqabstract.InvalidArgument):
        batch.dead_letter(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [(0,), (-1,), (True,), (1.5,), ("3",), (10, -1),
                                  (10, float("nan")), (10, "1"), (10, True)])
def test_bad_arguments_raise_before_anything_is_received(mq: mqabstract.Broker,
                                                        args: tuple[Any, ...]) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    [mid] = _publish(mq, 1)
    with pytest.raises(mqabstract.InvalidArgument):
        sub.receive_batch(*args)
    [msg] = sub.receive(1, 0)  # still there, first attempt: nothing was received
    assert (msg.id, msg.attempt) == (mid, 1)


def test_closed_subscription_raises_closed(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    sub.close()
    with pytest.raises(mqabstract.Closed):
        sub.receive_batch(10)


def test_whole_batch_ack_skips_settled_messages_in_one_driver_call(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE, max_attempts=5)
    ids = _publish(mq, 6)
    batch = sub.receive_batch(10)
    acks = _driver_calls(sub, "ack")
    batch[0].ack()
    batch[1].nack()
    batch[2].dead_letter("one by one")
    batch.ack()  # no AlreadySettled for the nacked or dead-lettered one, nothing twice
    assert len(acks) == 2 and len(acks[1][0]) == 3  # one call for the three left
    assert batch.settled
    batch.ack()  # again: a no-op
    assert len(acks) == 2
    with pytest.raises(mqabstract.AlreadySettled, match="already acked"):
        batch.nack()
    with pytest.raises(mqabstract.AlreadySettled):
        batch.dead_letter("late")
    with pytest.raises(mqabstract.AlreadySettled):
        batch.extend(60)
    [again] = sub.receive_batch(10)
    assert (again.id, again.attempt) == (ids[1], 2)
    again.ack()
    [dead] = mq.dead_letters("g")
    assert (dead.id, dead.reason) == (ids[2], "one by one")
    clock.advance(3600)
    assert not sub.receive_batch(10)


@pytest.mark.parametrize("op", ["ack", "nack", "dead_letter", "extend"])
def test_partial_expiry_settles_the_rest_then_raises(
        mq: mqabstract.Broker, clock: FakeClock, op: str) -> None:
    """Messages whose lease ran out are refused (they come again with attempt + 1); the
    others are settled, then ``LeaseExpired`` names the refused ones."""
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    ids = _publish(mq, 4)
    batch = sub.receive_batch(10)
    batch[0].extend(2 * LEASE)
    batch[3].ack()  # settled one by one: neither refused nor settled twice
    clock.advance(LEASE)  # batch[1] and batch[2] are out of lease now
    assert batch.lease_remaining <= 0

    def settle() -> None:
        if op == "extend":
            batch.extend(LEASE)
        elif op == "dead_letter":
            batch.dead_letter("bad")
        else:
            getattr(batch, op)()

    with pytest.raises(mqabstract.LeaseExpired) as info:
        settle()
    assert info.value.ids == (ids[1], ids[2])
    assert ids[1] in str(info.value) and ids[2] in str(info.value)
    assert not info.value.retryable
    assert not batch[1].settled and not batch[2].settled
    assert batch[0].settled is (op != "extend")
    # The refused ones no longer count: the live one's lease, or none left to settle.
    assert batch.lease_remaining == (LEASE if op == "extend" else float("inf"))
    with pytest.raises(mqabstract.LeaseExpired):  # and again: never reaches the broker
        settle()
    again = sub.receive_batch(10)
    back = ids[:3] if op == "nack" else ids[1:3]  # (ids[0] nacked comes again too)
    assert sorted(again.ids) == sorted(back) and again.attempts == [2] * len(back)
    again.ack()
    if op == "extend":
        assert batch[0].lease_remaining == LEASE
        batch[0].ack()
    elif op == "dead_letter":
        assert [d.id for d in mq.dead_letters("g")] == [ids[0]]
    clock.advance(3600)
    assert not sub.receive_batch(10)


def test_extend_renews_every_lease_of_the_batch(mq: mqabstract.Broker,
                                                clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    ids = _publish(mq, 3)
    batch = sub.receive_batch(10)
    clock.advance(20)
    batch[2].ack()
    assert batch.lease_remaining == LEASE - 20
    batch.extend(60)
    assert batch.lease_remaining == 60
    clock.advance(59)
    assert not sub.receive_batch(10)
    batch[0].ack()  # still leased
    clock.advance(2)
    [back] = sub.receive_batch(10)  # the extension ran out: it comes again
    assert (back.id, back.attempt) == (ids[1], 2)
    back.ack()
    with pytest.raises(mqabstract.InvalidArgument, match="minimum lease"):
        batch.extend(0.001)


def test_nack_delay_and_the_final_attempt(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE, max_attempts=2)
    ids = _publish(mq, 3)
    sub.receive_batch(10).nack(delay=5)
    clock.advance(4.9)
    assert not sub.receive_batch(10)
    clock.advance(0.2)
    batch = sub.receive_batch(10)
    assert batch.ids == ids and batch.attempts == [2, 2, 2]
    batch.nack()  # the final attempt: dead-lettered, as by Message.nack
    dead = mq.dead_letters("g")
    assert sorted(d.id for d in dead) == sorted(ids)
    assert all(d.attempts == 2 and "final attempt" in d.reason for d in dead)
    clock.advance(3600)
    assert not sub.receive_batch(10)
    with pytest.raises(mqabstract.InvalidArgument):
        batch.nack(-1)


def test_dead_letter_with_reason(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    ids = _publish(mq, 3)
    batch = sub.receive_batch(10)
    batch.dead_letter("bad batch")
    batch.dead_letter("bad batch")  # the same again: a no-op
    dead = mq.dead_letters("g")
    assert sorted(d.id for d in dead) == sorted(ids)
    assert {(d.reason, d.attempts) for d in dead} == {("bad batch", 1)}
    with pytest.raises(mqabstract.AlreadySettled, match="dead-lettered"):
        batch.ack()
    clock.advance(3600)
    assert not sub.receive_batch(10)


def test_attempts_and_ttl_hold_through_the_batch_path(mq: mqabstract.Broker,
                                                      clock: FakeClock) -> None:
    """An exhausted message is dead-lettered at receive, an expired one never handed out."""
    sub = mq.subscribe("g", "a.#", lease=LEASE, max_attempts=2)
    [tired] = _publish(mq, 1)
    assert sub.receive_batch(10).attempts == [1]
    clock.advance(LEASE)
    assert sub.receive_batch(10).attempts == [2]
    clock.advance(LEASE)
    assert not sub.receive_batch(10)  # a third delivery: dead-lettered instead
    [dead] = mq.dead_letters("g")
    assert dead.id == tired and "max attempts" in dead.reason
    [mortal] = _publish(mq, 1, ttl=10)
    clock.advance(11)
    assert not sub.receive_batch(10)
    assert {d.id: d.reason for d in mq.dead_letters("g")}[mortal] == "expired"


def test_two_whole_batch_settles_at_once_one_wins(mq: mqabstract.Broker) -> None:
    """A nack from another thread while the batch's ack is in the driver waits for it and
    then raises AlreadySettled, as it would after it."""
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    _publish(mq, 2)
    batch = sub.receive_batch(10)
    inner = sub._inner  # type: ignore[attr-defined]
    real = inner.ack
    entered, go = threading.Event(), threading.Event()

    def slow(receipts: list[object]) -> None:
        entered.set()
        go.wait(10)
        real(receipts)

    inner.ack = slow
    errors: dict[str, BaseException | None] = {}

    def run(op: str) -> None:
        try:
            getattr(batch, op)()
            errors[op] = None
        except BaseException as exc:
            errors[op] = exc

    acking = threading.Thread(target=run, args=("ack",))
    acking.start()
    assert entered.wait(10)
    nacking = threading.Thread(target=run, args=("nack",))
    nacking.start()
    time.sleep(0.2)  # (without the lock it would be done by now)
    go.set()
    acking.join(10)
    nacking.join(10)
    assert errors["ack"] is None
    assert isinstance(errors["nack"], mqabstract.AlreadySettled), errors
    assert batch.settled and all(m._state == "acked" for m in batch)


@pytest.mark.parametrize("whole", [True, False], ids=["batch", "single"])
@pytest.mark.parametrize("op", ["ack", "nack", "dead_letter"])
def test_a_settle_that_fails_leaves_the_batch_open(mq: mqabstract.Broker, clock: FakeClock,
                                                   op: str, whole: bool) -> None:
    """A broker error is not a settle: nothing is marked, the messages are ours again (a
    close would hand them back) and any outcome may follow, the same one too."""
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    ids = _publish(mq, 2)
    batch = sub.receive_batch(10)
    inner = sub._inner  # type: ignore[attr-defined]
    real = getattr(inner, op)

    def down(*args: object) -> None:
        raise mqabstract.ConnectionFailed("broker away")

    def settle(target: Any, how: str = op) -> None:
        getattr(target, how)(*(("bad",) if how == "dead_letter" else ()))

    setattr(inner, op, down)
    with pytest.raises(mqabstract.ConnectionFailed):
        settle(batch) if whole else [settle(m) for m in batch]
    assert not batch[0].settled and not batch[1].settled
    assert set(batch) <= sub._unsettled  # type: ignore[attr-defined]
    setattr(inner, op, real)
    settle(batch[0])  # the same again: it happens now (no no-op)
    other = "nack" if op == "ack" else "ack"
    settle(batch[1], other)  # or another outcome (no AlreadySettled)
    assert batch.settled
    back = sub.receive_batch(10)  # nacked ones at once, the others never
    assert back.ids == ([ids[0] if op == "nack" else ids[1]] if "nack" in (op, other)
                        else [])
    assert back.attempts == [2] * len(back)
    back.ack()
    assert [d.id for d in mq.dead_letters("g")] == ([ids[0]] if op == "dead_letter" else [])
    clock.advance(3600)
    assert not sub.receive_batch(10)


def test_filling_stops_when_nothing_more_is_ready_or_half_the_lease_is_gone(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    _publish(mq, 7)
    inner = sub._inner  # type: ignore[attr-defined]
    real = inner.receive
    calls: list[int] = []

    def two_at_a_time(n: int, wait: float) -> list[Any]:  # a broker like SQS (10 a call)
        calls.append(n)
        return real(min(n, 2), wait)

    inner.receive = two_at_a_time
    batch = sub.receive_batch(5)
    assert len(batch) == 5 and calls == [5, 3, 1]
    batch.ack()
    calls.clear()
    rest = sub.receive_batch(5)
    assert len(rest) == 2 and calls == [5, 3]  # the second call found none ready
    rest.ack()

    _publish(mq, 6)

    def slow(n: int, wait: float) -> list[Any]:
        clock.advance(LEASE / 4)
        return real(min(n, 2), wait)

    inner.receive = slow
    batch = sub.receive_batch(6)
    assert len(batch) == 4  # a third call would hand the batch over with under half its lease
    assert batch.lease_remaining >= LEASE / 2
    batch.ack()

    def broken_after_first(n: int, wait: float) -> list[Any]:
        inner.receive = failing
        return real(1, wait)

    def failing(n: int, wait: float) -> list[Any]:
        raise mqabstract.ConnectionFailed("gone")

    inner.receive = broken_after_first
    batch = sub.receive_batch(6)
    assert len(batch) == 1  # what it held is handed over; the next receive sees the error
    batch.ack()
    with pytest.raises(mqabstract.ConnectionFailed):
        sub.receive_batch(6)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_filling_that_fails_otherwise_hands_back_what_it_held(
        mq: mqabstract.Broker, clock: FakeClock, error: type[BaseException]) -> None:
    """Not a broker error (a bug, an interrupt): nobody gets the batch, so what was
    collected goes back at once (not after its lease), and the error propagates."""
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    ids = _publish(mq, 3)
    real = sub._take  # the batch's receives (without the middleware's notice)

    def first(n: int = 1, wait: float = 0.0) -> list[Message]:
        sub._take = failing  # type: ignore[method-assign]
        return real(2, wait)

    def failing(n: int = 1, wait: float = 0.0) -> list[Message]:
        raise error("stop")

    sub._take = first  # type: ignore[method-assign]
    with pytest.raises(error):
        sub.receive_batch(10)
    del sub._take  # type: ignore[method-assign]
    assert not sub._unsettled  # type: ignore[attr-defined]
    back = sub.receive_batch(10)  # at once: no clock advance
    assert sorted(back.ids) == sorted(ids)
    back.ack()
    clock.advance(3600)
    assert not sub.receive_batch(10)


@pytest.mark.parametrize("scheme", ["memory", "loose"])
def test_ordered_keys_one_at_a_time_through_the_batch_path(clock: FakeClock,
                                                           scheme: str) -> None:
    """memory keeps a key's order itself; ``loose`` (tests/test_ordered_gate.py) hands
    out a key's messages at once, and the gatekeeper holds the later ones."""
    with mqabstract.connect(f"{scheme}://ordered-{uuid.uuid4().hex}", clock=clock) as mq:
        sub = mq.subscribe("g", "o.#", lease=LEASE, ordered=True)
        for item in ("a:1", "b:1", "a:2", "b:2", "a:3"):
            mq.publish("o.t", item, key=item[0])
        first = sub.receive_batch(10)
        assert [m.value for m in first] == ["a:1", "b:1"]
        first.nack()  # each comes again before its key's later ones
        seen: list[tuple[str, int]] = []
        while batch := sub.receive_batch(10):
            assert len(set(batch.keys)) == len(batch)  # one per key at a time
            seen += [(m.value, m.attempt) for m in batch]
            batch.ack()
        assert [s for s in seen if s[0][0] == "a"] == [("a:1", 2), ("a:2", 1), ("a:3", 1)]
        assert [s for s in seen if s[0][0] == "b"] == [("b:1", 2), ("b:2", 1)]


def test_lease_expired_names_the_message_on_the_single_path(mq: mqabstract.Broker,
                                                            clock: FakeClock) -> None:
    sub = mq.subscribe("g", "a.#", lease=LEASE)
    ids = _publish(mq, 12)
    msgs = sub.receive(12, 0)
    clock.advance(LEASE)
    with pytest.raises(mqabstract.LeaseExpired) as one:
        msgs[0].ack()
    assert one.value.ids == (ids[0],)
    with pytest.raises(mqabstract.LeaseExpired, match=r"12 messages .* and 2 more") as many:
        sub.ack_many(msgs)
    assert many.value.ids == tuple(ids)


def test_asyncio_twin(clock: FakeClock) -> None:
    async def main() -> None:
        async with await aio.connect(f"memory://abatch-{uuid.uuid4().hex}",
                                     clock=clock) as mq:
            sub = await mq.subscribe("g", "a.#", lease=LEASE)
            with pytest.raises(mqabstract.InvalidArgument):
                await sub.receive_batch(0)
            empty = await sub.receive_batch(10, 0)
            assert isinstance(empty, aio.AsyncBatch) and not empty and len(empty) == 0
            await empty.ack()
            ids = [await mq.publish("a.b", f"m{i}") for i in range(4)]
            batch = await sub.receive_batch(10, 1)
            assert batch.ids == ids and batch.attempts == [1] * 4
            assert batch.bodies == [b"m0", b"m1", b"m2", b"m3"]
            assert batch.keys == [None] * 4 and batch.topics == ["a.b"] * 4
            assert all(isinstance(t, datetime) for t in batch.published_at)
            assert batch.headers[0]["content-type"].startswith("text/plain")
            assert batch.to_arrow().num_rows == 4
            assert isinstance(batch[0], aio.AsyncMessage) and batch[0] is batch[0]
            assert [m.id for m in batch] == ids
            await batch[0].ack()
            await batch.extend(60)
            assert batch.lease_remaining == 60
            clock.advance(LEASE)
            await batch[1].dead_letter("one")
            await batch.nack()
            assert batch.settled and batch.batch.settled
            again = await sub.receive_batch(10, 1)
            assert again.ids == ids[2:] and again.attempts == [2, 2]
            await again.dead_letter("all")
            assert {d.reason for d in await mq.dead_letters("g")} == {"one", "all"}
            clock.advance(LEASE)
            late = [await mq.publish("a.b", "late")]
            gone = await sub.receive_batch(10, 1)
            clock.advance(LEASE)
            with pytest.raises(mqabstract.LeaseExpired) as info:
                await gone.ack()
            assert info.value.ids == tuple(late)

    asyncio.run(asyncio.wait_for(main(), 60))
