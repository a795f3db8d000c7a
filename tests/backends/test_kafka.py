"""Kafka backend: interop with plain kafka-python, name mapping, a consumer killed mid-batch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

kafka = pytest.importorskip("kafka")

import mqabstract  # noqa: E402
from mqabstract import wire  # noqa: E402
from mqabstract.backends.kafka import kafka_topic_name, topic_regex  # noqa: E402
from mqabstract.backends.kafka.state import Checkpoint as _Checkpoint  # noqa: E402
from mqabstract.backends.kafka.state import Part as _Part  # noqa: E402
from mqabstract.names import topic_matches  # noqa: E402
from tests.brokers import resolve_url  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def url() -> str:
    return resolve_url("kafka")


def _bootstrap(url: str) -> list[str]:
    return [f"{h}:{p or 9092}" for h, p in mqabstract.BrokerURL.parse(url).hosts]


def test_mqabstract_publish_is_readable_by_plain_consumer(url, mq, names) -> None:
    _, root = names
    topic = f"{root}.created"
    body = bytes(range(256)) + b"\xff\xfe not utf-8"
    before = time.time()
    mid = mq.publish(topic, body, key="order-7", headers={"trace": "abc", "lang": "fr"})
    after = time.time()
    consumer = kafka.KafkaConsumer(bootstrap_servers=_bootstrap(url), group_id=None,
                                   enable_auto_commit=False)
    try:
        name = kafka_topic_name(topic)
        parts = [kafka.TopicPartition(name, p) for p in consumer.partitions_for_topic(name)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        records = []
        deadline = time.monotonic() + 15
        while not records and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    [rec] = records
    assert rec.value == body
    assert rec.key == b"order-7"
    headers = dict(rec.headers)
    assert headers["trace"] == b"abc" and headers["lang"] == b"fr"
    assert headers[wire.ID] == mid.encode()  # the wire schema, readable by any client
    # The publish time is the record's own timestamp (CreateTime, ms), not a header.
    assert [k for k in headers if k.startswith(wire.PREFIX)] == [wire.ID]
    assert rec.timestamp_type == 0
    assert int(before * 1000) <= rec.timestamp <= after * 1000


def test_plain_producer_writing_the_wire_schema(url, mq, names) -> None:
    """A plain client that writes mq-id / mq-attempt / mq-published-at is understood."""
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    producer = kafka.KafkaProducer(bootstrap_servers=_bootstrap(url), acks="all")
    try:
        producer.send(kafka_topic_name(f"{root}.wire"), value=b"w", headers=[
            (wire.ID, b"order-42"), (wire.ATTEMPT, b"2"), (wire.PUBLISHED_AT, b"1700000000.5"),
        ]).get(timeout=15)
    finally:
        producer.close()
    [msg] = sub.receive(1, 20)
    assert (msg.id, msg.attempt, msg.published_at.timestamp()) == ("order-42", 3, 1700000000.5)
    assert msg.headers == {}
    msg.ack()
    sub.close()


def test_plain_producer_reaches_mqabstract_group(url, mq, names) -> None:
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    producer = kafka.KafkaProducer(bootstrap_servers=_bootstrap(url), acks="all")
    try:
        producer.send(kafka_topic_name(f"{root}.raw"), value=b"\x00plain\xff", key=b"k1",
                      headers=[("origin", b"raw"), ("n", b"1")]).get(timeout=15)
    finally:
        producer.close()
    [msg] = sub.receive(1, 20)
    assert (msg.body, msg.key, msg.topic) == (b"\x00plain\xff", "k1", f"{root}.raw")
    assert msg.headers == {"origin": "raw", "n": "1"}
    assert msg.attempt == 1 and msg.id  # no mq-id header: the record's coordinates
    msg.ack()
    sub.close()


@pytest.mark.parametrize(
    "pattern, topic",
    [("a.*", "a.b"), ("a.#", "a"), ("#.z", "z"), ("a.#.z", "a.b-c.d_e.z"), ("x-y.*", "x-y.q"),
     ("a.*", "a"), ("a.*", "a.b.c"), ("#.z", "z.a"), ("a_b.#", "a-b"), ("a-b.#", "a--b")],
)
def test_topic_regex_agrees_with_portable_matcher(pattern: str, topic: str) -> None:
    regex = re.compile(topic_regex(pattern, "pre."))
    assert bool(regex.match(kafka_topic_name(topic, "pre."))) == topic_matches(pattern, topic)


@pytest.mark.parametrize("prefix", ["", "pre."])
@pytest.mark.parametrize("pattern, mine", [("#", "x_y"), ("*", "x_y"), ("#.offsets", "x_y.offsets"),
                                           ("#.state", "a.x_y.state"), ("a.#", "a._b")])
def test_no_wildcard_matches_internal_topics(pattern: str, mine: str, prefix: str) -> None:
    """Kafka's own topics and the driver's internal ones are never a wildcard's: each of
    these matched ``#`` before (a group on ``#`` received __consumer_offsets records),
    while a user topic with ``_`` in its words (mapped to ``-u``) still matches."""
    regex = re.compile(topic_regex(pattern, prefix))
    for name in ("__consumer_offsets", "__transaction_state", "__share_group_state",
                 "__cluster_metadata", "__mqa..r..g", "__mqa..groups", "_a", "a_b",
                 f"{prefix}__consumer_offsets", f"{prefix}a._x"):
        assert not regex.match(name), name
    assert regex.match(kafka_topic_name(mine, prefix))


def test_hash_group_reads_no_internal_topic(url, mq, names) -> None:
    """A ``#`` group next to a group that commits offsets (so the broker's
    ``__consumer_offsets`` exists and is listed) reads user topics only: the topics its
    data thread matched from the broker's own listing hold no topic of Kafka's and none of
    the driver's internal ones (``#`` matched ``__consumer_offsets`` before, and the group
    received its records). Judged on what the group reads, not on what it happens to
    receive: a shared broker holds a thousand topics a ``#`` group cannot drain in a test."""
    group, root = names
    with mq.subscribe(group, f"{root}.#") as busy:
        mq.publish(f"{root}.work", b"w")
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = busy.receive(1, 1.0)
        assert got, "the busy group received nothing"
        got[0].ack()  # an offset commit: a record in __consumer_offsets
    tap = f"{group}-tap"
    sub = mq.subscribe(tap, "#", lease=30)
    try:
        inner = sub._inner
        listed = inner.d.topic_names()
        assert "__consumer_offsets" in listed  # the listing has it: the filter is tested
        mine = kafka_topic_name(f"{root}.work")
        deadline = time.monotonic() + 30
        while mine not in inner.matched and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mine in inner.matched, "the # group never matched the user topic"
        ours = {t for t in inner.matched if t.startswith("__mqh..")}  # hashed user topics
        internal = sorted(t for t in inner.matched - ours if t.startswith("__") or ".." in t)
        assert not internal, f"a # group reads internal topics: {internal[:5]}"
    finally:
        sub.close()
        mq.delete_group(tap)


def test_long_topic_names_are_hashed_within_kafka_limit() -> None:
    topic = ".".join(["w" * 60] * 6)
    name = kafka_topic_name(topic)
    assert len(name) <= 249 and name != kafka_topic_name(topic + "x")


