"""Kafka driver: a commit proves ownership only in the generation that assigned the partition.

No broker: the confluent-kafka group member (``ck_consume._Member``, its real commit queue)
runs on a stand-in for librdkafka's consumer that behaves as librdkafka does where it matters
here: an offset commit is sent with the member's generation *at send time*, and the coordinator
(a dict) accepts it when that generation and member id are current, whoever owns the
partition. ``KafkaSubscription`` runs its real receive, fence, revocation and takeover code.

The scenario is the CI chaos run's (seed 2402952423): a consumer frozen past its session is
evicted; another member takes its partition over, hands out what it had buffered and
commits its checkpoint; the woken consumer rejoins and gets the partition back. A commit
the woken consumer built before it lost the partition, sent after its rejoin, was accepted
and overwrote the new owner's checkpoint; the woken consumer then found "its own"
checkpoint, took its stale buffer back and handed out records the other member had
already delivered, with the same attempt (50 ids: attempt 1 twice, or 2 twice through the
copies of its stale leases).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("confluent_kafka")

from mqabstract import wire
from mqabstract.backends.kafka import ck_consume
from mqabstract.backends.kafka.client import TP
from mqabstract.backends.kafka.state import Checkpoint, Part
from mqabstract.backends.kafka.subscription import KafkaSubscription

RETRY = "__mqa..r..g"
P = TP(RETRY, 0)


class Coordinator:
    """The group coordinator's offsets: a commit lands when its generation and member id
    are the group's current ones (Kafka checks membership, not the assignment)."""

    def __init__(self) -> None:
        self.members: set[tuple[int, str]] = set()
        self.offsets: dict[TP, tuple[int, str]] = {}

    def commit(self, gen: int, member: str, offsets: dict[TP, tuple[int, str]]) -> bool:
        if (gen, member) not in self.members:
            return False
        self.offsets.update(offsets)
        return True


class Lib:
    """librdkafka's consumer as ``ck_consume._Member`` uses it. With ``pause`` set, the next
    commit call, once sent, returns only when ``pause`` is set (the binding keeps the
    committer waiting, e.g. behind the group thread's poll running a long listener)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.gen, self.member = 5, "m1"
        self.pause: threading.Event | None = None
        self.paused = threading.Event()
        self.reader_blocked = threading.Event()
        self.callback_done = threading.Event()

    in_callback: threading.Event | None = None  # set: a rebalance callback is running

    def consumer_group_metadata(self) -> bytes:
        # librdkafka answers only once a rebalance callback running in the group thread's
        # consume has returned.
        running = self.in_callback
        if running is not None and running.is_set():
            self.reader_blocked.set()
            self.callback_done.wait(10)
        return (b"CGMDv2:" + self.gen.to_bytes(4, sys.byteorder, signed=True) + b"g\0"
                + self.member.encode() + b"\0")

    def commit(self, offsets: list[Any], asynchronous: bool = False) -> list[Any]:
        # Sent now, with the generation and member id librdkafka has now.
        ok = self.coordinator.commit(self.gen, self.member, {
            TP(o.topic, o.partition): (o.offset, o.metadata) for o in offsets})
        pause, self.pause = self.pause, None
        if pause is not None:
            self.paused.set()
            pause.wait(10)
        error = None if ok else "UNKNOWN_MEMBER_ID"
        return [SimpleNamespace(topic=o.topic, partition=o.partition, error=error)
                for o in offsets]

    def assign(self, partitions: list[Any]) -> None:
        pass


def _error(err: Any, where: str = "") -> ck_consume.ClientError:
    return ck_consume.ClientError(ck_consume.Kind.FENCED, f"{where}{err}")


@pytest.fixture(autouse=True)
def _plain_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ck_consume, "_error", _error)


def _member(lib: Lib) -> Any:
    m = ck_consume._Member.__new__(ck_consume._Member)
    m.rebalancing = False
    m.busy_until = 0.0
    m.gate = threading.Condition()
    m.waiting = 0
    m.reading = 0
    m.closed = False
    m.commits = collections.deque()
    m.committer = None
    m.topic = RETRY
    m.c = lib
    m.assigned = set()
    return m


def _subscription(member: Any, coordinator: Coordinator) -> KafkaSubscription:
    sub = KafkaSubscription.__new__(KafkaSubscription)
    driver = SimpleNamespace(
        opts={"request_timeout_ms": 2000, "handoff_ms": 500, "max_buffered": 20000},
        url="kafka://stand-in", capabilities=SimpleNamespace(max_lease=300.0),
        committed=lambda group, tps: {tp: coordinator.offsets.get(tp) for tp in tps})
    sub.d = driver  # type: ignore[assignment]
    sub.spec = SimpleNamespace(name="g", pattern="#", lease=5.0, ordered=False)  # type: ignore[assignment]
    sub.declared_ms = 0
    sub.retry = RETRY
    sub.lock = threading.Lock()
    sub.cv = threading.Condition(sub.lock)
    sub.commit_lock = threading.Lock()
    sub.epoch = sub.moving = 0
    sub.mover = None
    sub.last_sent = None
    sub.ckpt_limit = 3000
    sub.ready = collections.deque()
    sub.held = []
    sub.leased = {}
    sub.parts = {}
    sub.suspended = {}
    sub.new_assignment = None
    sub.slots = set()
    sub.slot_version = 0
    sub.slot_gen = None
    sub.tokens = iter(range(1, 10**9))  # type: ignore[assignment]
    sub.seq = iter(range(10**9))  # type: ignore[assignment]
    sub.closed = sub.stopping = sub.group_stopping = False
    sub.waiting = 0
    sub.last_receive = time.monotonic()
    sub.paused = False
    sub.error = None
    sub.names = {}
    sub.group = member
    return sub


def _records(first: int, n: int) -> dict[TP, list[Any]]:
    return {P: [SimpleNamespace(offset=o, key=None, value=b"x", timestamp=int(time.time() * 1000),
                                headers=[(wire.ID, f"id-{o}".encode()), (wire.TOPIC, b"t")])
                for o in range(first, first + n)]}


def _assign(sub: KafkaSubscription, member: Any) -> None:
    """What the member's listener and the group thread do with an assignment of P."""
    member.rebalancing = False
    sub.assigned([P])
    sub._take_assignment()


