"""The toolkit's SQLite helper: busy answers are waited out to ``busy_timeout`` (on an
injected clock), other errors pass through, and many processes opening one new file at
once all get a WAL connection (SQLite answered some of them ``database is locked`` at once
when each switched the journal mode itself)."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from mqabstract import Timeout
from mqabstract.dedupe import SQLiteStore
from mqabstract.emulation.sqlitedb import ensure_wal, immediate, open_wal, retry_busy


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def _busy_then(n: int, value: str = "done"):  # type: ignore[no-untyped-def]
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= n:
            raise sqlite3.OperationalError("database is locked")
        return value

    return fn, calls


def test_busy_answers_are_retried_with_backoff_until_success() -> None:
    clock = _Clock()
    fn, calls = _busy_then(5)
    assert retry_busy(fn, timeout=1, what="x", monotonic=clock.monotonic,
                      sleep=clock.sleep) == "done"
    assert len(calls) == 6
    assert clock.sleeps == [0.002, 0.004, 0.008, 0.016, 0.032]


def test_a_lock_held_past_busy_timeout_is_a_timeout_naming_what_waited() -> None:
    clock = _Clock()
    fn, _ = _busy_then(10**9)
    with pytest.raises(Timeout, match=r"store open: another connection kept the file locked; "
                                      r"waited 2\.0s \(busy_timeout 2s\)") as info:
        retry_busy(fn, timeout=2, what="store open", monotonic=clock.monotonic,
                   sleep=clock.sleep)
    assert info.value.retryable
    assert 2 <= clock.now < 2.06 and max(clock.sleeps) == 0.05


def test_other_sqlite_errors_are_not_retried() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        raise sqlite3.OperationalError("no such table: t")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        retry_busy(fn, timeout=5, what="x")
    assert calls == [1]


def test_open_wal_asks_before_switching_and_immediate_rolls_back(tmp_path: Path) -> None:
    path = str(tmp_path / "f.db")
    conn = open_wal(path, timeout=1, what="t")
    assert ensure_wal(conn) == "wal"
    conn.execute("CREATE TABLE t (x)")
    with pytest.raises(RuntimeError), immediate(conn):
        conn.execute("INSERT INTO t VALUES (1)")
        raise RuntimeError
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 0 and not conn.in_transaction
    # Once the file is in WAL mode, opening needs no lock: a writer holding one is no obstacle.
    conn.execute("BEGIN IMMEDIATE")
    other = open_wal(path, timeout=0.2, what="t")
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute("ROLLBACK")


class _InterruptedAfterBegin(sqlite3.Connection):
    """A Ctrl-C that arrives while ``BEGIN IMMEDIATE`` runs in C is raised by the
    interpreter right after the call returns: the transaction is already open."""

    armed = True

    def execute(self, sql: str, *args):  # type: ignore[no-untyped-def,override]
        cur = super().execute(sql, *args)
        if sql == "BEGIN IMMEDIATE" and self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return cur


def test_a_ctrl_c_landing_right_after_begin_leaves_no_transaction_open(tmp_path: Path) -> None:
    # The CLI's `tail` test once exited 130 without releasing its held message: the
    # release's own write found the interrupted receive's transaction still open.
    conn = sqlite3.connect(str(tmp_path / "f.db"), isolation_level=None,
                           factory=_InterruptedAfterBegin)
    conn.execute("CREATE TABLE t (x)")
    with pytest.raises(KeyboardInterrupt), immediate(conn):
        conn.execute("INSERT INTO t VALUES (1)")
    assert not conn.in_transaction
    with immediate(conn):  # the next write (the release at exit) goes through
        conn.execute("INSERT INTO t VALUES (2)")
    assert conn.execute("SELECT x FROM t").fetchall() == [(2,)]


def test_a_transaction_abandoned_outside_its_block_is_rolled_back_by_the_next(
        tmp_path: Path) -> None:
    # A Ctrl-C between the BEGIN and the with-block's start (inside contextlib's
    # __enter__) never reaches the block's handler: the next write on the connection
    # rolls the abandoned one back, and closing the abandoned block later touches nothing.
    conn = sqlite3.connect(str(tmp_path / "f.db"), isolation_level=None)
    conn.execute("CREATE TABLE t (x)")
    abandoned = immediate(conn)
    abandoned.__enter__()
    conn.execute("INSERT INTO t VALUES (1)")
    with immediate(conn):
        conn.execute("INSERT INTO t VALUES (2)")
        abandoned.gen.close()  # what the garbage collector does to the abandoned block
        assert conn.in_transaction  # ...without rolling back the live one
    assert conn.execute("SELECT x FROM t").fetchall() == [(2,)]


def test_an_abandoned_block_closed_after_its_connection_is_silent(tmp_path: Path) -> None:
    # `mqa tail` on Ctrl-C (1 of ~25 runs): the abandoned block was collected after the
    # broker closed the connection and printed "Exception ignored ... closed database".
    conn = sqlite3.connect(str(tmp_path / "f.db"), isolation_level=None)
    abandoned = immediate(conn)
    abandoned.__enter__()
    conn.close()
    abandoned.gen.close()  # raises nothing


def _open_store(path: str, start: multiprocessing.synchronize.Event, out) -> None:  # type: ignore[no-untyped-def]
    start.wait()
    try:
        with SQLiteStore(path, busy_timeout=30) as store:
            store.record("g", "x")
        out.put("ok")
    except Exception as exc:  # reported to the parent, which fails the test
        out.put(f"{type(exc).__name__}: {exc}")


def test_many_processes_open_one_new_store_at_once(tmp_path: Path) -> None:
    """Six processes open a fresh rollback-journal file (made as an application would: its
    own table first) at the same instant, 15 times: every open succeeds. Before the toolkit
    helper about one round in forty failed with ``database is locked`` after 0.0 s."""
    ctx = multiprocessing.get_context("fork")
    failures = []
    for round_ in range(15):
        path = str(tmp_path / f"store{round_}.db")
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE effects (id TEXT)")
        db.close()
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_open_store, args=(path, start, out)) for _ in range(6)]
        for p in procs:
            p.start()
        start.set()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        failures += [r for r in results if r != "ok"]
    assert not failures, failures[:3]