def test_checkpoint_round_trip() -> None:
    """The partition checkpoint travels as commit metadata; anything else reads as none."""
    ckpt = _Checkpoint(120, 2, 1700000000.5, ((100, 104), (110, 110)))
    assert _Checkpoint.decode(ckpt.encode()) == ckpt
    for foreign in (None, "", "written by a plain client", "mq1 x 0 0 ", "mqueue 1 2"):
        assert _Checkpoint.decode(foreign) == _Checkpoint()
    with pytest.raises(mqabstract.Unsupported, match="later version"):
        _Checkpoint.decode("mq3 120 2 1700000000500 100-104")  # not read as none
    steps = ckpt._replace(leases=((105, 1700000000.5), (121, 1700000003.25)))
    assert _Checkpoint.decode(steps.encode()) == steps
    assert steps.encode().startswith("mq2 ") and ckpt.encode().startswith("mq1 ")
    many = _Checkpoint(10**9, 0, 0.0, tuple((i * 3, i * 3 + 1) for i in range(5000)))
    text = many.encode()
    assert len(text) < 4096  # Apache Kafka's default offset.metadata.max.bytes
    kept = _Checkpoint.decode(text).done
    assert kept and kept == many.done[: len(kept)]  # a prefix: the rest is redelivered


def _part(committed: int, ckpt: _Checkpoint) -> _Part:
    return _Part((committed, ckpt.encode()))


def test_takeover_gives_one_attempt_more_than_any_earlier_owner() -> None:
    """Owner 1 handed out records up to offset 49 and died with 40 committed; owner 2
    adds 1 to their attempts and holds them until owner 1's last lease deadline. Owner 2
    commits a prefix (44) and dies too: owner 3 adds 2 (the count used to restart when the
    committed offset moved, giving attempts [1, 2, 2, 3])."""
    second = _part(40, _Checkpoint(50, 0, 1700000005.0, ((45, 46),)))
    assert (second.inherited, second.bump, second.hold) == (50, 1, 1700000005.0)
    assert {45, 46} <= second.done  # settled by owner 1: never delivered again
    assert _part(44, _Checkpoint(50, 1, 1700000005.0)).bump == 2
    settled = _part(50, _Checkpoint(50, 2, 1700000005.0))  # all handed out was committed
    assert (settled.inherited, settled.bump, settled.hold) == (0, 0, 0.0)
    fresh = _Part(None)
    assert (fresh.committed, fresh.mark, fresh.bump) == (None, 0, 0)


def test_checkpoint_of_a_partition() -> None:
    part = _part(10, _Checkpoint(12, 0, 1700000005.0))
    for offset in range(10, 16):
        part.fetched(offset)
    part.done.update({10, 11, 13})
    part.mark = 14
    point, meta = part.checkpoint()
    assert point == 12  # the contiguous settled prefix
    # (the inherited lease covered offsets below 12, all settled now: no deadline left)
    assert _Checkpoint.decode(meta) == _Checkpoint(14, 1, 0.0, ((13, 13),))


def test_the_checkpoint_a_transaction_commits_changes_nothing() -> None:
    """``checkpoint(settle=...)``: the checkpoint committed in the transaction that writes
    the copies of ``settle`` (their originals settled); the partition's own state stays as
    it was until that transaction commits (it may be aborted)."""
    part = _part(10, _Checkpoint(12, 0, 1700000005.0))
    for offset in range(10, 16):
        part.fetched(offset)
    part.done.update({10, 13})
    part.mark = 16
    before = part.checkpoint()
    point, meta = part.checkpoint(settle={11, 15})
    assert point == 12  # 10 settled, 11 settled by the transaction, 12 still leased
    assert _Checkpoint.decode(meta).done == ((13, 13), (15, 15))
    assert part.checkpoint() == before and part.done == {13}  # (10 left the order)
    part.done.update({12, 14})
    assert part.checkpoint(settle={11, 15})[0] == 16


def test_a_copy_possibly_written_by_a_frozen_holder_never_shares_its_attempt() -> None:
    """Checkpoints written before re-publishes were transactions list offsets as moving:
    owner 1 handed out offset 12 (attempt 1), its lease ran out, it committed the fence
    listing 12 as moving, then froze before (or after) writing the copy with attempt 2, and
    woke after owner 2 took over. Owner 2 delivers the original with attempt 3, above the
    copy's, and keeps 12 as moving for owner 3, who goes higher still; a chaos run once saw
    attempt 2 twice here. A moving offset already committed as done is simply skipped."""
    first = _Part((10, ""))  # a first owner: nothing inherited
    for offset in range(10, 16):
        first.fetched(offset)
    first.mark = 14
    first.moving.add(12)
    _, meta = first.checkpoint()
    assert _Checkpoint.decode(meta).moving == ((12, 12),)
    second = _Part((10, meta))
    copy_attempt = 0 + 1 + 1  # stored attempts 0, delivered as 1, copy written with 1 more
    assert 0 + second.extra_attempts(12) + 1 > copy_attempt
    assert second.extra_attempts(11) == second.bump == 1
    for offset in range(10, 16):
        second.fetched(offset)
    _, meta2 = second.checkpoint()
    third = _Part((10, meta2))
    assert third.extra_attempts(12) > second.extra_attempts(12)
    first.done.add(12)  # the copy landed and the original was marked done
    _, meta3 = first.checkpoint()
    assert _Checkpoint.decode(meta3).moving == () and 12 in _Part((10, meta3)).done


def _leased(part: _Part, offsets: range, until: float) -> None:
    """One receive: ``offsets`` handed out with one lease."""
    for offset in offsets:
        part.lease(offset, until)


def test_an_inherited_record_waits_for_its_own_lease_not_the_newest() -> None:
    """Session 23's chaos runs: a killed holder's records waited for the partition's newest
    lease, which every owner in a churning group pushed later (attempt 1, then 5, 8 or 9
    more than 9 s after its lease). Each record now waits for the last lease on its step."""
    t = 1700000000.0
    first = _Part((10, ""))
    for offset in range(10, 40):
        first.fetched(offset)
    _leased(first, range(10, 15), t + 5)  # the killed holder's receive
    _leased(first, range(15, 20), t + 8)
    _leased(first, range(20, 25), t + 12)
    _, meta = first.checkpoint()
    assert _Checkpoint.decode(meta).leases == ((15, t + 5), (20, t + 8), (25, t + 12))
    second = _Part((10, meta))
    assert [second.hold_for(o) for o in (12, 17, 22)] == [t + 5, t + 8, t + 12]
    # The second owner hands out new records and one inherited record (12) again; its
    # successor still holds 10..14 only until t + 5, but 12 until its new lease.
    for offset in range(10, 40):
        second.fetched(offset)
    _leased(second, range(25, 30), t + 20)
    second.lease(12, t + 30)
    _, meta2 = second.checkpoint()
    third = _Part((10, meta2))
    assert [third.hold_for(o) for o in (10, 11, 12, 13, 14, 17, 27)] == [
        t + 5, t + 5, t + 30, t + 5, t + 5, t + 8, t + 20]
    assert third.bump == 2 and third.inherited == 30


