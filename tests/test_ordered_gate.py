"""The ordered-key gate: one message of a key at a time on brokers that would hand out more.

``loose://`` is the memory backend without its own per-key FIFO: like RabbitMQ's single
active consumer or a Kafka partition's owner, it hands a consumer a key's messages in
order but all at once, and a nacked or expired message goes to the tail. The portable
layer's gate must keep the contract over it. Everything runs on a FakeClock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import mqabstract
from backends.memory import MemoryDriver
from mqabstract import FakeClock, Message, aio
from mqabstract.emulation.ordering import KeyGate
from mqabstract.model import GroupSpec

LEASE = 10.0


class _Loose(MemoryDriver):
    """Memory without per-key serialisation (declares what its broker does not do)."""

    name = "loose"
    CAPABILITIES = dataclasses.replace(MemoryDriver.CAPABILITIES, key_gate="hold")

    @property
    def capabilities(self) -> mqabstract.Capabilities:
        return self.CAPABILITIES

    def declare(self, spec: GroupSpec) -> None:
        super().declare(dataclasses.replace(spec, ordered=False))

    def subscribe(self, spec: GroupSpec) -> Any:
        return super().subscribe(dataclasses.replace(spec, ordered=False))


mqabstract.register("loose", _Loose)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mq(clock: FakeClock) -> Iterator[mqabstract.Broker]:
    broker = mqabstract.connect(f"loose://{uuid.uuid4().hex}", clock=clock)
    yield broker
    broker.close()


def _bodies(msgs: list[Message]) -> list[str]:
    return [m.value for m in msgs]


def _publish(mq: mqabstract.Broker, *items: str) -> None:
    for item in items:
        mq.publish("t.o", item, key=item.split(":")[0])


class _LockedGroups(_Loose):
    """As SQS FIFO declares itself: held messages go back with a head that goes back."""

    name = "lockedgroups"
    CAPABILITIES = dataclasses.replace(MemoryDriver.CAPABILITIES, key_gate="hand_back")


mqabstract.register("lockedgroups", _LockedGroups)


# -- the toolkit piece on its own -----------------------------------------------------
@dataclasses.dataclass(eq=False)
class _M:
    id: str
    key: str | None
    _deadline: float = 100.0
    _state: str | None = None


def test_gate_lets_one_per_key_out_and_the_next_after_done() -> None:
    gate: KeyGate[_M] = KeyGate(patience=30)
    a1, a2, a3, b1, n = _M("a1", "a"), _M("a2", "a"), _M("a3", "a"), _M("b1", "b"), _M("n", None)
    assert [gate.admit(m, 0) for m in (a1, a2, b1, a3, n)] == [True, False, True, False, True]
    assert len(gate) == 2 and gate.ready(0, 10) == []
    gate.done(a1)
    assert gate.ready(0, 10) == [a2] and len(gate) == 1
    gate.done(a2)
    assert gate.ready(0, 10) == [a3]
    gate.done(a3)
    gate.done(b1)
    assert gate.ready(0, 10) == [] and not gate._keys  # forgotten once idle


def test_gate_waits_for_a_returned_message_and_lets_it_go_first() -> None:
    gate: KeyGate[_M] = KeyGate(patience=30)
    a1, a2 = _M("a1", "a"), _M("a2", "a")
    assert gate.admit(a1, 0) and not gate.admit(a2, 0)
    gate.returned(a1, until=50)  # nack(delay): comes again
    assert gate.ready(10, 10) == []  # a2 waits for a1
    again = _M("a1", "a")
    assert gate.admit(again, 12)  # a1 again: first, ahead of the held a2
    assert gate.ready(12, 10) == []
    gate.done(again)
    assert gate.ready(13, 10) == [a2]


def test_gate_expired_head_comes_first_and_a_lost_wait_ends() -> None:
    gate: KeyGate[_M] = KeyGate(patience=30)
    a1, a2 = _M("a1", "a", _deadline=10), _M("a2", "a", _deadline=10)
    assert gate.admit(a1, 0) and not gate.admit(a2, 0)
    assert gate.ready(10, 10) == []  # a1's lease ended: waited for (until 40)
    assert gate.ready(39.9, 10) == []
    a2._deadline = 100
    assert gate.ready(40, 10) == [a2]  # it never came back here: the key goes on


def test_gate_lost_held_message_goes_first_when_it_comes_again() -> None:
    gate: KeyGate[_M] = KeyGate(patience=30)
    a1, a2, a3 = _M("a1", "a"), _M("a2", "a"), _M("a3", "a")
    for m in (a1, a2, a3):
        gate.admit(m, 0)
    gate.lost(a2, until=60)
    gate.done(a1)
    assert gate.ready(1, 10) == []  # a3 waits for a2
    again = _M("a2", "a")
    assert gate.admit(again, 2)
    gate.done(again)
    assert gate.ready(3, 10) == [a3]


def test_gate_redelivered_held_message_replaces_its_stale_copy() -> None:
    gate: KeyGate[_M] = KeyGate()
    a1, a2 = _M("a1", "a"), _M("a2", "a")
    gate.admit(a1, 0)
    gate.admit(a2, 0)
    fresh = _M("a2", "a")
    assert not gate.admit(fresh, 1) and len(gate) == 1
    gate.done(a1)
    assert gate.ready(2, 10) == [fresh]


def test_gate_hand_back_gives_held_ones_back_with_a_returned_head() -> None:
    gate: KeyGate[_M] = KeyGate(patience=30, hand_back=True)
    a1, a2, a3 = _M("a1", "a", _deadline=10), _M("a2", "a"), _M("a3", "a")
    for m in (a1, a2, a3):
        gate.admit(m, 0)
    gate.returned(a1, until=50)
    assert gate.outgoing == [a2, a3] and len(gate) == 0
    gate.outgoing.clear()
    again = _M("a1", "a")
    assert gate.admit(again, 1)  # the broker delivers in order again; nothing waited for
    gate.done(again)
    b1, b2 = _M("b1", "b", _deadline=10), _M("b2", "b")
    gate.admit(b1, 1)
    gate.admit(b2, 1)
    assert gate.ready(10, 10) == [] and gate.outgoing == [b2]  # b1's lease ended


# -- through the portable layer -------------------------------------------------------
def test_a_batch_hands_out_one_per_key(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    _publish(mq, "a:1", "a:2", "b:1", "a:3", "b:2")
    mq.publish("t.o", "free")  # no key: never held
    got = sub.receive(10)
    assert _bodies(got) == ["a:1", "b:1", "free"]
    assert sub.receive(10) == []
    got[0].ack()
    assert _bodies(sub.receive(10)) == ["a:2"]
    got[1].ack()
    [b2] = sub.receive(10)
    assert b2.value == "b:2" and b2.attempt == 1


def test_unordered_groups_are_not_gated(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "t.#", lease=LEASE)
    _publish(mq, "a:1", "a:2")
    assert _bodies(sub.receive(10)) == ["a:1", "a:2"]


def test_nack_with_delay_keeps_the_key_until_it_is_settled(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    _publish(mq, "a:1", "a:2", "a:3")
    [a1] = sub.receive(10)
    a1.nack(delay=5)
    assert sub.receive(10) == []  # a:2 is held while a:1 is delayed
    clock.advance(5)
    [again] = sub.receive(10, wait=1)
    assert (again.value, again.attempt) == ("a:1", 2)  # the nacked one first
    assert sub.receive(10) == []
    again.nack()  # nack(0): comes again at the tail of the broker's queue, still first
    [third] = sub.receive(10, wait=1)
    assert (third.value, third.attempt) == ("a:1", 3)
    third.ack()
    [a2] = sub.receive(10)
    assert (a2.value, a2.attempt) == ("a:2", 1)
    a2.dead_letter("no")
    assert _bodies(sub.receive(10)) == ["a:3"]


def test_lease_expiry_frees_the_slot_and_the_expired_one_comes_first(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    _publish(mq, "a:1", "a:2")
    [a1] = sub.receive(10)
    gatekeeper = sub._gatekeeper
    assert gatekeeper is not None
    gatekeeper.renew_held()  # (the keeper thread does this on its own tick)
    clock.advance(LEASE / 2)
    gatekeeper.renew_held()
    clock.advance(LEASE / 2)  # a:1's lease ends; a:2's was renewed
    with pytest.raises(mqabstract.LeaseExpired):
        a1.ack()
    [again] = sub.receive(10, wait=1)
    assert (again.value, again.attempt) == ("a:1", 2)
    again.ack()
    [a2] = sub.receive(10)
    assert (a2.value, a2.attempt) == ("a:2", 1)


def test_held_leases_are_renewed_and_handed_out_with_a_whole_lease(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    rival = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    _publish(mq, "a:1", "a:2")
    [a1] = sub.receive(10)
    gatekeeper = sub._gatekeeper
    assert gatekeeper is not None
    for _ in range(8):  # 4 leases of holding a:1
        clock.advance(LEASE / 2)
        a1.extend(LEASE)
        gatekeeper.renew_held()
        assert rival.receive(10) == []  # a:2's broker lease never ran out
    a1.ack()
    [a2] = sub.receive(10)
    assert (a2.value, a2.attempt) == ("a:2", 1)
    assert a2.lease_remaining == pytest.approx(LEASE)


def test_a_held_message_whose_lease_is_gone_is_never_handed_out(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    _publish(mq, "a:1", "a:2", "a:3")
    [a1] = sub.receive(10)
    a1.extend(3 * LEASE)
    clock.advance(LEASE + 1)  # nobody renewed the held ones: both leases gone
    a1.ack()
    [again] = sub.receive(10, wait=1)  # the broker's redelivery, not the stale copy
    assert (again.value, again.attempt) == ("a:2", 2)
    again.ack()
    [a3] = sub.receive(10, wait=1)
    assert (a3.value, a3.attempt) == ("a:3", 2)


def test_close_hands_held_messages_back_in_order(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    _publish(mq, "a:1", "a:2", "a:3")
    assert _bodies(sub.receive(10)) == ["a:1"]
    sub.close()
    other = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    seen = []
    for _ in range(3):
        [m] = other.receive(10, wait=1)
        seen.append(m.value)
        m.ack()
    assert seen == ["a:1", "a:2", "a:3"]


def test_the_keeper_thread_renews_on_its_own(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=0.2)
    _publish(mq, "a:1", "a:2")
    [a1] = sub.receive(10)
    gatekeeper = sub._gatekeeper
    assert gatekeeper is not None
    keeper = gatekeeper.keeper
    assert keeper is not None and keeper.is_alive()
    held = next(gatekeeper.gate.held())
    clock.advance(0.15)
    deadline = time.monotonic() + 5
    while held._deadline < clock.monotonic() + 0.1:
        assert time.monotonic() < deadline, "the keeper did not renew the held lease"
        time.sleep(0.01)
    a1.extend(0.2)
    a1.ack()
    [a2] = sub.receive(10)
    a2.ack()
    deadline = time.monotonic() + 5
    while gatekeeper.keeper is not None:  # nothing held: it ends
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_waiting_receive_gets_the_held_one_soon_after_another_thread_acks(
        mq: mqabstract.Broker) -> None:
    """While a key is held, receive looks again every few milliseconds, not after a quarter
    lease: with a 400 s lease that quarter is 100 s, so only the short look can hand a:2 over
    before the join gives up."""
    sub = mq.subscribe("g", "t.#", ordered=True, lease=400)
    _publish(mq, "a:1", "a:2")
    [a1] = sub.receive(10)
    got: list[list[Message]] = []
    worker = threading.Thread(target=lambda: got.append(sub.receive(10, wait=60)))
    worker.start()
    time.sleep(0.1)
    a1.ack()
    worker.join(30)
    assert not worker.is_alive(), "the ack did not free a:2 for the waiting receive"
    [batch] = got
    assert _bodies(batch) == ["a:2"]


def test_consume_with_concurrency_keeps_one_per_key(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE)
    for i in range(20):
        for key in "ab":
            mq.publish("t.o", f"{key}:{i}", key=key)
    running: dict[str, int] = {"a": 0, "b": 0}
    seen: dict[str, list[int]] = {"a": [], "b": []}
    lock = threading.Lock()

    def handler(msg: Message) -> None:
        key, _, n = msg.value.partition(":")
        with lock:
            running[key] += 1
            assert running[key] == 1, "two messages of one key at once"
            seen[key].append(int(n))
        time.sleep(0.001)
        with lock:
            running[key] -= 1

    stats = sub.consume(handler, max_messages=40, concurrency=4, batch=10, wait=0.05,
                        idle_timeout=5)
    assert stats.acked == 40 and stats.failed == 0
    assert seen == {"a": list(range(20)), "b": list(range(20))}


def test_asyncio_api_keeps_the_rule(clock: FakeClock) -> None:
    async def main() -> None:
        async with await aio.connect(f"loose://{uuid.uuid4().hex}", clock=clock) as amq:
            sub = await amq.subscribe("g", "t.#", ordered=True, lease=LEASE)
            for item in ("a:1", "a:2", "b:1"):
                await amq.publish("t.o", item, key=item[0])
            got = await sub.receive(10)
            assert [m.value for m in got] == ["a:1", "b:1"]
            await got[0].nack(delay=3)
            assert await sub.receive(10) == []
            clock.advance(3)
            [again] = await sub.receive(10, wait=1)
            assert (again.value, again.attempt) == ("a:1", 2)
            await again.ack()
            [a2] = await sub.receive(10)
            assert a2.value == "a:2"

    asyncio.run(main())


def test_hand_back_does_not_spend_the_held_ones_attempts(clock: FakeClock) -> None:
    with mqabstract.connect(f"lockedgroups://{uuid.uuid4().hex}", clock=clock) as mq:
        sub = mq.subscribe("g", "t.#", ordered=True, lease=LEASE, max_attempts=2)
        _publish(mq, "a:1", "a:2", "a:3")
        for attempt in (1, 2):  # the head fails twice: dead-lettered on its final attempt
            [head] = sub.receive(10, wait=1)
            assert (head.value, head.attempt) == ("a:1", attempt)
            head.nack()  # the held a:2 and a:3 go back with it, unseen
        for body in ("a:2", "a:3"):  # never dead-lettered for receives nobody saw
            [msg] = sub.receive(10, wait=1)
            assert (msg.value, msg.attempt) == (body, 1)
            msg.ack()
        assert [d.id for d in mq.dead_letters("g")] != []

