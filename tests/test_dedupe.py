"""Dedupe stores on a fake clock, and the idempotent consume loop over the memory reference
(the same loop runs on every backend: conformance/test_dedupe.py)."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

import mqabstract
from mqabstract import FakeClock, aio
from mqabstract.dedupe import MemoryStore, SQLiteStore


def memory_url() -> str:
    return f"memory://dd-{uuid.uuid4().hex}"


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request: Any, tmp_path: Path) -> Any:
    made: list[Any] = []

    def make(**kw: Any) -> Any:
        store = (MemoryStore(**kw) if request.param == "memory"
                 else SQLiteStore(tmp_path / f"s{len(made)}.db", **kw))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def test_seen_after_record_per_group(make_store: Any) -> None:
    store = make_store()
    assert not store.seen("g", "a")
    store.record("g", "a")
    store.record("g", "a")  # idempotent
    assert store.seen("g", "a")
    assert not store.seen("other", "a")  # ids are kept per group
    assert len(store) == 1


def test_retention_forgets_on_the_clock(make_store: Any) -> None:
    clock = FakeClock()
    store = make_store(retention=60, clock=clock)
    store.record("g", "a")
    clock.advance(59)
    assert store.seen("g", "a")
    clock.advance(1)
    assert not store.seen("g", "a")  # forgotten: a duplicate now would be processed
    store.record("g", "a")  # recorded again, with a fresh time
    clock.advance(30)
    assert store.seen("g", "a")


def test_max_entries_keeps_the_newest(make_store: Any) -> None:
    store = make_store(max_entries=3)
    for i in range(5):
        store.record("g", f"m{i}")
    if isinstance(store, SQLiteStore):
        store.prune()  # (done every PRUNE_EVERY records on its own)
    assert len(store) == 3
    assert [store.seen("g", f"m{i}") for i in range(5)] == [False, False, True, True, True]


def test_sqlite_prunes_by_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mqabstract.dedupe, "PRUNE_EVERY", 10)
    clock = FakeClock()
    with SQLiteStore(tmp_path / "p.db", retention=5, max_entries=1000, clock=clock) as store:
        for i in range(9):
            store.record("g", f"old{i}")
        clock.advance(10)
        store.record("g", "new")  # the 10th record prunes the expired
        assert len(store) == 1


@pytest.mark.parametrize("kw", [
    {"retention": 0}, {"retention": -1}, {"retention": math.nan}, {"retention": math.inf},
    {"retention": True}, {"retention": "60"}, {"max_entries": 0}, {"max_entries": 1.5},
    {"max_entries": True},
])
def test_bad_settings_are_typed_errors(make_store: Any, kw: dict[str, Any]) -> None:
    with pytest.raises(mqabstract.InvalidArgument):
        make_store(**kw)


def test_sqlite_bad_path_and_busy_timeout(tmp_path: Path) -> None:
    with pytest.raises(mqabstract.InvalidArgument):
        SQLiteStore(42)  # type: ignore[arg-type]
    with pytest.raises(mqabstract.InvalidArgument):
        SQLiteStore(tmp_path / "x.db", busy_timeout=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(mqabstract.StoreError):  # its parent is a file
        SQLiteStore(tmp_path / "file" / "x.db")


def test_sqlite_survives_reopen_and_is_shared(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "s.db") as one:
        one.record("g", "a")
        with SQLiteStore(tmp_path / "s.db") as two:
            assert two.seen("g", "a")
            two.record("g", "b")
        assert one.seen("g", "b")
    with SQLiteStore(tmp_path / "s.db") as again:
        assert again.seen("g", "a") and again.seen("g", "b")


def test_closed_store_raises_typed(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    store.close()
    with pytest.raises(mqabstract.StoreError):
        store.seen("g", "a")


# -- the consume loop -----------------------------------------------------------------------
def test_consume_skips_and_acks_duplicates() -> None:
    calls: list[str] = []
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#")
        for mid in ("a", "b", "a", "c", "b"):
            mq.publish("t.x", b"x", id=mid)
        stats = sub.consume(lambda m: calls.append(m.id), max_messages=5,
                            dedupe=MemoryStore())
        assert calls == ["a", "b", "c"]
        assert (stats.acked, stats.duplicates, stats.failed) == (5, 2, 0)
        assert sub.receive(10, 0.05) == []  # duplicates were acked, not left leased


def test_a_failed_handler_is_not_recorded() -> None:
    store = MemoryStore()
    attempts: list[int] = []

    def flaky(msg: mqabstract.Message) -> None:
        attempts.append(msg.attempt)
        if msg.attempt == 1:
            raise RuntimeError("first try fails")

    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=5)
        mq.publish("t.x", b"x", id="only")
        stats = sub.consume(flaky, max_messages=2, backoff=mqabstract.Backoff(0, jitter=0),
                            dedupe=store)
    assert attempts == [1, 2]  # the retry ran the handler: nothing was recorded after 1
    assert (stats.failed, stats.acked, stats.duplicates) == (1, 1, 0)
    assert store.seen("g", "only")


def test_a_redelivery_after_success_is_a_duplicate() -> None:
    """The handler succeeded but the ack never happened (a crash, a lease that ran out):
    the redelivery is acked without running the handler again."""
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    calls: list[int] = []
    with mqabstract.connect(memory_url(), clock=clock) as mq:
        sub = mq.subscribe("g", "t.#", lease=10)
        mq.publish("t.x", b"x", id="m")
        first = sub.receive(1, 0)[0]
        calls.append(first.attempt)
        store.record("g", first.id)  # processed; then the consumer stalls past its lease
        clock.advance(11)
        stats = sub.consume(lambda m: calls.append(m.attempt), max_messages=1, dedupe=store)
    assert calls == [1]
    assert (stats.duplicates, stats.acked) == (1, 1)


def test_consume_rejects_a_non_store() -> None:
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#")
        with pytest.raises(mqabstract.InvalidArgument):
            sub.consume(lambda m: None, max_messages=1, dedupe=set())  # type: ignore[arg-type]


def test_store_failure_means_no_ack(tmp_path: Path) -> None:
    """A store that cannot record: the message is retried, never acked unrecorded."""
    store = SQLiteStore(tmp_path / "s.db")
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=5)
        mq.publish("t.x", b"x", id="m")
        store.close()
        stats = sub.consume(lambda m: None, max_messages=1,
                            backoff=mqabstract.Backoff(0, jitter=0), dedupe=store)
        assert (stats.acked, stats.failed, stats.retried) == (0, 1, 1)
        again = sub.receive(1, 0.5)
        assert [m.attempt for m in again] == [2]


def test_transaction_commits_side_effect_with_the_id(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    with store.transaction(_Fake("setup", "schema")) as db:
        db.execute("CREATE TABLE effects (id TEXT)")
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=5)

        def handler(msg: mqabstract.Message) -> None:
            with store.transaction(msg) as db:
                db.execute("INSERT INTO effects VALUES (?)", (msg.id,))
                if msg.attempt == 1 and msg.id == "boom":
                    raise RuntimeError("fails inside the transaction: rolled back")

        for mid in ("a", "boom", "a"):
            mq.publish("t.x", b"x", id=mid)
        stats = sub.consume(handler, max_messages=4, backoff=mqabstract.Backoff(0, jitter=0),
                            dedupe=store)
    rows = sqlite3.connect(tmp_path / "s.db").execute(
        "SELECT id, count(*) FROM effects GROUP BY id ORDER BY id").fetchall()
    assert rows == [("a", 1), ("boom", 1)]
    assert (stats.duplicates, stats.failed, stats.acked) == (1, 1, 3)
    with pytest.raises(mqabstract.Duplicate), store.transaction(_Fake("g", "a")):
        pass
    store.close()


class _Fake:
    def __init__(self, group: str, mid: str) -> None:
        self.group, self.id = group, mid


def test_concurrent_transactions_run_one_side_effect(tmp_path: Path) -> None:
    """Two deliveries of one id at once (a lease that ran out under a slow handler): the
    write lock serialises them and the second sees the first's record."""
    path = tmp_path / "s.db"
    with SQLiteStore(path) as store, store.transaction(_Fake("g", "init")) as db:
        db.execute("CREATE TABLE effects (id TEXT)")
    outcomes: list[str] = []
    go = threading.Barrier(4)

    def worker() -> None:
        store = SQLiteStore(path)
        go.wait()
        try:
            with store.transaction(_Fake("g", "same")) as db:
                db.execute("INSERT INTO effects VALUES ('same')")
            outcomes.append("done")
        except mqabstract.Duplicate:
            outcomes.append("duplicate")
        finally:
            store.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["done", "duplicate", "duplicate", "duplicate"]
    assert sqlite3.connect(path).execute("SELECT count(*) FROM effects").fetchone() == (1,)