def test_lease_steps_stay_few_and_never_shorten_a_lease() -> None:
    """Hundreds of receives keep at most ``LEASE_STEPS`` steps: neighbours with the closest
    deadlines merge (with the later one), so an old lone lease keeps its own deadline,
    and no record's recorded lease is ever below the one it was given."""
    from mqabstract.backends.kafka.state import LEASE_STEPS

    t = 1700000000.0
    part = _Part((0, ""))
    given: dict[int, float] = {}
    for n in range(300):
        until = t + 5 if n == 0 else t + 100 + n * 0.05
        for offset in range(n * 3, n * 3 + 3):
            part.fetched(offset)
            part.lease(offset, until)
            given[offset] = until
    part.lease(100, t + 500)  # an extend in the middle
    given[100] = t + 500
    assert len(part.ends) <= LEASE_STEPS
    assert all(part.lease_of(o) >= until for o, until in given.items())
    assert part.lease_of(0) == t + 5  # the killed holder's lone lease is kept as it was
    _, meta = part.checkpoint()
    assert len(meta) < 4096 and _Checkpoint.decode(meta).leases


def test_lease_many_is_lease_for_each() -> None:
    """What receive uses: ``Part.lease_many`` leaves a partition exactly as ``lease`` for
    each offset in turn, runs, gaps, records handed out again and extends among them."""
    t = 1700000000.0
    one, many = _Part((0, "")), _Part((0, ""))
    batches = [([0, 1, 2, 3], t + 10), ([4, 5, 9, 10], t + 11), ([2, 3, 11], t + 12),
               ([12], t + 9), ([13, 14], t + 9), ([1], t + 30)]
    batches += [(list(range(20 + 5 * n, 23 + 5 * n)), t + 40 + n * (-1) ** n)
                for n in range(30)]
    for offsets, until in batches:
        for offset in offsets:
            one.lease(offset, until)
        many.lease_many(offsets, until)
        assert (many.ends, many.untils, many.mark) == (one.ends, one.untils, one.mark)


def test_fetched_many_is_fetched_for_each() -> None:
    """What ``_ingest`` uses: one fetch's run of offsets, as ``fetched`` for each."""
    one, many = _Part((0, "")), _Part((0, ""))
    for run in ([0, 1, 2], [3], [7, 8, 10]):
        for offset in run:
            one.fetched(offset)
        many.fetched_many(run)
        assert (list(many.order), many.next_fetch) == (list(one.order), one.next_fetch)


def test_settled_steps_leave_the_checkpoint_and_closing_gives_leases_up() -> None:
    t = 1700000000.0
    part = _Part((0, ""))
    for offset in range(0, 20):
        part.fetched(offset)
    _leased(part, range(0, 10), t + 5)
    _leased(part, range(10, 20), t + 9)
    part.done.update(range(0, 10))
    point, meta = part.checkpoint()
    assert point == 10 and _Checkpoint.decode(meta).leases == ((20, t + 9),)
    part.release()
    _, meta = part.checkpoint()
    ckpt = _Checkpoint.decode(meta)
    assert (ckpt.deadline, ckpt.leases) == (0.0, ())
    assert _Part((10, meta)).hold_for(15) == 0.0  # the next owner delivers at once


def test_closing_gives_up_our_leases_not_the_inherited_ones() -> None:
    """A owner that closes gives its own leases up, not those of an earlier owner it
    inherited (a frozen holder's lease may still run: its next owner must wait)."""
    t = 1700000000.0
    first = _Part((10, ""))
    for offset in range(10, 20):
        first.fetched(offset)
    _leased(first, range(10, 15), t + 30)  # a long lease of a holder that froze
    _, meta = first.checkpoint()
    second = _Part((10, meta))
    for offset in range(10, 30):
        second.fetched(offset)
    _leased(second, range(15, 25), t + 8)
    second.release()
    _, meta2 = second.checkpoint()
    third = _Part((10, meta2))
    assert [third.hold_for(o) for o in (12, 17, 22)] == [t + 30, 0.0, 0.0]


def test_holds_follow_the_inherited_steps_and_older_checkpoints() -> None:
    """Holds come from the steps as inherited, not from what settles pruned since (the
    partition's newest deadline came back when the step list emptied); a checkpoint
    without steps holds every inherited record until its deadline, also after the new
    owner leased records of its own."""
    t = 1700000000.0
    first = _Part((10, ""))
    for offset in range(10, 20):
        first.fetched(offset)
    _leased(first, range(10, 15), t + 5)
    first.lease(10, t + 60)  # an extend
    first.done.add(10)
    first.mark = 20  # 15..19 handed off: no lease
    _, meta = first.checkpoint()
    second = _Part((11, meta))
    for offset in range(11, 20):
        second.fetched(offset)
    second.done.update({11, 12, 13, 14})
    second.checkpoint()  # prunes the settled steps
    assert second.hold_for(16) == 0.0
    old = _Part((10, _Checkpoint(20, 0, t + 100).encode()))  # mq1: one deadline
    for offset in range(10, 30):
        old.fetched(offset)
    old.lease(25, t + 50)
    _, meta3 = old.checkpoint()
    assert _Part((10, meta3)).hold_for(3 + 10) == t + 100


def test_lease_steps_give_way_when_the_broker_keeps_little_metadata() -> None:
    """Halving the metadata limit (a broker with a small offset.metadata.max.bytes) cuts
    the steps down to one with the latest deadline, never shorter, so commits fit."""
    t = 1700000000.0
    part = _Part((0, ""))
    for n in range(16):
        part.fetched(n)
        part.lease(n, t + n * 7)
    _, meta = part.checkpoint(limit=50)
    assert len(meta) <= 50 + 40
    assert _Checkpoint.decode(meta).leases == ((16, t + 105),)


def test_moving_offsets_survive_a_full_checkpoint() -> None:
    many = _Checkpoint(10**9, 0, 0.0, tuple((i * 3, i * 3 + 1) for i in range(5000)),
                       ((7, 9),))
    assert _Checkpoint.decode(many.encode()).moving == ((7, 9),)
    assert len(many.encode()) < 4096


_VICTIM = textwrap.dedent(
    """
    import os, signal, sys, time
    import mqabstract
    url, group, pattern, LEASE = *sys.argv[1:4], float(sys.argv[4])
    broker = mqabstract.connect(url)
    sub = broker.subscribe(group, pattern, lease=LEASE)
    print("READY", flush=True)
    got = []
    for _ in range(600):
        started = time.monotonic()
        got += sub.receive(50, 0.2)
        if got:
            break
    print("RECVAT", repr(started), flush=True)
    for msg in got:
        print("GOT", msg.id, flush=True)
    for msg in got[: len(got) // 2]:
        msg.ack()
        print("ACKED", msg.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-batch: the other half is never settled
    """
)


VICTIM_LEASE = 5.0