def _settle(member: Any) -> None:
    limit = time.monotonic() + 5
    while member.waiting and time.monotonic() < limit:
        time.sleep(0.01)
    assert not member.waiting


def _close(member: Any) -> None:
    with member.gate:
        member.closed = True
        member.gate.notify_all()


def _generation_5() -> tuple[Coordinator, Lib, Any, KafkaSubscription]:
    """A member of generation 5 (member id m1), its subscription, nothing committed."""
    coordinator = Coordinator()
    coordinator.members = {(5, "m1")}
    coordinator.offsets[P] = (0, "")
    lib = Lib(coordinator)
    member = _member(lib)
    return coordinator, lib, member, _subscription(member, coordinator)


def test_a_commit_built_before_the_loss_never_lands_after_the_rejoin() -> None:
    """The chaos run's case: the woken consumer's stale commit overwrote the new owner's
    checkpoint after its rejoin, and it took its stale buffer back."""
    coordinator, lib, member, sub = _generation_5()
    try:
        # Generation 5: P is ours; 10 records fetched, 2 handed out.
        _assign(sub, member)
        sub._ingest(_records(0, 10))
        first = sub.receive(2, 1.0)
        assert [(d.id, d.attempt) for d in first] == [("id-0", 1), ("id-1", 1)]
        # Acks are committed in the background; the committer is held up after the first
        # (it lands: generation 5), the second waits in its queue.
        resume = lib.pause = threading.Event()
        sub.ack([first[0].receipt])
        sub._send_checkpoints(None)
        assert lib.paused.wait(5)
        sub.ack([first[1].receipt])
        sub._send_checkpoints(None)
        # Frozen past the session: evicted. "m2" takes P over in generation 6, hands out
        # offsets 2..9 with attempt 1 and commits its checkpoint (mark 10).
        coordinator.members = {(6, "m2")}
        lib.member = ""  # librdkafka resets the member id on UNKNOWN_MEMBER_ID
        theirs = (0, Checkpoint(10, 1, time.time() + 5).encode())
        coordinator.offsets[P] = theirs
        # Woken: the lost assignment is revoked (on_lost); the member rejoins and the group
        # settles in generation 7.
        member.rebalancing = True
        sub.revoked([P])
        coordinator.members = {(7, "m1b"), (7, "m2")}
        lib.gen, lib.member = 7, "m1b"
        resume.set()  # the queued commits go out now
        _settle(member)
        assert coordinator.offsets[P] == theirs, (
            "a commit built in generation 5 landed in generation 7 and overwrote the new "
            f"owner's checkpoint: {coordinator.offsets[P]}")
        # P is ours again in generation 7: from the new owner's checkpoint, the records
        # it handed out come back with attempt 2 at least, after its leases.
        _assign(sub, member)
        sub._ingest(_records(0, 10))
        again = sub.receive(10, 0.5)
        assert not [d for d in again if d.attempt <= 1], [(d.id, d.attempt) for d in again]
    finally:
        _close(member)


def test_a_partition_held_into_a_later_generation_is_not_handed_out() -> None:
    """The client moved to a later generation while the partition was still ours here (no
    revocation reached us): a commit now lands, but proves nothing for it."""
    coordinator, lib, member, sub = _generation_5()
    try:
        _assign(sub, member)
        sub._ingest(_records(0, 10))
        first = sub.receive(2, 1.0)
        assert len(first) == 2
        _settle(member)
        before = coordinator.offsets[P]
        coordinator.members = {(7, "m1b"), (7, "m2")}
        lib.gen, lib.member = 7, "m1b"
        late = sub.receive(10, 0.5)
        assert late == [], [(d.id, d.attempt) for d in late]
        _settle(member)
        assert coordinator.offsets[P] == before  # nothing of P committed in generation 7
    finally:
        _close(member)


