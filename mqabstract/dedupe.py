"""Idempotent consumers: stores that remember which message ids a group has processed.

Delivery is at-least-once on every backend: a consumer that dies after its handler
succeeded but before the ack gets the message again. ``consume(handler, dedupe=store)``
turns that into effectively-once processing: before the handler runs the loop asks the
store whether the group already processed this id (then the message is acked, the
handler not called, ``ConsumeStats.duplicates`` counts it); after the handler succeeded
the store records the id, then the message is acked.

A crash between the handler's side effect and the store's record still repeats the side
effect. ``SQLiteStore.transaction`` closes that window for side effects that live in the
same SQLite file: they commit in one transaction with the id, or not at all;
``PostgresStore.transaction`` (``mqabstract.backends.postgresql.dedupe``, importable from
here when psycopg is installed) does the same in the application's PostgreSQL database.

Ids are kept per group for ``retention`` seconds and at most ``max_entries`` of them:
the oldest go first. A duplicate that comes after its id was forgotten is processed again,
so the retention must outlast redeliveries (leases, retries, replays of dead letters).
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .clock import Clock, SystemClock
from .emulation.sqlitedb import immediate, open_wal, retry_busy
from .errors import Duplicate, InvalidArgument, StoreError

if TYPE_CHECKING:
    from .message import Message

__all__ = ["DedupeStore", "MemoryStore", "SQLiteStore"]  # and PostgresStore (__getattr__)

T = TypeVar("T")
_S = TypeVar("_S", bound="DedupeStore")

#: Ids are remembered a week unless told otherwise (Kafka's default retention).
DEFAULT_RETENTION = 7 * 86400.0


def _check(retention: object, max_entries: object) -> tuple[float, int]:
    if isinstance(retention, bool) or not isinstance(retention, (int, float)) \
            or not math.isfinite(retention) or retention <= 0:
        raise InvalidArgument(f"retention must be a finite number of seconds > 0, "
                              f"got {retention!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise InvalidArgument(f"max_entries must be an int ≥ 1, got {max_entries!r}")
    return float(retention), max_entries


def _key(group: object, mid: object) -> tuple[str, str]:
    if not isinstance(group, str) or not isinstance(mid, str):
        raise InvalidArgument("a dedupe key is a (group, message id) pair of strings")
    return group, mid


class DedupeStore:
    """What ``consume(dedupe=…)`` needs: ``seen`` before the handler, ``record`` after it.

    ``blocking`` says whether the calls do I/O (the asyncio consume then runs them on its
    I/O thread, not on the event loop)."""

    blocking = False
    retention: float
    max_entries: int

    def seen(self, group: str, mid: str) -> bool:
        """Whether ``group`` has processed message ``mid`` within the retention window."""
        raise NotImplementedError

    def record(self, group: str, mid: str) -> None:
        """Remember that ``group`` processed ``mid`` (idempotent)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (idempotent)."""

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryStore(DedupeStore):
    """Ids in this process's memory: survives redeliveries, not a restart of the process.

    For tests, for the memory backend, and for consumers whose duplicates come from lease
    expiry within one process's life."""

    def __init__(self, *, retention: float = DEFAULT_RETENTION, max_entries: int = 1_000_000,
                 clock: Clock | None = None) -> None:
        self.retention, self.max_entries = _check(retention, max_entries)
        self._time = (clock or SystemClock()).time
        self._ids: OrderedDict[tuple[str, str], float] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def seen(self, group: str, mid: str) -> bool:
        key = _key(group, mid)
        with self._lock:
            at = self._ids.get(key)
            return at is not None and at > self._time() - self.retention

    def record(self, group: str, mid: str) -> None:
        key = _key(group, mid)
        now = self._time()
        with self._lock:
            self._ids.pop(key, None)
            self._ids[key] = now
            cutoff = now - self.retention
            ids = self._ids
            while ids and (len(ids) > self.max_entries or next(iter(ids.values())) <= cutoff):
                ids.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def __repr__(self) -> str:
        return f"MemoryStore(retention={self.retention:g}, max_entries={self.max_entries})"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS mq_processed (
    seq INTEGER PRIMARY KEY, grp TEXT NOT NULL, id TEXT NOT NULL, at REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS mq_processed_key ON mq_processed (grp, id);
CREATE INDEX IF NOT EXISTS mq_processed_at ON mq_processed (at);
"""

#: A new row (a new ``seq``) also for an id recorded before: ``seq`` orders by recording,
#: so keeping the newest ``max_entries`` is one range delete on the primary key.
_RECORD = "INSERT OR REPLACE INTO mq_processed (grp, id, at) VALUES (?, ?, ?)"

#: Records between two prunes of expired and surplus ids (one indexed DELETE each).
PRUNE_EVERY = 1000


class PruneCounter:
    """Counts records across threads and calls ``prune(now)`` once every ``PRUNE_EVERY``
    of them: when a durable store deletes its expired and surplus ids (SQLite,
    PostgreSQL)."""

    def __init__(self, prune: Callable[[float], object]) -> None:
        self._prune = prune
        self._lock = threading.Lock()
        self._since = 0

    def record(self, now: float) -> None:
        """Count one record; prune (on this thread) when it is the ``PRUNE_EVERY``-th."""
        with self._lock:
            self._since += 1
            if self._since < PRUNE_EVERY:
                return
            self._since = 0
        self._prune(now)


class SQLiteStore(DedupeStore):
    """Ids in a SQLite file: survives restarts, shared by every process on one machine.

    WAL mode, one short transaction per call on a connection per thread; a write lock held
    by another process longer than ``busy_timeout`` raises the retryable ``Timeout``.
    Expired and surplus ids are pruned every ``PRUNE_EVERY`` records.
    """

    blocking = True

    def __init__(self, path: str | os.PathLike[str], *, retention: float = DEFAULT_RETENTION,
                 max_entries: int = 10_000_000, busy_timeout: float = 30.0,
                 clock: Clock | None = None) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise InvalidArgument(f"path must be a file path, got {path!r}")
        self.retention, self.max_entries = _check(retention, max_entries)
        if isinstance(busy_timeout, bool) or not isinstance(busy_timeout, (int, float)) \
                or not 0 < busy_timeout < math.inf:
            raise InvalidArgument(f"busy_timeout must be seconds > 0, got {busy_timeout!r}")
        self.path = Path(path)
        self.busy_timeout = float(busy_timeout)
        self._time = (clock or SystemClock()).time
        self._local = threading.local()
        # Every thread's connection with the lock held while it is used: close() takes each
        # lock, so it never closes a connection under another thread's call (a crash).
        self._conns: dict[threading.Thread, tuple[sqlite3.Connection, threading.RLock]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._prunes = PruneCounter(self.prune)
        self._pid = os.getpid()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"dedupe store {self.path}: {exc.strerror}") from exc
        self._run("open", lambda c: c.executescript(_SCHEMA))

    # -- connections -----------------------------------------------------------------------
    def _entry(self) -> tuple[sqlite3.Connection, threading.RLock]:
        """This thread's connection (made on first use; never shared with a forked child)."""
        entry: tuple[sqlite3.Connection, threading.RLock] | None = getattr(
            self._local, "entry", None)
        if entry is not None and self._pid == os.getpid():
            return entry
        with self._lock:
            if self._closed:
                raise StoreError(f"dedupe store {self.path} is closed")
            if self._pid != os.getpid():  # a forked child: the parent's connections are not ours
                self._pid, self._conns, self._local = os.getpid(), {}, threading.local()
            gone = [t for t in self._conns if not t.is_alive()]
            stale = [self._conns.pop(t) for t in gone]
        for conn, lock in stale:  # connections of threads that ended (a consume's pool)
            with lock, contextlib.suppress(sqlite3.Error):
                conn.close()
        conn = open_wal(str(self.path), timeout=self.busy_timeout,
                        what=f"dedupe store {self.path}: open")
        entry = (conn, threading.RLock())
        with self._lock:
            if self._closed:
                conn.close()
                raise StoreError(f"dedupe store {self.path} is closed")
            self._conns[threading.current_thread()] = entry
        self._local.entry = entry
        return entry

    def _error(self, what: str, exc: sqlite3.Error) -> StoreError:
        return StoreError(f"dedupe store {self.path}: {what}: {exc}")

    @contextlib.contextmanager
    def _held(self, what: str) -> Iterator[sqlite3.Connection]:
        """This thread's connection with its lock held, while the store is open."""
        try:
            conn, lock = self._entry()
        except sqlite3.Error as exc:
            raise self._error(what, exc) from exc
        with lock:
            if self._closed:
                raise StoreError(f"dedupe store {self.path} is closed")
            yield conn

    def _run(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn`` on this thread's connection, waiting out other writers (``Timeout`` after
        ``busy_timeout``); any other sqlite error is a ``StoreError``."""
        with self._held(what) as conn:
            try:
                return retry_busy(lambda: fn(conn), timeout=self.busy_timeout,
                                  what=f"dedupe store {self.path}: {what}")
            except sqlite3.Error as exc:
                raise self._error(what, exc) from exc

    # -- the store ---------------------------------------------------------------------------
    def seen(self, group: str, mid: str) -> bool:
        key = _key(group, mid)
        cutoff = self._time() - self.retention
        row = self._run("seen", lambda c: c.execute(
            "SELECT 1 FROM mq_processed WHERE grp = ? AND id = ? AND at > ?",
            (*key, cutoff)).fetchone())
        return row is not None

    def record(self, group: str, mid: str) -> None:
        key = _key(group, mid)
        now = self._time()
        self._run("record", lambda c: c.execute(
            _RECORD, (*key, now)))
        self._prunes.record(now)

    @contextlib.contextmanager
    def transaction(self, msg: Message) -> Iterator[sqlite3.Connection]:
        """A write transaction on this store's file that also records ``msg`` as processed.

        Write the handler's side effects through the connection it yields: they commit
        together with the id, or (an exception, a crash) neither does. Raises ``Duplicate``
        before the block runs when the group already processed this id; the consume loop
        then acks the message. The write lock is held until the block ends: keep it short.
        """
        key = _key(msg.group, msg.id)
        with self._held("transaction") as conn, self._transaction(conn, key) as db:
            yield db

    @contextlib.contextmanager
    def _transaction(self, conn: sqlite3.Connection, key: tuple[str, str]
                     ) -> Iterator[sqlite3.Connection]:
        try:  # only the BEGIN is retried: the caller's block runs once
            retry_busy(lambda: conn.execute("BEGIN IMMEDIATE"), timeout=self.busy_timeout,
                       what=f"dedupe store {self.path}: transaction")
        except sqlite3.Error as exc:
            raise self._error("transaction", exc) from exc
        try:
            now = self._time()
            if conn.execute("SELECT 1 FROM mq_processed WHERE grp = ? AND id = ? AND at > ?",
                            (*key, now - self.retention)).fetchone() is not None:
                raise Duplicate(f"message {key[1]!r} was already processed by group "
                                f"{key[0]!r}")
            yield conn
            conn.execute(_RECORD, (*key, now))
            conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise self._error("transaction", exc) from exc
            raise
        self._prunes.record(now)

    def prune(self, now: float | None = None) -> int:
        """Forget expired ids and the oldest beyond ``max_entries``; returns how many."""
        cutoff = (self._time() if now is None else now) - self.retention

        def go(c: sqlite3.Connection) -> int:
            with immediate(c):
                gone = c.execute("DELETE FROM mq_processed WHERE at <= ?", (cutoff,)).rowcount
                gone += c.execute(
                    "DELETE FROM mq_processed WHERE seq <= "
                    "(SELECT max(seq) FROM mq_processed) - ?", (self.max_entries,)).rowcount
            return int(gone)

        return self._run("prune", go)

    def __len__(self) -> int:
        return int(self._run("count", lambda c: c.execute(
            "SELECT count(*) FROM mq_processed").fetchone()[0]))

    def close(self) -> None:
        """Close every thread's connection, each once no call is using it (idempotent)."""
        with self._lock:
            self._closed = True
            entries, self._conns = list(self._conns.values()), {}
        for conn, lock in entries:
            with lock, contextlib.suppress(sqlite3.Error):
                conn.close()

    def __repr__(self) -> str:
        return (f"SQLiteStore({str(self.path)!r}, retention={self.retention:g}, "
                f"max_entries={self.max_entries})")


def __getattr__(name: str) -> object:
    """``PostgresStore`` from here, imported when first asked for (it needs psycopg)."""
    if name == "PostgresStore":
        import importlib

        try:
            module = importlib.import_module("mqabstract.backends.postgresql.dedupe")
        except ImportError as exc:
            from .errors import MissingDependency

            raise MissingDependency("PostgresStore needs mqabstract[postgresql] "
                                    "(psycopg 3)") from exc
        return module.PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