def test_consumer_killed_mid_batch_loses_nothing(url, mq, names) -> None:
    """The victim's unsettled messages come back after its lease (the survivors cannot
    tell a dead holder from a frozen one), within the declared margin, with attempt 2."""
    group, root = names
    pattern = f"{root}.#"
    mq.declare(group, pattern, lease=VICTIM_LEASE)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    victim = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, url, group, pattern, str(VICTIM_LEASE)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert victim.stdout is not None
        for line in victim.stdout:
            lines.append(line.strip())
            if line.startswith("READY"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert ready.wait(60), victim.stderr.read() if victim.stderr else ""
    brokers = [mqabstract.connect(url) for _ in range(2)]
    try:
        survivors = [b.subscribe(group, pattern, lease=VICTIM_LEASE) for b in brokers]
        ids = set(mq.publish_batch(
            [{"topic": f"{root}.k", "body": f"{i}", "key": f"k{i}"} for i in range(300)]))
        acked: set[str] = set()
        first: dict[str, tuple[float, int]] = {}  # id -> (arrival, attempt) at a survivor
        lock = threading.Lock()
        stop = threading.Event()

        def work(sub: mqabstract.Subscription) -> None:
            while not stop.is_set():
                for msg in sub.receive(50, 0.5):
                    with lock:
                        first.setdefault(msg.id, (time.monotonic(), msg.attempt))
                    msg.ack()
                    with lock:
                        acked.add(msg.id)

        threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in survivors]
        for t in threads:
            t.start()
        assert victim.wait(60) == -signal.SIGKILL, victim.stderr.read() if victim.stderr else ""
        reader.join(10)
        got = {ln.split()[1] for ln in lines if ln.startswith("GOT ")}
        victim_acked = {ln.split()[1] for ln in lines if ln.startswith("ACKED ")}
        assert got and got - victim_acked, "the victim must die holding unsettled messages"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                if ids <= acked | victim_acked and got - victim_acked <= acked:
                    break
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(10)
        assert not ids - acked - victim_acked, f"lost {len(ids - acked - victim_acked)}"
        assert not (got - victim_acked) - acked, "the victim's unsettled messages came back"
        started = next(float(ln.split()[1]) for ln in lines if ln.startswith("RECVAT "))
        back = {m: (round(first[m][0] - started, 2), first[m][1]) for m in got - victim_acked}
        margin = mq.capabilities.release_margin
        assert all(VICTIM_LEASE <= t <= VICTIM_LEASE + margin for t, _ in back.values()), back
        assert all(attempt >= 2 for _, attempt in back.values()), back
        for sub in survivors:
            sub.close()
    finally:
        if victim.poll() is None:
            victim.kill()
        for b in brokers:
            b.close()


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_consumer_beyond_partitions_is_an_idle_standby(url, client) -> None:
    """A group admits ``max_consumers_per_group`` (= ``partitions``) active consumers: with
    one partition, one of two consumers gets everything and the other nothing, and that
    one takes over when the active one leaves (documented: an idle standby, no error)."""
    sep = "&" if "?" in url else "?"
    with mqabstract.connect(f"{url}{sep}client={client}&partitions=1") as mq:
        assert mq.capabilities.max_consumers_per_group == 1
        token = "s" + os.urandom(4).hex()
        group, pattern, topic = f"standby-{token}", f"sb.{token}.#", f"sb.{token}.x"
        try:
            mq.declare(group, pattern)
            subs = [mq.subscribe(group, pattern), mq.subscribe(group, pattern)]
            mq.publish_batch([(topic, f"m{i}".encode()) for i in range(20)])
            got: list[list[str]] = [[], []]
            deadline = time.monotonic() + 30
            while sum(map(len, got)) < 20 and time.monotonic() < deadline:
                for i, sub in enumerate(subs):
                    for msg in sub.receive(20, 0.2):
                        got[i].append(msg.body.decode())
                        msg.ack()
            assert sorted(got[0] + got[1]) == sorted(f"m{i}" for i in range(20))
            assert [] in got, f"both consumers were active: {got}"
            active = 0 if got[0] else 1
            standby = subs[1 - active]
            subs[active].close()
            mq.publish(topic, b"after")
            late: list[str] = []
            deadline = time.monotonic() + 30
            while not late and time.monotonic() < deadline:
                for msg in standby.receive(5, 0.5):
                    late.append(msg.body.decode())
                    msg.ack()
            assert late == ["after"], "the standby did not take over"
            standby.close()
        finally:
            mq.delete_group(group)


def test_plain_confluent_kafka_reads_and_writes_the_wire_schema(url, mq, names) -> None:
    """The wire schema both ways with plain confluent-kafka (librdkafka), as with
    kafka-python above: it reads mqabstract's headers; a record it writes with mq-id /
    mq-attempt / mq-published-at is understood."""
    ck = pytest.importorskip("confluent_kafka")
    group, root = names
    bootstrap = ",".join(_bootstrap(url))
    before = time.time()
    mid = mq.publish(f"{root}.out", b"to plain", key="k9", headers={"trace": "t1"})
    after = time.time()
    name = kafka_topic_name(f"{root}.out")
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": f"plain-{root}",
                            "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([name])
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg)
    finally:
        consumer.close()
    [rec] = got
    headers = dict(rec.headers())
    assert (rec.value(), rec.key(), headers["trace"]) == (b"to plain", b"k9", b"t1")
    assert headers[wire.ID] == mid.encode()
    assert [k for k in headers if k.startswith(wire.PREFIX)] == [wire.ID]
    kind, stamp = rec.timestamp()
    assert kind == ck.TIMESTAMP_CREATE_TIME and int(before * 1000) <= stamp <= after * 1000

    sub = mq.subscribe(group, f"{root}.#")
    producer = ck.Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    producer.produce(kafka_topic_name(f"{root}.in"), b"from plain", b"k3", headers=[
        (wire.ID, b"order-43"), (wire.ATTEMPT, b"1"), (wire.PUBLISHED_AT, b"1700000001.25"),
        ("origin", b"librdkafka")])
    assert producer.flush(15) == 0
    [msg] = sub.receive(1, 20)
    assert (msg.id, msg.attempt, msg.body, msg.key) == ("order-43", 2, b"from plain", "k3")
    assert msg.published_at.timestamp() == 1700000001.25
    assert msg.headers == {"origin": "librdkafka"}
    msg.ack()
    sub.close()


def _wedged_reader_is_replaced(url: str, names: tuple[str, str], monkeypatch: Any,
                               wedge: Callable[[Any], None],
                               meanwhile: Callable[[Any, Any], None] | None = None) -> None:
    """A subscription's data consumer, once it read one record, is wedged by ``wedge``
    behind the subscription's back (``meanwhile`` then sees the subscription and the wedged
    consumer): the five records written after must still arrive, read by a new data
    consumer. The stall check's idle time is cut from 10 s to 2 s."""
    from mqabstract.backends.kafka import sub_reader

    monkeypatch.setattr(sub_reader, "_STALL_AFTER", 2.0)
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client=confluent") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=30)
        first = mq.publish(f"{root}.a", b"before")
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = sub.receive(1, 1.0)
        assert [m.id for m in got] == [first]
        got[0].ack()
        inner = sub._inner
        wedged = inner.data
        wedge(wedged)
        later = [mq.publish(f"{root}.a", f"after {i}".encode()) for i in range(5)]
        if meanwhile is not None:
            meanwhile(inner, wedged)
        seen: list[str] = []
        deadline = time.monotonic() + 45
        while len(seen) < 5 and time.monotonic() < deadline:
            for msg in sub.receive(5, 1.0):
                seen.append(msg.id)
                msg.ack()
        assert sorted(seen) == sorted(later)
        assert inner.data is not wedged


def test_a_data_consumer_that_stops_fetching_is_replaced(url, names, monkeypatch) -> None:
    """librdkafka's group-less data consumer once fetched nothing after a broker restart,
    silently (CI, test_broker_restart). Stopped here with its partitions paused inside
    librdkafka; our code is not told."""
    _wedged_reader_is_replaced(url, names, monkeypatch,
                               lambda r: r.c.pause(r.c.assignment()))