def test_async_consume_dedupes_with_either_store(tmp_path: Path) -> None:
    async def main(store: Any) -> tuple[list[str], mqabstract.ConsumeStats]:
        calls: list[str] = []

        async def handler(msg: aio.AsyncMessage) -> None:
            calls.append(msg.id)

        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("g", "t.#")
            for mid in ("a", "a", "b", "a"):
                await mq.publish("t.x", b"x", id=mid)
            stats = await sub.consume(handler, max_messages=4, dedupe=store)
            assert await sub.receive(10, 0.05) == []
        return calls, stats

    for store in (MemoryStore(), SQLiteStore(tmp_path / "a.db")):
        calls, stats = asyncio.run(main(store))
        assert calls == ["a", "b"]
        assert (stats.duplicates, stats.acked) == (2, 4)
        store.close()


def test_a_message_the_handler_gave_back_is_not_recorded() -> None:
    """A handler that nacks (or dead-letters, to fix and replay) its message did not
    process it: the redelivery must reach the handler again."""
    store = MemoryStore()
    seen: list[int] = []

    def handler(msg: mqabstract.Message) -> None:
        seen.append(msg.attempt)
        if msg.attempt == 1:
            msg.nack()

    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=5)
        mq.publish("t.x", b"x", id="m")
        stats = sub.consume(handler, max_messages=2, dedupe=store)
        assert seen == [1, 2] and stats.duplicates == 0
        mq.publish("t.x", b"y", id="d")
        sub.consume(lambda m: m.dead_letter("fix me"), max_messages=1, dedupe=store)
        assert not store.seen("g", "d")
        mq.replay_dead_letters("g")
        handled: list[str] = []
        stats = sub.consume(lambda m: handled.append(m.id), max_messages=1, dedupe=store)
        assert handled == ["d"] and stats.duplicates == 0


def test_close_while_other_threads_use_the_store(tmp_path: Path) -> None:
    """close() waits for a call in progress on another thread (it used to close the
    connection under it: a segfault); the other thread then gets StoreError."""
    for _ in range(20):
        store = SQLiteStore(tmp_path / "c.db")
        errors: list[BaseException] = []
        stop = threading.Event()

        def hammer(store: SQLiteStore = store, stop: threading.Event = stop,
                   errors: list[BaseException] = errors) -> None:
            try:
                while not stop.is_set():
                    store.record("g", uuid.uuid4().hex)
                    store.seen("g", "x")
            except mqabstract.StoreError:
                return
            except BaseException as exc:  # anything else is a bug
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        store.close()
        stop.set()
        for t in threads:
            t.join(10)
        assert errors == []


def test_connections_of_ended_threads_are_closed(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "t.db") as store:
        for _ in range(30):
            t = threading.Thread(target=store.record, args=("g", uuid.uuid4().hex))
            t.start()
            t.join()
        store.seen("g", "x")  # a new connection here closes those of the ended threads
        assert len(store._conns) <= 2
