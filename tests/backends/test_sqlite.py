"""SQLite backend: behaviour through the public API, restarts, real processes and SIGKILL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import mqabstract
from mqabstract import FakeClock, OutgoingMessage

WORKER = str(Path(__file__).with_name("sqlite_worker.py"))


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/mq.db"  # absolute: sqlite:////tmp/...


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mq(url: str, clock: FakeClock) -> Iterator[mqabstract.Broker]:
    broker = mqabstract.connect(url, clock=clock)
    yield broker
    broker.close()


# -- URLs and the default location ------------------------------------------------------------
def test_relative_url_resolves_against_cwd_and_creates_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with mqabstract.connect("sqlite:///sub/dir/rel.db") as mq:
        mq.declare("g", "t")
    assert (tmp_path / "sub" / "dir" / "rel.db").exists()


def test_default_url_is_sqlite_under_mq_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.setenv("MQ_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MQ_URL", raising=False)
    assert mqabstract.default_url() == f"sqlite:///{tmp_path}/home/default.db"
    with mqabstract.connect() as mq:
        assert mq.backend == "sqlite"
        mq.declare("g", "t")
    assert (tmp_path / "home" / "default.db").exists()


@pytest.mark.parametrize("bad", ["sqlite://host/x.db", "sqlite:///:memory:", "sqlite://"])
def test_bad_urls(bad: str) -> None:
    with pytest.raises(mqabstract.InvalidURL):
        mqabstract.connect(bad)


def test_wal_mode_and_unknown_option(url: str, tmp_path: Path) -> None:
    with mqabstract.connect(url):
        pass
    mode = sqlite3.connect(tmp_path / "mq.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    with pytest.raises(mqabstract.InvalidArgument):
        mqabstract.connect(url + "?nope=1")
    with pytest.raises(mqabstract.InvalidArgument):
        mqabstract.connect(url + "?synchronous=sometimes")


def test_unopenable_file_is_connection_failed(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(mqabstract.ConnectionFailed) as info:
        mqabstract.connect(f"sqlite:///{tmp_path}/file/sub/mq.db")
    assert "sqlite:///" in str(info.value)


def test_held_write_lock_gives_retryable_timeout(url: str, tmp_path: Path) -> None:
    with mqabstract.connect(url, busy_timeout=0.3) as mq:
        mq.declare("g", "t")
        blocker = sqlite3.connect(tmp_path / "mq.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        try:
            with pytest.raises(mqabstract.Timeout) as info:
                mq.publish("t", "x")
            assert info.value.retryable
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        mq.publish("t", "x")  # works again once the lock is released
        assert mq.stats("g").ready == 1


# -- semantics ---------------------------------------------------------------------------------
def test_round_trip_fields(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "a.*")
    mid = mq.publish("a.b", b"\x00\xff", headers={"h": "v"}, key="k", priority=4, id="my-id")
    (msg,) = sub.receive(5, 1)
    assert (msg.id, msg.topic, msg.body, msg.key, msg.priority, msg.attempt) == (
        mid, "a.b", b"\x00\xff", "k", 4, 1)
    assert dict(msg.headers) == {"h": "v"}
    msg.ack()
    assert mq.stats("g") == mqabstract.GroupStats("g", 0, 0, 0, 0)


def test_patterns_fanout_and_late_group(mq: mqabstract.Broker) -> None:
    star = mq.subscribe("star", "o.*.c")
    hash_ = mq.subscribe("hash", "o.#")
    mq.publish("o.eu.c", 1)
    mq.publish("o.c", 2)
    mq.publish("o.eu.x.c", 3)
    late = mq.subscribe("late", "o.#")
    mq.publish("o", 4)
    assert [m.value for m in star.receive(10, 0.5)] == [1]
    assert [m.value for m in hash_.receive(10, 0.5)] == [1, 2, 3, 4]
    assert [m.value for m in late.receive(10, 0.5)] == [4]


def test_competing_threads_share_without_duplicates(mq: mqabstract.Broker) -> None:
    mq.declare("work", "jobs")
    mq.publish_batch([("jobs", i) for i in range(300)])
    got: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        sub = mq.subscribe("work", "jobs")
        while True:
            msgs = sub.receive(7, 0.3)
            if not msgs:
                return
            for m in msgs:
                with lock:
                    got.append(m.value)
                m.ack()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(300))


def test_lease_expiry_stale_ack_and_extend(mq: mqabstract.Broker, clock: FakeClock) -> None:
    a = mq.subscribe("g", "t", lease=10)
    b = mq.subscribe("g", "t", lease=10)
    mq.publish("t", "x")
    (first,) = a.receive(1, 1)
    first.extend(30)
    clock.advance(20)
    assert b.receive(1, 0) == []  # extended lease still holds
    clock.advance(11)
    (again,) = b.receive(1, 1)
    assert again.attempt == 2
    with pytest.raises(mqabstract.LeaseExpired):  # stale: the message now belongs to b
        first.ack()
    assert mq.stats("g").leased == 1
    again.ack()
    assert mq.stats("g").leased == 0


def test_nack_delay_and_deliver_at(mq: mqabstract.Broker, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "t")
    mq.publish("t", "later", delay=60)
    mq.publish("t", "at", deliver_at=datetime.fromtimestamp(clock.time(), timezone.utc)
               + timedelta(seconds=30))
    assert sub.receive(1, 0.05) == []
    assert mq.stats("g").delayed == 2
    clock.advance(30)
    (m,) = sub.receive(1, 1)
    assert m.value == "at"
    m.nack(delay=100)
    clock.advance(30)
    (m2,) = sub.receive(1, 1)
    assert m2.value == "later"
    m2.ack()
    clock.advance(70)
    (m3,) = sub.receive(1, 1)
    assert (m3.value, m3.attempt) == ("at", 2)


def test_fake_clock_advance_wakes_a_blocked_receive(url: str, clock: FakeClock) -> None:
    """Polls a minute apart and a 400 s lease (receive looks again each quarter): only the
    advance's wake can hand the message over before the join gives up."""
    with mqabstract.connect(url, clock=clock, poll_min=60, poll_max=60) as mq:
        sub = mq.subscribe("g", "t", lease=400)
        mq.publish("t", "x", delay=5)
        got: list[mqabstract.Message] = []
        waiter = threading.Thread(target=lambda: got.extend(sub.receive(1, 60)))
        waiter.start()
        threading.Timer(0.2, clock.advance, (5,)).start()
        waiter.join(30)
        assert not waiter.is_alive(), "the clock's advance did not wake the receive"
        assert [m.value for m in got] == ["x"]