def _all_brokers_down(tps: object, timeout: float | None = None) -> dict:
    from confluent_kafka import KafkaError, KafkaException

    from mqabstract.backends.kafka.ck_base import classify

    raise classify(KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN)))


def _cut_off(reader: Any) -> None:
    """What a whole-cluster restart left of librdkafka's data consumer (fault sitting, 27
    Nov): it fetched nothing and failed every request with ``_ALL_BROKERS_DOWN`` for over
    a minute while the brokers were up."""
    reader.c.pause(reader.c.assignment())
    reader.end_offsets = _all_brokers_down


def test_a_data_consumer_cut_off_from_every_broker_is_replaced(url, names, monkeypatch
                                                                ) -> None:
    """The stall check asked that same consumer for end offsets, so it could never act (28
    confirmed ids undelivered): a new consumer that can reach the brokers must take over."""
    _wedged_reader_is_replaced(url, names, monkeypatch, _cut_off)


def test_while_no_consumer_reaches_the_brokers_the_data_consumer_is_kept(
        url, names, monkeypatch) -> None:
    """Brokers away for every consumer: each new one the check asks is closed, the data
    consumer is kept, and new ones are asked ever more rarely (a back-off, not one per
    round); once a new one can read, it takes over."""
    made: list[Any] = []

    def meanwhile(inner: Any, wedged: Any) -> None:
        real = inner.d.client.reader

        def unreachable(settings: Any) -> Any:
            reader = real(settings)
            reader.end_offsets = _all_brokers_down
            made.append(reader)
            return reader

        monkeypatch.setattr(inner.d.client, "reader", unreachable)
        time.sleep(9.0)  # idle from 2 s; a round each second; asked first at the 2nd failure
        assert inner.data is wedged
        # Without the back-off one per round from about 3 s: 6 or more.
        assert 1 <= len(made) <= 3, len(made)
        deadline = time.monotonic() + 10
        while any(r.c is not None and not _closed(r) for r in made) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_closed(r) for r in made)
        monkeypatch.setattr(inner.d.client, "reader", real)

    _wedged_reader_is_replaced(url, names, monkeypatch, _cut_off, meanwhile)


def _closed(reader: Any) -> bool:
    """Whether librdkafka's consumer under ``reader`` was closed."""
    try:
        reader.c.assignment()
    except RuntimeError:  # "Consumer closed"
        return True
    return False


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_full_buffer_stops_fetching_and_a_drained_one_resumes(url, client) -> None:
    """Over ``max_buffered`` the data thread stops polling its reader (it does not pause
    partitions: librdkafka would discard its prefetch) and polls again once receives took
    the buffer to half: every record arrives, the reader is never polled while the buffer
    is full, and the buffer never holds much more than the limit."""
    sep = "&" if "?" in url else "?"
    limit, n = 50, 3000
    with mqabstract.connect(f"{url}{sep}client={client}&max_buffered={limit}") as mq:
        token = "b" + os.urandom(4).hex()
        group, topic = f"buffer-{token}", f"bp.{token}.x"
        try:
            mq.declare(group, topic)
            ids = mq.publish_batch([(topic, f"m{i}".encode()) for i in range(n)])
            with mq.subscribe(group, topic) as sub:
                inner = sub._inner
                reader, polls_while_full = inner.data, []

                def poll(timeout: float, max_records: int, real=reader.poll):
                    if inner.paused:
                        polls_while_full.append(len(inner.ready))
                    return real(timeout, max_records)

                reader.poll = poll
                seen: list[str] = []
                most, stopped = 0, False
                deadline = time.monotonic() + 60
                while len(seen) < n and time.monotonic() < deadline:
                    time.sleep(0.05)  # let the data thread fill the buffer meanwhile
                    with inner.cv:
                        most = max(most, len(inner.ready) + len(inner.held))
                    stopped = stopped or inner.paused
                    got = sub.receive(200, 1.0)
                    seen += [m.id for m in got]
                    sub.ack_many(got)
                assert inner.data is reader  # (no reader renewal hid a poll)
            assert sorted(seen) == sorted(ids)
            assert stopped, "the buffer never reached max_buffered"
            assert polls_while_full == []
            # One poll (up to 1,000 records) may land on top of a buffer just under the limit.
            assert most <= limit + 1000
        finally:
            mq.delete_group(group)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_backlog_of_delayed_records_does_not_stop_undelayed_ones(url, client) -> None:
    """Delayed records wait in memory until due; more of them than ``max_buffered`` must
    not stop the records published after them (they count against a bound ten times
    larger: before, an hour's delay on 10,000 records stopped the consumer for an hour)."""
    sep = "&" if "?" in url else "?"
    limit = 50
    with mqabstract.connect(f"{url}{sep}client={client}&max_buffered={limit}") as mq:
        token = "d" + os.urandom(4).hex()
        group, topic = f"delayed-{token}", f"dl.{token}.x"
        try:
            mq.declare(group, topic)
            mq.publish_batch([mqabstract.OutgoingMessage(topic, b"later", delay=120)
                              for _ in range(4 * limit)])
            with mq.subscribe(group, topic) as sub:
                inner = sub._inner
                deadline = time.monotonic() + 30
                while len(inner.held) < 4 * limit and time.monotonic() < deadline:
                    assert sub.receive(1, 0.2) == []
                assert len(inner.held) == 4 * limit
                now = {mq.publish(topic, f"now {i}".encode()) for i in range(5)}
                seen: set[str] = set()
                deadline = time.monotonic() + 20
                while len(seen) < 5 and time.monotonic() < deadline:
                    got = sub.receive(5, 1.0)
                    seen |= {m.id for m in got}
                    sub.ack_many(got)
                assert seen == now
        finally:
            mq.delete_group(group)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_session_below_the_brokers_minimum_is_an_invalid_argument(url, client) -> None:
    """The broker refuses a consumer session under ``group.min.session.timeout.ms`` (1000 on
    the test brokers, 6000 on a stock one): ``subscribe`` raises InvalidArgument naming the
    option, never a raw client error or a group that silently never joins."""
    sep = "&" if "?" in url else "?"
    bad = f"{url}{sep}client={client}&session_timeout_ms=500&heartbeat_interval_ms=100"
    with mqabstract.connect(bad) as mq:
        token = "s" + os.urandom(4).hex()
        group = f"short-{token}"
        try:
            with pytest.raises(mqabstract.InvalidArgument, match="session_timeout_ms"):
                mq.subscribe(group, f"ss.{token}.x").close()
        finally:
            mq.delete_group(group)


def test_buffer_options_out_of_range_are_refused_at_connect(url) -> None:
    sep = "&" if "?" in url else "?"
    for option, bad in (("prefetch_kbytes", 0), ("prefetch_kbytes", 2_097_152),
                        ("max_buffered", 0)):
        with pytest.raises(mqabstract.InvalidArgument, match=option):
            mqabstract.connect(f"{url}{sep}{option}={bad}")


# -- replication of the topics the driver creates -------------------------------------------
from mqabstract.backends.kafka.client import ClientError, Created, Kind  # noqa: E402
from mqabstract.backends.kafka.driver import (  # noqa: E402
    AUTO,
    BROKER_DEFAULT,
    replication_plan,
)


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 2)),
                                                    (5, (3, 2))])
