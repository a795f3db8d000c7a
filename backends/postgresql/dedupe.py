"""``PostgresStore``: processed ids in the application's PostgreSQL database, so a
handler's side effect and its message's id commit in one transaction (``transaction``).

Table ``<schema>.mq_processed`` (primary key (group, id)). ``transaction(msg)`` records the
id *first*, inside a transaction on the application's connection: a second delivery of the
same id running at the same time waits on the first one's row and, once that commits, finds
it (``Duplicate``); when the first rolls back (its handler failed, its process died) the
second processes the message. So the effect happens once, whatever is killed when.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from mqabstract.clock import Clock, SystemClock
from mqabstract.dedupe import DEFAULT_RETENTION, DedupeStore, PruneCounter, _check, _key
from mqabstract.errors import Closed, Duplicate, InvalidArgument
from mqabstract.url import BrokerURL

from .schema import check_schema
from .store import translate

if TYPE_CHECKING:
    from mqabstract.message import Message

__all__ = ["PostgresStore"]

T = TypeVar("T")
Conn = psycopg.Connection[Any]


class PostgresStore(DedupeStore):
    """Processed ids in PostgreSQL. ``target``: a ``postgresql://`` URL (the store keeps a
    small pool of its own), the application's ``psycopg_pool.ConnectionPool``, or one
    ``psycopg.Connection`` (used by one call at a time). ``schema`` holds the table
    (created when missing)."""

    blocking = True

    def __init__(self, target: str | ConnectionPool[Any] | Conn, *, schema: str = "mq",
                 retention: float = DEFAULT_RETENTION, max_entries: int = 10_000_000,
                 clock: Clock | None = None, pool_size: int = 4,
                 connect_timeout: float = 10.0) -> None:
        self.retention, self.max_entries = _check(retention, max_entries)
        self.schema = check_schema(schema)
        self._time = (clock or SystemClock()).time
        self._password: str | None = None
        self._pool: ConnectionPool[Any] | None = None
        self._one: Conn | None = None
        self._own = False
        self._lock = threading.RLock()
        self._prunes = PruneCounter(self.prune)
        if isinstance(target, str):
            url = BrokerURL.parse(target)
            if url.scheme not in ("postgresql", "postgres") or not url.hosts or not url.path:
                raise InvalidArgument(f"PostgresStore needs postgresql://user:pass@host/db, "
                                      f"not {url.redacted()}")
            self.where, self._password = url.redacted(), url.password
            conninfo = psycopg.conninfo.make_conninfo(
                host=",".join(h for h, _ in url.hosts),
                port=",".join(str(p or 5432) for _, p in url.hosts), dbname=url.path,
                user=url.username or "")
            self._pool = ConnectionPool(
                conninfo, kwargs={"autocommit": True, "password": url.password,
                                  "connect_timeout": max(2, math.ceil(connect_timeout)),
                                  "application_name": "mqabstract-dedupe"},
                min_size=1, max_size=pool_size, open=False, timeout=connect_timeout,
                name="mqabstract-dedupe")
            self._own = True
            with self._translate("open"):
                self._pool.open(wait=True, timeout=connect_timeout)
        elif isinstance(target, ConnectionPool):
            self._pool, self.where = target, f"pool {target.name}"
        elif isinstance(target, psycopg.Connection):
            info = target.info
            self._one = target
            self.where = f"postgresql://{info.user}@{info.host}:{info.port}/{info.dbname}"
        else:
            raise InvalidArgument("PostgresStore takes a postgresql:// URL, a psycopg_pool "
                                  f"ConnectionPool or a psycopg Connection, not "
                                  f"{type(target).__name__}")
        self._closed = False
        self._run("open", self._setup)

    # -- connections ------------------------------------------------------------------------
    def _translate(self, what: str) -> contextlib.AbstractContextManager[None]:
        return translate(f"dedupe store {what}", self.where, self._password,
                         kind="dedupe store")

    @contextlib.contextmanager
    def _conn(self, what: str) -> Iterator[Conn]:
        if self._closed:
            raise Closed(f"dedupe store {self.where} is closed")
        if self._one is not None:
            with self._lock:
                yield self._one
        else:
            assert self._pool is not None
            with self._pool.connection() as conn:
                yield conn

    def _run(self, what: str, fn: Callable[[Conn], T]) -> T:
        """``fn`` in a transaction of its own on a connection of the store."""
        with self._translate(what), self._conn(what) as conn, conn.transaction():
            return fn(conn)

    def _setup(self, conn: Conn) -> None:
        s = self.schema
        found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{s}.mq_processed_seq",)
                             ).fetchone()
        if found is not None and found[0]:  # (DDL would wait for open transactions)
            return
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 1837))",
                     (f"mqabstract:{s}",))
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
        conn.execute(f"CREATE TABLE IF NOT EXISTS {s}.mq_processed (seq bigserial NOT NULL,"
                     " grp text NOT NULL, id text NOT NULL, at double precision NOT NULL,"
                     " PRIMARY KEY (grp, id))")
        conn.execute(f"CREATE INDEX IF NOT EXISTS mq_processed_at ON {s}.mq_processed (at)")
        conn.execute(f"CREATE INDEX IF NOT EXISTS mq_processed_seq ON {s}.mq_processed (seq)")

    def _record(self, conn: Conn, key: tuple[str, str], now: float) -> bool:
        """Record ``key`` processed at ``now``; False when it already was (within the
        retention: an older record is taken over)."""
        s = self.schema
        return conn.execute(
            f"INSERT INTO {s}.mq_processed AS p (grp, id, at) VALUES (%s, %s, %s)"
            " ON CONFLICT (grp, id) DO UPDATE SET at = excluded.at, seq = excluded.seq"
            " WHERE p.at <= %s RETURNING 1",
            (*key, now, now - self.retention)).fetchone() is not None

    # -- the store ---------------------------------------------------------------------------
    def seen(self, group: str, mid: str) -> bool:
        key = _key(group, mid)
        cutoff = self._time() - self.retention
        return self._run("seen", lambda c: c.execute(
            f"SELECT 1 FROM {self.schema}.mq_processed WHERE grp = %s AND id = %s AND at > %s",
            (*key, cutoff)).fetchone()) is not None

    def record(self, group: str, mid: str) -> None:
        key = _key(group, mid)
        now = self._time()
        s = self.schema
        self._run("record", lambda c: c.execute(
            f"INSERT INTO {s}.mq_processed (grp, id, at) VALUES (%s, %s, %s)"
            " ON CONFLICT (grp, id) DO UPDATE SET at = excluded.at, seq = excluded.seq",
            (*key, now)))
        self._prunes.record(now)

    @contextlib.contextmanager
    def transaction(self, msg: Message) -> Iterator[Conn]:
        """A transaction on the application's database that also records ``msg`` as
        processed: write the handler's side effects through the connection it yields; they
        commit with the id, or (an exception, a crash) neither does. ``Duplicate`` before
        the block runs when the group already processed this id (the consume loop then acks
        it). A concurrent delivery of the same id waits for this one to end."""
        key = _key(msg.group, msg.id)
        now = self._time()
        with self._translate("transaction"), self._conn("transaction") as conn, \
                conn.transaction():
            if not self._record(conn, key, now):
                raise Duplicate(f"message {key[1]!r} was already processed by group "
                                f"{key[0]!r}")
            yield conn
        self._prunes.record(now)

    def prune(self, now: float | None = None) -> int:
        """Forget expired ids and the oldest beyond ``max_entries``; returns how many."""
        cutoff = (self._time() if now is None else now) - self.retention
        s = self.schema

        def go(c: Conn) -> int:
            gone = c.execute(f"DELETE FROM {s}.mq_processed WHERE at <= %s", (cutoff,)).rowcount
            gone += c.execute(f"DELETE FROM {s}.mq_processed WHERE seq <= (SELECT max(seq)"
                              f" FROM {s}.mq_processed) - %s", (self.max_entries,)).rowcount
            return int(gone)

        return self._run("prune", go)

    def __len__(self) -> int:
        return int(self._run("count", lambda c: c.execute(
            f"SELECT count(*) FROM {self.schema}.mq_processed").fetchone()[0]))  # type: ignore[index]

    def close(self) -> None:
        """Close the store's own pool (a pool or connection passed in stays open)."""
        self._closed = True
        if self._own and self._pool is not None:
            with self._translate("close"):
                self._pool.close()

    def __repr__(self) -> str:
        return (f"PostgresStore({self.where!r}, schema={self.schema!r}, "
                f"retention={self.retention:g}, max_entries={self.max_entries})")