def test_priority_then_publish_order(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "t", priority=True)
    for i, p in enumerate([0, 9, 3, 9, 0]):
        mq.publish("t", i, priority=p)
    assert [m.value for m in sub.receive(10, 1)] == [1, 3, 2, 0, 4]


def test_ordered_group_holds_back_later_messages_of_a_key(mq: mqabstract.Broker,
                                                           clock: FakeClock) -> None:
    a = mq.subscribe("g", "t", ordered=True, lease=10)
    b = mq.subscribe("g", "t", ordered=True, lease=10)
    for i in range(3):
        mq.publish("t", f"k{i}", key="k")
    mq.publish("t", "free")
    first = a.receive(10, 1)
    assert [m.value for m in first] == ["k0", "free"]
    assert b.receive(10, 0.05) == []  # k1 waits while k0 is leased
    first[0].nack(delay=5)
    assert b.receive(10, 0.05) == []  # ... and while it is pending
    clock.advance(6)
    (k0,) = b.receive(10, 1)
    assert (k0.value, k0.attempt) == ("k0", 2)
    k0.ack()
    assert [m.value for m in a.receive(10, 1)] == ["k1"]


def test_dead_letters_list_replay_purge(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "t", max_attempts=2)
    mq.publish("t", "a", id="a")
    mq.publish("t", "b", id="b")
    for m in sub.receive(10, 1):
        m.nack()
    for m in sub.receive(10, 1):
        m.nack()  # final attempt: dead-lettered
    dead = mq.dead_letters("g")
    assert [(d.id, d.attempts) for d in dead] == [("a", 2), ("b", 2)]
    assert "final attempt" in dead[0].reason
    assert mq.replay_dead_letters("g", ["a"]) == 1
    (m,) = sub.receive(10, 1)
    assert (m.id, m.attempt) == ("a", 1)
    m.dead_letter("poison")
    assert mq.stats("g").dead == 2
    assert mq.purge_dead_letters("g") == 2
    assert mq.dead_letters("g") == []


def test_batch_is_one_transaction(mq: mqabstract.Broker) -> None:
    sub = mq.subscribe("g", "t")
    with pytest.raises(mqabstract.ValidationError) as info:
        mq.publish_batch([("t", 1), ("bad topic", 2)])
    assert info.value.index == 1
    ids = mq.publish_batch([OutgoingMessage("t", i) for i in range(50)])
    assert len(ids) == 50
    assert [m.value for m in sub.receive(100, 1)] == list(range(50))


def test_close_releases_unsettled(url: str) -> None:
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe("g", "t", lease=300)
        mq.publish("t", "x")
        assert len(sub.receive(1, 1)) == 1
        sub.close()
        (m,) = mq.subscribe("g", "t").receive(1, 1)
        assert m.attempt == 2


def test_idle_receive_does_not_hammer_the_file(mq: mqabstract.Broker) -> None:
    """An idle receive re-queries only when something changed: count claim transactions."""
    sub = mq.subscribe("g", "t")
    inner = sub._inner
    calls = 0
    original = inner._try_claim

    def counting(n: int) -> list:
        nonlocal calls
        calls += 1
        return original(n)

    inner._try_claim = counting
    assert inner.receive(1, 1.0) == []  # the driver call: one claim, then cheap checks only
    assert calls == 1