def test_default_replication_follows_the_cluster_size(brokers, expected) -> None:
    """min(3, n) replicas, min.insync.replicas replication - 1 within 1..2: from three
    brokers on a confirmed record is on two of them and one broker may fail."""
    assert replication_plan(brokers) == expected
    assert replication_plan(brokers, AUTO, AUTO) == expected


@pytest.mark.parametrize("brokers", [1, 2, 3, 5])
def test_explicit_replication_options_win(brokers) -> None:
    assert replication_plan(brokers, 2, AUTO) == (2, 1)  # min ISR follows the explicit count
    assert replication_plan(brokers, 5, AUTO) == (5, 2)
    assert replication_plan(brokers, 3, 3) == (3, 3)
    assert replication_plan(brokers, 1, AUTO) == (1, 1)
    assert replication_plan(brokers, AUTO, 1) == (min(3, brokers), 1)
    assert replication_plan(brokers, BROKER_DEFAULT, AUTO) == (-1, None)  # all the broker's
    assert replication_plan(brokers, BROKER_DEFAULT, BROKER_DEFAULT) == (-1, None)
    assert replication_plan(brokers, BROKER_DEFAULT, 2) == (-1, 2)
    assert replication_plan(brokers, 3, BROKER_DEFAULT) == (3, None)


def test_min_insync_replicas_above_the_replication_is_refused() -> None:
    with pytest.raises(ValueError, match="min_insync_replicas=2"):
        replication_plan(1, AUTO, 2)  # one broker: 1 replica, never 2 in sync
    with pytest.raises(ValueError, match="min_insync_replicas=4"):
        replication_plan(5, 3, 4)


def test_replication_options_out_of_range_are_refused_at_connect(url) -> None:
    sep = "&" if "?" in url else "?"
    for query, name in (("replication_factor=-2", "replication_factor"),
                        ("min_insync_replicas=-3", "min_insync_replicas"),
                        ("replication_factor=2&min_insync_replicas=3", "min_insync_replicas")):
        with pytest.raises(mqabstract.InvalidArgument, match=name):
            mqabstract.connect(f"{url}{sep}{query}")


class _ClusterAdmin:
    """The driver's admin as a cluster of ``brokers`` would answer: records what it was asked
    to create; topics in ``existing`` exist with ``existing[name]`` replicas."""

    def __init__(self, real, brokers: int, existing: dict[str, int]) -> None:
        self.real, self.brokers, self.existing = real, brokers, existing
        self.created: list[tuple[list[str], int, int, dict[str, str]]] = []
        self.described: list[list[str]] = []

    def cluster_size(self) -> int:
        return self.brokers

    def create_topics(self, names, partitions, replication, configs):
        self.created.append((list(names), partitions, replication, dict(configs)))
        return {n: Created.EXISTED if n in self.existing else Created.NEW for n in names}

    def replication(self, names):
        self.described.append(list(names))
        return {n: self.existing[n] for n in names if n in self.existing}

    def unready(self, names):
        return {}  # (nothing is created: the "new" topics are simulated)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_topics_on_a_cluster_and_single_replica_ones_reported_once(url, client, caplog
                                                                    ) -> None:
    """On a (simulated) three-broker cluster the driver creates every topic it needs (data,
    retry, dead-letter, registry) with replication 3 and min.insync.replicas 2; an existing
    topic with one replica is warned about once per driver; explicit options win."""
    import logging

    sep = "&" if "?" in url else "?"
    token = "q" + os.urandom(4).hex()
    old, fine = f"rq.{token}.old", f"rq.{token}.fine"
    with mqabstract.connect(f"{url}{sep}client={client}") as mq:
        driver = mq._driver
        names = {t: driver.topic(t) for t in (old, fine)}
        fake = _ClusterAdmin(driver.admin, 3, {names[old]: 1, names[fine]: 3})
        driver._admin_c = fake
        with caplog.at_level(logging.WARNING, "mqabstract.kafka"):
            driver.ensure_topics([names[old], names[fine], "rq-new"])
            driver._known.clear()  # asked again (another publish path): no second report
            driver.ensure_topics([names[old]])
            driver.declare(mqabstract.GroupSpec(f"rq-{token}", f"rq.{token}.#"))
        reports = [r for r in caplog.records if "has replication 1" in r.getMessage()]
        assert len(reports) == 1, caplog.text
        assert repr(names[old]) in reports[0].getMessage()
        assert "cluster of 3 brokers" in reports[0].getMessage()
        assert all(r.levelno == logging.WARNING for r in reports)
        created = {n for names_, *_ in fake.created for n in names_}
        assert {driver.retry_topic(f"rq-{token}"), driver.dead_topic(f"rq-{token}")} <= created
        assert any(n.startswith("__mqa") and "groups" in n for n in created), created
        for _names, _parts, replication, configs in fake.created:
            assert (replication, configs["min.insync.replicas"]) == (3, "2"), fake.created
        driver._admin_c = fake.real
    with mqabstract.connect(f"{url}{sep}client={client}&replication_factor=1") as mq:
        driver = mq._driver
        fake = _ClusterAdmin(driver.admin, 3, {names[old]: 1})
        driver._admin_c = fake
        caplog.clear()
        with caplog.at_level(logging.WARNING, "mqabstract.kafka"):
            driver.ensure_topics([names[old], "rq-new"])
        assert not caplog.records, "asked for one replica: not reported"
        assert fake.created[0][2:] == (1, {"min.insync.replicas": "1"})
        driver._admin_c = fake.real
    with mqabstract.connect(f"{url}{sep}client={client}") as mq:
        driver = mq._driver
        fake = _ClusterAdmin(driver.admin, 3, {})

        def unanswered() -> int:  # a broker without DescribeCluster
            raise ClientError(Kind.OTHER, "UnsupportedVersion")

        fake.cluster_size = unanswered
        driver._admin_c = fake
        caplog.clear()
        with caplog.at_level(logging.WARNING, "mqabstract.kafka"):
            driver.ensure_topics(["rq-new"])
        assert fake.created[0][2:] == (-1, {}), "the broker's defaults, not a failed publish"
        assert "cannot be read" in caplog.text
        driver._admin_c = fake.real
    with mqabstract.connect(f"{url}{sep}client={client}&replication_factor=-1"
                            "&min_insync_replicas=-1") as mq:
        driver = mq._driver
        fake = _ClusterAdmin(driver.admin, 5, {})
        driver._admin_c = fake
        driver.ensure_topics(["rq-new"])
        assert fake.created[0][2:] == (-1, {}), "the broker's defaults: nothing set"
        driver._admin_c = fake.real


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_producer_is_idempotent_with_acks_all(url, client) -> None:
    """What "confirmed" rests on: every in-sync replica acknowledged (acks=all), and a
    retried send is not written twice (idempotence)."""
    sep = "&" if "?" in url else "?"
    with mqabstract.connect(f"{url}{sep}client={client}") as mq:
        producer = mq._driver.producer
        if client == "confluent":
            assert producer.cfg["acks"] == "all"
            assert producer.cfg["enable.idempotence"] is True
        else:
            assert producer.p.config["acks"] in ("all", -1)
            assert producer.p.config["enable_idempotence"] is True