def test_a_receive_that_picked_during_a_revocation_hands_nothing_out() -> None:
    """The chaos run's ``[1, 1]`` (session 23): a revocation raises the epoch, then sends
    its checkpoints, then sets the partitions aside. A receive that picked in between saw
    the raised epoch as its own, and fenced after the partition was set aside: the commit
    carried nothing for it and "succeeded", so the records were handed out while the
    next owner delivered them again with the same attempt."""
    _, _, member, sub = _generation_5()
    try:
        _assign(sub, member)
        sub._ingest(_records(0, 10))
        with sub.cv:
            sub.epoch += 1  # the revocation has begun (its first step)
        real_fence = sub._fence

        def fence_after_the_revocation(budget: float, force: Any = ()) -> None:
            with sub.cv:  # the revocation's last step lands between pick and fence
                sub._suspend([P])
            real_fence(budget, force)

        sub._fence = fence_after_the_revocation  # type: ignore[method-assign]
        handed = sub.receive(5, 0.3)
        assert handed == [], [(d.id, d.attempt) for d in handed]
        # Set aside with the partition: back if it is ours again, else its owner's.
        assert sorted(r.offset for r in sub.suspended[P][1]) == list(range(10))
    finally:
        _close(member)


def test_records_out_during_a_fresh_takeover_never_come_back() -> None:
    """Review of session 23: a receive's fence was slow; meanwhile the partition was
    revoked, another member committed, and it came back to us taken over afresh (a new
    partition state, read from that member's checkpoint). The failed receive put its
    records back because the partition was "ours": the next receive would hand them out
    with their old attempts beside the new state's own delivery of the same records."""
    coordinator, _, member, sub = _generation_5()
    try:
        _assign(sub, member)
        sub._ingest(_records(0, 10))
        real_fence = sub._fence

        def fence_across_a_takeover(budget: float, force: Any = ()) -> None:
            with sub.cv:  # revoked ...
                sub.epoch += 1
                sub._suspend([P])
            # ... another member handed offsets 0..9 out and committed its checkpoint ...
            coordinator.offsets[P] = (0, Checkpoint(10, 0, time.time() + 5).encode())
            # ... and the partition comes back to us, taken over afresh.
            assert sub._adopt([P], {P: coordinator.offsets[P]}, epoch=sub.epoch, gen=5)
            real_fence(budget, force)

        sub._fence = fence_across_a_takeover  # type: ignore[method-assign]
        assert sub.receive(5, 0.3) == []
        sub._fence = real_fence  # type: ignore[method-assign]
        fresh = sub.parts[P]
        assert all(r.part is fresh for r in sub.ready), "stale records went back"
        # The new state reads the records again: held until the other member's lease
        # ends, then delivered with attempt 2, never 1.
        sub._ingest(_records(0, 10))
        assert not [r for r in sub.ready if r.n == 0]
    finally:
        _close(member)


def test_a_membership_read_during_a_revocation_does_not_deadlock() -> None:
    """Session 23's zombie run hung 42 minutes: a receive's fence read the membership
    (librdkafka's consumer_group_metadata, which waits for a rebalance callback running in
    the group thread's consume) while holding the member's gate, and that callback, the
    revocation, waited for the gate to send its checkpoints."""
    _, lib, member, sub = _generation_5()
    try:
        _assign(sub, member)
        sub._ingest(_records(0, 10))
        assert len(sub.receive(2, 1.0)) == 2  # (a snapshot is known from here on)
        _settle(member)
        lib.in_callback = threading.Event()
        lib.in_callback.set()  # the group thread's consume is in a revocation callback
        reader = threading.Thread(target=member.group_meta, daemon=True)
        reader.start()  # a receive's fence asks for the membership meanwhile
        assert lib.reader_blocked.wait(5)

        def revocation() -> None:
            member.rebalancing = True
            sub.revoked([P])  # sends its checkpoints: takes the gate
            lib.callback_done.set()  # the callback returns: librdkafka answers the reader

        callback = threading.Thread(target=revocation, daemon=True)
        callback.start()
        callback.join(5)
        reader.join(5)
        assert not callback.is_alive(), "the revocation waited for the gate: deadlock"
        assert not reader.is_alive()
        _settle(member)
    finally:
        lib.callback_done.set()
        _close(member)


def test_the_hand_out_loop_skips_records_of_a_replaced_partition_state() -> None:
    """Receive looks a partition's state up once per run of its records: a record whose
    state is not the partition's (taken over afresh meanwhile, or none) is dropped wherever
    it sits in the run, first, inside or last, and only the others are leased and marked."""
    _, _, member, sub = _generation_5()
    try:
        _assign(sub, member)
        sub._ingest(_records(0, 10))
        part = sub.parts[P]
        old = Part((0, ""))  # a state the partition had before a fresh takeover
        with sub.cv:
            for rec in sub.ready:
                if rec.offset == 0:
                    rec.part = None
                elif rec.offset in (4, 5, 9):
                    rec.part = old
        handed = sub.receive(10, 1.0)
        assert [d.id for d in handed] == [f"id-{o}" for o in (1, 2, 3, 6, 7, 8)]
        assert sorted(r.offset for r in sub.leased.values()) == [1, 2, 3, 6, 7, 8]
        assert part.mark == 9 and not sub.ready
    finally:
        _close(member)