# -- restarts ---------------------------------------------------------------------------------
def test_persistence_across_close_and_reopen(url: str, clock: FakeClock) -> None:
    with mqabstract.connect(url, clock=clock) as mq:
        sub = mq.subscribe("g", "t", lease=30, max_attempts=3)
        mq.publish_batch([("t", i) for i in range(5)])
        mq.publish("t", "delayed", delay=100)
        held = sub.receive(2, 1)
        assert [m.value for m in held] == [0, 1]
        held[1].dead_letter("kept")
        # the broker closes with message 0 leased and unsettled
    with mqabstract.connect(url, clock=clock) as mq:
        stats = mq.stats("g")
        assert (stats.ready, stats.delayed, stats.dead) == (4, 1, 1)
        sub = mq.subscribe("g", "t", lease=30, max_attempts=3)
        got = sub.receive(10, 1)
        assert sorted(m.value for m in got) == [0, 2, 3, 4]
        assert next(m for m in got if m.value == 0).attempt == 2
        assert [d.id for d in mq.dead_letters("g")] == [held[1].id]


# -- real processes -----------------------------------------------------------------------------
def _worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, text=True,
                            bufsize=1)


def _read_lines(proc: subprocess.Popen[str], into: list[str]) -> threading.Thread:
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            into.append(line.strip())

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _wait_for(pred, timeout: float) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_publisher_and_consumer_loses_nothing(url: str) -> None:
    with mqabstract.connect(url) as mq:
        mq.declare("crash", "crash.#")
    pub_lines: list[str] = []
    con_lines: list[str] = []
    publisher = _worker("publish", url, "crash.t")
    consumer = _worker("consume", url, "crash", "crash.#", "1.0", "4", "0")
    readers = [_read_lines(publisher, pub_lines), _read_lines(consumer, con_lines)]
    try:
        _wait_for(lambda: len(pub_lines) >= 400 and sum(
            ln.startswith("ACKED") for ln in con_lines) >= 100, 60)
        os.kill(publisher.pid, signal.SIGKILL)  # mid-run, probably inside a transaction
        os.kill(consumer.pid, signal.SIGKILL)
    finally:
        for proc in (publisher, consumer):
            proc.kill()
            proc.wait()
    for r in readers:
        r.join(5)
    published = {ln.split()[1] for ln in pub_lines if ln.startswith("PUB ")}
    received = {ln.split()[1] for ln in con_lines if ln.startswith("RECV ")}
    acking = {ln.split()[1] for ln in con_lines if ln.startswith("ACKING ")}
    acked = {ln.split()[1] for ln in con_lines if ln.startswith("ACKED ")}
    in_doubt = acking - acked  # killed between ack and print: either outcome is correct
    held = received - acking  # leased and never settled: must come back
    assert held, "the consumer should have held some leases when killed"

    redelivered: dict[str, int] = {}
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe("crash", "crash.#", lease=30, max_attempts=100)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msgs = sub.receive(100, 0.5)
            for m in msgs:
                redelivered[m.id] = m.attempt
                m.ack()
            if not msgs and (published - acked - in_doubt) <= set(redelivered):
                break
    missing = published - acked - in_doubt - set(redelivered)
    assert not missing, f"{len(missing)} confirmed publishes were lost"
    assert held <= set(redelivered), "unacked leases did not come back"
    assert all(redelivered[i] >= 2 for i in held)
    assert not (acked & set(redelivered)), "a message acked before the kill came back"


@pytest.mark.slow
def test_two_processes_share_one_group(url: str) -> None:
    n = 3000
    with mqabstract.connect(url) as mq:
        mq.declare("shared", "work.#")
        mq.publish_batch([("work.item", i) for i in range(n)])
    procs = [_worker("consume", url, "shared", "work.#", "30", "0", "1.5") for _ in range(2)]
    lines: list[list[str]] = [[], []]
    readers = [_read_lines(proc, into) for proc, into in zip(procs, lines, strict=True)]
    for proc, reader in zip(procs, readers, strict=True):
        assert proc.wait(120) == 0
        reader.join(10)
    acked = [[ln.split()[1] for ln in ls if ln.startswith("ACKED ")] for ls in lines]
    a, b = set(acked[0]), set(acked[1])
    assert len(acked[0]) == len(a) and len(acked[1]) == len(b)
    assert not (a & b), "a message was acked by both processes"
    assert len(a | b) == n
    assert a and b, f"work was not shared: {len(a)} vs {len(b)}"
    with mqabstract.connect(url) as mq:
        assert mq.stats("shared") == mqabstract.GroupStats("shared", 0, 0, 0, 0)