def test_capabilities_say_what_a_confirmed_publish_survives(url) -> None:
    sep = "&" if "?" in url else "?"
    with mqabstract.connect(url) as mq:
        assert "any one broker" in mq.capabilities.confirmed_survives
    with mqabstract.connect(f"{url}{sep}replication_factor=5") as mq:  # min ISR derived: 2
        assert "when 2 in-sync replicas" in mq.capabilities.confirmed_survives
    with mqabstract.connect(f"{url}{sep}replication_factor=-1&min_insync_replicas=-1") as mq:
        assert "broker's defaults" in mq.capabilities.confirmed_survives


@pytest.mark.parametrize("code", ["_DESTROY_BROKER", "FENCED_LEADER_EPOCH",
                                  "UNKNOWN_LEADER_EPOCH", "OFFSET_NOT_AVAILABLE"])
def test_broker_errors_that_pass_are_transient(code: str) -> None:
    """librdkafka fails a request to a broker handle it decommissioned (a node gone from
    the metadata) with ``_DESTROY_BROKER``, and an offsets request with stale metadata
    after a leader change with ``FENCED_LEADER_EPOCH`` (not flagged retriable): a data
    consumer that took either for fatal stopped for good (CI rehearsal, 27 Nov: a cluster
    leader SIGKILLed; session 22's sitting: a paused container broker)."""
    ck = pytest.importorskip("confluent_kafka")
    from mqabstract.backends.kafka.ck_base import classify

    err = classify(ck.KafkaException(ck.KafkaError(getattr(ck.KafkaError, code))))
    assert err.kind is Kind.TRANSIENT and err.retriable


def test_patience_retries_unknown_broker_errors_for_a_while_only() -> None:
    from mqabstract.backends.kafka.errors import Patience

    p = Patience(0.05)
    unknown = ClientError(Kind.OTHER, "x", broker=True)
    fatal = ClientError(Kind.FATAL, "y", broker=True)
    internal = ClientError(Kind.OTHER, "AssertionError: in the client's own code")
    assert p.retry(ClientError(Kind.TRANSIENT, "z")) and p.retry(unknown)
    assert not p.retry(fatal) and not p.retry(ValueError("a bug"))
    assert not p.retry(internal)
    time.sleep(0.06)
    assert not p.retry(unknown)  # a run of unknown errors as long as the limit: stop
    p.ok()
    assert p.retry(unknown)  # a success ended the run


def test_a_data_consumer_rides_out_unknown_broker_errors(url, names, monkeypatch) -> None:
    """The data thread retries after broker errors the classifier does not know for up to
    a minute (``Patience``); it used to stop for good at the first one."""
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client=confluent") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=30)
        inner = sub._inner
        refresh, failures = inner._refresh_data, []

        def flaky() -> None:
            if len(failures) < 3:
                failures.append(1)
                raise ClientError(Kind.OTHER, "SOME_NEW_CODE: not in the classifier's lists",
                                  broker=True)
            refresh()

        inner._refresh_data = flaky
        msg = _received_one(sub, f"{root}.a", mq)
        assert len(failures) == 3
        msg.ack()


def test_a_data_consumer_stops_after_unknown_errors_outlast_the_patience(
        url, names, monkeypatch) -> None:
    from mqabstract.backends.kafka import errors

    monkeypatch.setattr(errors, "UNKNOWN_PATIENCE", 1.0)
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client=confluent") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=30)
        inner = sub._inner

        def broken() -> None:
            raise ClientError(Kind.OTHER, "TOPIC_AUTHORIZATION_FAILED: not allowed",
                              broker=True)

        inner._refresh_data = broken
        inner.data_thread.join(30)
        assert not inner.data_thread.is_alive()
        with pytest.raises(mqabstract.MQError, match="TOPIC_AUTHORIZATION_FAILED"):
            sub.receive(1, 1.0)


def test_an_extend_whose_lease_ends_during_its_fence_raises(url, names) -> None:
    """``extend`` commits (fences) before it renews; when the record left the leases
    meanwhile (its partition moved, and the new owner delivers it again), the extend
    must raise ``LeaseExpired``, not return as if the lease were renewed."""
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client=confluent") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=30)
        msg = _received_one(sub, f"{root}.a", mq)
        inner = sub._inner
        fence_for = inner._fence_for

        def expired_meanwhile(rec: Any, move: bool = True) -> Any:
            out = fence_for(rec, move)
            with inner.lock:  # what the data thread's expiry does to the lease first
                for token, leased in list(inner.leased.items()):
                    if leased is rec:
                        del inner.leased[token]
            return out

        inner._fence_for = expired_meanwhile
        with pytest.raises(mqabstract.LeaseExpired):
            msg.extend(60)


def _next(sub: Any) -> Any:
    """The one message the subscription gets within 30 s."""
    got: list[Any] = []
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = sub.receive(1, 1.0)
    [msg] = got
    return msg


def _received_one(sub: Any, topic: str, mq: Any) -> Any:
    mq.publish(topic, b"x")
    return _next(sub)


def test_an_extend_whose_commit_lands_after_the_deadline_takes_effect(url, names) -> None:
    """An extend admitted before the deadline takes effect even when its fence (the
    commit) lands after it: the data thread must not expire the record meanwhile (it
    did, and a loaded broker's slow commit turned a timely extend into a redelivery)."""
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client=confluent") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=1.0)
        msg = _received_one(sub, f"{root}.a", mq)
        inner = sub._inner
        fence = inner._fence
        with inner.lock:
            [rec] = inner.leased.values()

        def slow_commit(budget: float, force: Any = ()) -> None:
            if threading.current_thread() is threading.main_thread():
                time.sleep(max(0.0, rec.deadline - time.time()) + 0.5)
            fence(budget, force)

        inner._fence = slow_commit
        msg.extend(10)
        inner._fence = fence
        assert msg.lease_remaining > 2  # renewed (the commit itself may be slow here)
        assert not sub.receive(1, 2.0)  # not expired, not delivered again
        msg.ack()


def test_a_nack_whose_commit_is_slow_takes_effect(url, names) -> None:
    """A nack admitted ~0.5 s before the deadline whose commit takes 0.8 s (a loaded
    broker) takes effect: the fence waits for the commit as long as any request, not
    only for what is left of the lease (it gave up after 0.5 s with ``Timeout``)."""
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client=confluent") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=2.0)
        msg = _received_one(sub, f"{root}.a", mq)
        inner = sub._inner
        schedule = inner._schedule

        class Slow:
            def __init__(self, sent: Any) -> None:
                self.sent = sent

            def wait(self, timeout: float) -> Any:
                time.sleep(min(timeout, 0.8))
                if timeout < 0.8:
                    return ClientError(Kind.TIMEOUT, "not confirmed (slow broker)")
                return self.sent.wait(timeout - 0.8)

        def slow(force: Any, patience: float = -1) -> Any:
            sent, *rest = schedule(force, patience)
            if sent is not None and threading.current_thread() is threading.main_thread():
                sent = Slow(sent)
            return (sent, *rest)

        inner._schedule = slow
        time.sleep(max(0.0, msg.lease_remaining - 0.5))
        msg.nack()  # raised Timeout before the change
        inner._schedule = schedule
        again = _next(sub)
        assert (again.id, again.attempt) == (msg.id, 2)
        again.ack()
        assert not sub.receive(1, 3.0)  # one copy: the nack's, not also an expiry's


def test_a_member_left_without_an_assignment_is_replaced(url, names, monkeypatch) -> None:
    """A group member that gets no assignment for two rebalance timeouts (+10 s) while
    the cluster answers is replaced by a new one, which takes the partitions over. Here
    the member is made to stop taking part (unsubscribed: revoked, never assigned again),
    as librdkafka's member did after a whole-cluster restart in session 22's sitting; the
    limit is shortened to a few seconds."""
    from mqabstract.backends.kafka import sub_member

    monkeypatch.setattr(sub_member, "STUCK_REBALANCES", 0.0)  # limit: 10 s
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client=confluent") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=30)
        inner = sub._inner
        first = _received_one(sub, f"{root}.a", mq)
        first.ack()
        stuck = inner.group
        stuck.c.unsubscribe()  # revoked; no assignment ever again for this member
        deadline = time.monotonic() + 60
        while inner.group is stuck and time.monotonic() < deadline:
            time.sleep(0.2)
        assert inner.group is not stuck, "the member was not replaced"
        again = _received_one(sub, f"{root}.a", mq)
        assert again.id != first.id
        again.ack()


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_receive_waiting_while_a_new_topic_is_assigned_gets_its_records(
        url, names, client) -> None:
    """The data thread replaces the ready buffer when it assigns a new topic's partitions;
    a receive already waiting on the buffer must hand out what the new one holds (one
    that kept the old buffer waited out its whole timeout with the record ready)."""
    group, root = names
    with mqabstract.connect(f"{url}{'&' if '?' in url else '?'}client={client}") as mq:
        sub = mq.subscribe(group, f"{root}.#", lease=120)
        inner = sub._inner
        got: list[Any] = []
        waiting = threading.Thread(target=lambda: got.extend(inner.receive(1, 60.0)))
        waiting.start()
        limit = time.monotonic() + 30
        while not inner.waiting and time.monotonic() < limit:
            time.sleep(0.01)
        assert inner.waiting  # the driver's receive waits on the (empty) buffer
        mq.publish(f"{root}.new", b"x")
        waiting.join(90)
        assert [d.body for d in got] == [b"x"]
        inner.ack([d.receipt for d in got])


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_created_topic_is_usable_when_ensure_topics_returns(url, client) -> None:
    """CreateTopics returns before the broker answers for the topic (on KRaft, a moment
    later: a reader made at once failed with UNKNOWN_PARTITION, conformance under load):
    ``ensure_topics`` asks until every new topic has a leader per partition. ``unready``
    names what it does not know, and never creates it."""
    sep = "&" if "?" in url else "?"
    token = os.urandom(4).hex()
    with mqabstract.connect(f"{url}{sep}client={client}") as mq:
        driver = mq._driver
        real = driver.admin
        missing = f"ur-{token}-missing"
        assert set(real.unready([missing])) == {missing}
        assert missing not in real.list_topics(), "asking created the topic"

        asked: list[dict[str, str]] = []

        class Lagging:  # the broker's metadata lags the creation for three answers
            def unready(self, names):
                got = real.unready(names) if len(asked) >= 3 else dict.fromkeys(names, "lag")
                asked.append(got)
                return got

            def __getattr__(self, name):
                return getattr(real, name)

        driver._admin_c = Lagging()
        try:
            fresh = f"ur-{token}-fresh"
            driver.ensure_topics([fresh])
        finally:
            driver._admin_c = real
        assert len(asked) >= 4 and asked[-1] == {}, asked
        assert real.unready([fresh]) == {}
        assert driver.ensure_topics([fresh]) is None and len(asked) >= 4  # known: not asked


def test_a_producer_lane_that_timed_a_record_out_is_not_used_again(url) -> None:
    """A lane whose client is cut off for good (librdkafka #5301 after a broker restart:
    here, a client of a port nothing listens on) times its records out; it must be closed,
    not handed the next send, which goes through a new lane and is delivered."""
    pytest.importorskip("confluent_kafka")
    from mqabstract.backends.kafka.ck_produce import _Lane, _Producer
    from mqabstract.backends.kafka.client import Outgoing

    sep = "&" if "?" in url else "?"
    with mqabstract.connect(f"{url}{sep}client=confluent") as mq:
        driver = mq._driver
        producer = driver.producer
        assert isinstance(producer, _Producer)
        topic = driver.topic(f"lane.{os.urandom(4).hex()}")
        driver.ensure_topics([topic])
        cut = _Lane({**producer.cfg, "bootstrap.servers": "127.0.0.1:1",
                     "message.timeout.ms": 300})
        with producer.lock:
            stale, producer.idle = producer.idle, [cut]
        for lane in stale:
            lane.p.flush(1)
        [failed] = producer.send([Outgoing(topic, b"x", None, [])], 5.0)
        assert failed is not None and failed.kind is Kind.TIMEOUT, failed
        assert cut not in producer.idle, "a lane that timed a record out was kept"
        assert producer.send([Outgoing(topic, b"y", None, [])], 10.0) == [None]
        assert producer.partitions(topic) == set(range(driver.partitions))


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_dead_letter_by_lease_expiry_waits_out_a_slow_redelivery(url, client,
                                                                 monkeypatch) -> None:
    """The conformance scenario of a dead letter by lease expiry, with the expired lease's
    re-publish (fence + transaction) slowed to quiet + 0.5 s, as on a loaded machine: the
    redelivery the portable layer dead-letters comes after the scenario's lease + quiet,
    still well within ``release_margin``. Before, the scenario read ``dead_letters()``
    after lease + quiet, found it empty and failed (session 24, kafka-python)."""
    from mqabstract.backends.kafka.subscription import KafkaSubscription
    from mqabstract.conformance.harness import Ctx
    from mqabstract.conformance.test_dead_letters import (
        test_dead_letter_after_max_attempts_by_lease_expiry as scenario,
    )

    move = KafkaSubscription._move

    def slow_move(self: Any, expired: list[Any], handoff: list[Any], epoch: int) -> None:
        if expired:
            time.sleep(ctx.quiet + 0.5)
        move(self, expired, handoff, epoch)

    monkeypatch.setattr(KafkaSubscription, "_move", slow_move)
    sep = "&" if "?" in url else "?"
    with mqabstract.connect(f"{url}{sep}client={client}") as mq:
        ctx = Ctx(url, mq)
        assert ctx.quiet + 0.5 < mq.capabilities.release_margin
        try:
            scenario(ctx)
        finally:
            ctx.cleanup()


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_subscription_makes_its_transactional_producer_while_it_joins(url, client,
                                                                        names) -> None:
    """A consumer's first re-publish (a delayed nack, an expired lease) used to make its
    transactional producer inside the message's lease: init_transactions took up to 0.5 s
    on an idle broker, and a batch nack under load ran out of a 2 s lease on it. It is now
    made beside the join, before anything is received or nacked; a nack then uses it."""
    group, root = names
    sep = "&" if "?" in url else "?"
    with mqabstract.connect(f"{url}{sep}client={client}") as mq, \
            mq.subscribe(group, f"{root}.#", lease=30) as sub:
        inner = sub._inner
        deadline = time.monotonic() + 30
        while inner.mover is None and time.monotonic() < deadline:
            time.sleep(0.05)
        made = inner.mover
        assert made is not None, "no transactional producer before the first re-publish"
        mq.publish(f"{root}.n", b"x")
        got: list[Any] = []
        while not got and time.monotonic() < deadline:
            got = sub.receive(1, 1.0)
        assert got
        got[0].nack(0.2)
        assert inner.mover is made
