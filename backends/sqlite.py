"""Embedded durable backend on the standard library's ``sqlite3`` (WAL mode).

``sqlite:///relative/path.db`` (relative to the working directory) or
``sqlite:////absolute/path.db`` — the SQLAlchemy convention. The parent directory is created
on open. One file is shared safely by any number of processes and threads on one machine:

* every write is one ``BEGIN IMMEDIATE`` transaction (the busy handler waits for the write
  lock; a lock that stays busy past ``busy_timeout`` raises the retryable ``Timeout``);
* receiving claims rows with a single ``UPDATE ... RETURNING`` that stamps a fresh random
  lease token, so two consumers never hold the same lease, and a receipt whose token was
  replaced (the lease expired and someone else took the message) settles nothing;
* an idle ``receive`` does not touch the tables: it re-queries only when ``PRAGMA
  data_version`` says another connection committed, a writer in this process signalled a
  shared ``threading.Condition``, or the earliest lease/delay of the group fell due. The poll
  interval backs off from ``poll_min`` to ``poll_max``.

Schema: ``mq_queue`` holds one row per (group, message) — a publish is fanned out to every
matching group inside its transaction, so a group only ever sees messages published after
it was declared. ``state`` is 0 ready, 1 leased, 2 delayed; ``due`` is when a leased or
delayed row becomes ready again. Partial indexes keep the ready set ordered by
(priority desc, seq) and the waiting set ordered by due, so receive and ack are O(log n).
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from mqabstract import wire
from mqabstract.capabilities import Capabilities
from mqabstract.clock import Clock, SystemClock
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.emulation.routes import Routes
from mqabstract.emulation.sqlitedb import immediate, open_wal, retry_busy
from mqabstract.emulation.wakeup import Waker
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    InvalidURL,
    NotFound,
)
from mqabstract.model import Columns, DeadLetter, Delivery, Envelope, GroupSpec, GroupStats, utc
from mqabstract.options import CLOCK, Option, parse_options
from mqabstract.url import BrokerURL

__all__ = ["SQLiteDriver"]

T = TypeVar("T")

SCHEMA_VERSION = 1
READY, LEASED, DELAYED = 0, 1, 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS mq_meta (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS mq_groups (
    gid          INTEGER PRIMARY KEY,
    name         TEXT NOT NULL UNIQUE,
    pattern      TEXT NOT NULL,
    max_attempts INTEGER NOT NULL,
    lease        REAL NOT NULL,
    ordered      INTEGER NOT NULL,
    created_at   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS mq_queue (
    seq          INTEGER PRIMARY KEY,
    gid          INTEGER NOT NULL,
    state        INTEGER NOT NULL,
    due          REAL NOT NULL,
    priority     INTEGER NOT NULL,
    attempts     INTEGER NOT NULL,
    token        INTEGER NOT NULL,
    key          TEXT,
    id           TEXT NOT NULL,
    topic        TEXT NOT NULL,
    published_at REAL NOT NULL,
    headers      TEXT,
    body         BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS mq_queue_ready ON mq_queue (gid, priority DESC, seq)
    WHERE state = 0;
CREATE INDEX IF NOT EXISTS mq_queue_waiting ON mq_queue (gid, due) WHERE state <> 0;
CREATE INDEX IF NOT EXISTS mq_queue_key ON mq_queue (gid, key, seq) WHERE key IS NOT NULL;
CREATE TABLE IF NOT EXISTS mq_dead (
    dseq         INTEGER PRIMARY KEY,
    gid          INTEGER NOT NULL,
    id           TEXT NOT NULL,
    topic        TEXT NOT NULL,
    key          TEXT,
    priority     INTEGER NOT NULL,
    published_at REAL NOT NULL,
    headers      TEXT,
    body         BLOB NOT NULL,
    attempts     INTEGER NOT NULL,
    reason       TEXT NOT NULL,
    dead_at      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS mq_dead_gid ON mq_dead (gid, dseq);
CREATE INDEX IF NOT EXISTS mq_dead_id ON mq_dead (gid, id);
"""

_INSERT = (
    "INSERT INTO mq_queue (gid, state, due, priority, attempts, token, key, id, topic,"
    " published_at, headers, body) VALUES (?, ?, ?, ?, 0, 0, ?, ?, ?, ?, ?, ?)"
)
_RETURNING = "RETURNING seq, id, topic, body, headers, key, priority, attempts, published_at"
_CLAIM = (
    "UPDATE mq_queue SET state = 1, due = ?, attempts = attempts + 1, token = ?"
    " WHERE seq IN (SELECT seq FROM mq_queue WHERE gid = ? AND state = 0"
    " ORDER BY priority DESC, seq LIMIT ?) " + _RETURNING
)
# Ordered groups: a keyed row is deliverable only when it is the oldest row of its key in
# the group (an earlier one leased, delayed or ready blocks it), SQS-FIFO style.
_CLAIM_ORDERED = (
    "UPDATE mq_queue SET state = 1, due = ?, attempts = attempts + 1, token = ?"
    " WHERE seq IN (SELECT q.seq FROM mq_queue q WHERE q.gid = ? AND q.state = 0"
    " AND (q.key IS NULL OR NOT EXISTS (SELECT 1 FROM mq_queue p"
    " WHERE p.gid = q.gid AND p.key = q.key AND p.seq < q.seq))"
    " ORDER BY q.priority DESC, q.seq LIMIT ?) " + _RETURNING
)
_PROMOTE = "UPDATE mq_queue SET state = 0 WHERE gid = ? AND state <> 0 AND due <= ?"
_NEXT_DUE = "SELECT min(due) FROM mq_queue WHERE gid = ? AND state <> 0"
_DEAD_COLUMNS = "gid, id, topic, key, priority, published_at, headers, body"

_SYNC = {"normal": "NORMAL", "full": "FULL", "extra": "EXTRA"}


#: per file, per process: writers of every driver on the file wake each other's receivers
_shared: dict[str, Waker] = {}
_shared_lock = threading.Lock()


def _shared_for(path: str) -> Waker:
    with _shared_lock:
        state = _shared.get(path)
        if state is None:
            state = _shared[path] = Waker()
        return state


def _db_path(url: BrokerURL) -> Path:
    """SQLAlchemy convention: ``sqlite:///rel.db`` is relative, ``sqlite:////abs.db`` absolute."""
    if url.hosts:
        raise InvalidURL(
            f"sqlite URLs have no host: use sqlite:///relative.db or sqlite:////abs.db, "
            f"not {url.redacted()!r}"
        )
    if not url.path or url.path.endswith("/"):
        raise InvalidURL(f"sqlite URL needs a file path, e.g. sqlite:///data/mq.db: {url}")
    if url.path == ":memory:" or url.path.startswith("file:"):
        raise InvalidURL("in-memory SQLite cannot be shared; use memory:// instead")
    return Path(url.path).expanduser().resolve()


def _headers_json(headers: Mapping[str, str]) -> str | None:
    return json.dumps(dict(headers), separators=(",", ":"), ensure_ascii=False) if headers else None


def _headers(text: str | None) -> dict[str, str]:
    return json.loads(text) if text else {}


class SQLiteDriver(Driver):
    """A SQLite file as a durable, multi-process broker."""

    name: ClassVar[str] = "sqlite"
    CAPABILITIES = Capabilities.all_native(
        max_body_bytes=16 * 1024 * 1024,
        max_batch=10_000,
        max_receive=1000,
        min_lease=0.05,
        shared_between_processes=True,
        durable=True,
        key_gate="broker",  # a key's later rows wait behind its unsettled head
    )
    OPTIONS: ClassVar[dict[str, Option]] = {
        "busy_timeout": Option(
            float, 10.0, "seconds to wait for another process's write lock before Timeout",
            min=0,
        ),
        "synchronous": Option(
            str, "full",
            "full (a returned publish survives power loss) or normal (process crashes only)",
            choices=tuple(_SYNC),
        ),
        "poll_min": Option(float, 0.005, "first idle re-check interval of receive, seconds",
                           min=0),
        "poll_max": Option(float, 0.1, "longest idle re-check interval of receive, seconds",
                           min=0),
        "clock": CLOCK,
    }

    def __init__(self, url: BrokerURL, path: Path, opts: Mapping[str, Any]) -> None:
        self.url = url
        self.path = path
        self.clock: Clock = opts["clock"] or SystemClock()
        self.synchronous = _SYNC[opts["synchronous"]]
        self.busy_timeout = float(opts["busy_timeout"])
        self.poll_min = max(0.001, float(opts["poll_min"]))
        self.poll_max = max(self.poll_min, float(opts["poll_max"]))
        self._lock = threading.RLock()
        self._closed = False
        self._shared = _shared_for(str(path))
        self._groups_version = -1
        self._routes: Routes[int] = Routes()
        self._conn = self._connect()
        self.clock.on_advance(self._shared.wake)  # FakeClock.advance wakes every receiver
        # Connection.getlimit is Python 3.11+; 3.10 gets SQLite's compiled-in default.
        getlimit = getattr(self._conn, "getlimit", None)
        limit = getlimit(getattr(sqlite3, "SQLITE_LIMIT_LENGTH", 0)) if getlimit else 10**9
        self._caps = replace(self.CAPABILITIES,
                             max_body_bytes=min(self.CAPABILITIES.max_body_bytes, limit))

    # -- connection -----------------------------------------------------------------------
    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> SQLiteDriver:
        opts = parse_options(url, options, cls.OPTIONS, cls.name)
        return cls(url, _db_path(url), opts)

    def _connect(self) -> sqlite3.Connection:
        where = self.url.redacted()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConnectionFailed(f"cannot create the directory for {where}: {exc}") from exc
        try:
            conn = open_wal(str(self.path), timeout=self.busy_timeout,
                            what=f"sqlite open {where}", synchronous=self.synchronous,
                            cached_statements=64)
        except sqlite3.Error as exc:
            raise ConnectionFailed(f"cannot open {where}: {exc}") from exc
        try:
            self._retry(lambda: self._init_schema(conn), "open")
        except BaseException:
            conn.close()
            raise
        return conn

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise ConnectionFailed(
                f"{self.url} was written by a newer mqabstract (schema {version})"
            )
        with immediate(conn):
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.execute("INSERT OR IGNORE INTO mq_meta VALUES ('groups', 0)")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn``, waiting out other writers (the toolkit's ``retry_busy``); any other
        sqlite error becomes ``ConnectionFailed`` naming the redacted URL."""
        where = self.url.redacted()
        try:
            return retry_busy(fn, timeout=self.busy_timeout, what=f"sqlite {what} on {where}")
        except sqlite3.Error as exc:
            raise ConnectionFailed(f"sqlite {what} on {where} failed: {exc}") from exc

    def _write(self, fn: Callable[[sqlite3.Connection], T], what: str,
               wake: Collection[int] = ()) -> T:
        """Run ``fn`` in one ``BEGIN IMMEDIATE`` transaction (whole thing retried on busy)."""

        def txn() -> T:
            with immediate(self._conn) as conn:
                return fn(conn)

        with self._lock:
            self._check_open()
            result = self._retry(txn, what)
        if wake:
            self._shared.wake(wake)
        return result

    def _read(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        with self._lock:
            self._check_open()
            return self._retry(lambda: fn(self._conn), what)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed(f"sqlite broker {self.url} is closed")

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def now(self) -> float:
        return self.clock.time()

    # -- routing --------------------------------------------------------------------------
    def _route(self, conn: sqlite3.Connection, topic: str) -> tuple[int, ...]:
        """Group ids whose pattern matches ``topic``. Any connection may declare or delete
        groups: a changed groups version in the file reloads the set into ``Routes``."""
        version = conn.execute("SELECT value FROM mq_meta WHERE name = 'groups'").fetchone()[0]
        if version != self._groups_version:
            self._routes.replace(conn.execute("SELECT gid, pattern FROM mq_groups"))
            self._groups_version = version
        return self._routes.groups_for(topic)

    def _bump_groups(self, conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE mq_meta SET value = value + 1 WHERE name = 'groups'")

    def _gid(self, conn: sqlite3.Connection, group: str) -> int:
        row = conn.execute("SELECT gid FROM mq_groups WHERE name = ?", (group,)).fetchone()
        if row is None:
            raise NotFound(f"group {group!r} does not exist on {self.url}")
        return int(row[0])

    # -- publishing -----------------------------------------------------------------------
    def publish(self, envelopes: Sequence[Envelope]) -> None:
        def txn(conn: sqlite3.Connection) -> None:
            rows = []
            routes: dict[str, tuple[int, ...]] = {}
            touched.clear()
            for env in envelopes:
                gids = routes.get(env.topic)
                if gids is None:
                    gids = routes[env.topic] = self._route(conn, env.topic)
                if not gids:
                    continue
                touched.update(gids)
                if env.deliver_at is not None:
                    state, due = DELAYED, env.deliver_at
                else:
                    state, due = READY, 0.0
                headers = _headers_json(env.headers)
                for gid in gids:
                    rows.append((gid, state, due, env.priority, env.key, env.id, env.topic,
                                 env.published_at, headers, env.body))
            if rows:
                conn.executemany(_INSERT, rows)

        touched: set[int] = set()
        self._write(txn, "publish", wake=touched)

    def publish_columns(self, columns: Columns) -> None:
        """One topic: routed once, headers encoded once when every row shares them, and
        the rows zipped straight into ``executemany``."""
        topic, at = columns.topic, columns.published_at
        shared = _headers_json(columns.headers)
        n = len(columns.ids)
        row_headers = None if columns.row_headers is None else [
            _headers_json({**columns.headers, **own}) if own else shared
            for own in columns.row_headers
        ]

        def txn(conn: sqlite3.Connection) -> None:  # (may run again: fresh iterators)
            gids = self._route(conn, topic)
            touched.clear()
            touched.update(gids)
            for gid in gids:
                conn.executemany(_INSERT, zip(
                    repeat(gid), repeat(READY), repeat(0.0), repeat(0),
                    columns.keys if columns.keys is not None else repeat(None, n),
                    columns.ids, repeat(topic), repeat(at),
                    row_headers if row_headers is not None else repeat(shared, n),
                    columns.bodies))

        touched: set[int] = set()
        self._write(txn, "publish", wake=touched)

    # -- groups -----------------------------------------------------------------------------
    def declare(self, spec: GroupSpec) -> None:
        def txn(conn: sqlite3.Connection) -> None:
            row = conn.execute(
                "SELECT pattern, max_attempts, lease, ordered FROM mq_groups WHERE name = ?",
                (spec.name,),
            ).fetchone()
            wanted = (spec.pattern, spec.max_attempts, spec.lease, int(spec.ordered))
            if row is None:
                conn.execute(
                    "INSERT INTO mq_groups (name, pattern, max_attempts, lease, ordered,"
                    " created_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (spec.name, *wanted, self.now()),
                )
                self._bump_groups(conn)
            elif row[0] != spec.pattern:
                raise InvalidArgument(
                    f"group {spec.name!r} exists with pattern {row[0]!r}, not {spec.pattern!r}"
                )
            elif tuple(row) != wanted:  # policy (lease, attempts) follows the latest declare
                conn.execute(
                    "UPDATE mq_groups SET max_attempts = ?, lease = ?, ordered = ?"
                    " WHERE name = ?",
                    (*wanted[1:], spec.name),
                )

        self._write(txn, "declare")

    def subscribe(self, spec: GroupSpec) -> SQLiteSubscription:
        gid = self._read(lambda conn: self._gid(conn, spec.name), "subscribe")
        return SQLiteSubscription(self, spec, gid)

    def delete_group(self, group: str) -> None:
        def txn(conn: sqlite3.Connection) -> None:
            gid = self._gid(conn, group)
            conn.execute("DELETE FROM mq_queue WHERE gid = ? AND state = 0", (gid,))
            conn.execute("DELETE FROM mq_queue WHERE gid = ? AND state <> 0", (gid,))
            conn.execute("DELETE FROM mq_dead WHERE gid = ?", (gid,))
            conn.execute("DELETE FROM mq_groups WHERE gid = ?", (gid,))
            self._bump_groups(conn)

        self._write(txn, "delete_group")

    def stats(self, group: str) -> GroupStats:
        now = self.now()

        def read(conn: sqlite3.Connection) -> GroupStats:
            gid = self._gid(conn, group)
            ready = conn.execute(
                "SELECT count(*) FROM mq_queue WHERE gid = ? AND state = 0", (gid,)
            ).fetchone()[0]
            waiting = dict.fromkeys((READY, LEASED, DELAYED), 0)
            for state, due_now, count in conn.execute(
                "SELECT state, due <= ?, count(*) FROM mq_queue WHERE gid = ? AND state <> 0"
                " GROUP BY state, due <= ?", (now, gid, now),
            ):
                waiting[READY if due_now else state] += count
            dead = conn.execute(
                "SELECT count(*) FROM mq_dead WHERE gid = ?", (gid,)
            ).fetchone()[0]
            return GroupStats(group, ready + waiting[READY], waiting[LEASED],
                              waiting[DELAYED], dead)

        return self._read(read, "stats")

    def groups(self) -> list[str]:
        return self._read(lambda conn: [name for (name,) in conn.execute(
            "SELECT name FROM mq_groups")], "groups")

    def ping(self) -> None:
        """A query on the database file (its lock and a page read)."""
        self._read(lambda conn: conn.execute("SELECT count(*) FROM mq_dead").fetchone(),
                   "ping")

    # -- dead letters -----------------------------------------------------------------------
    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        def read(conn: sqlite3.Connection) -> list[DeadLetter]:
            gid = self._gid(conn, group)
            rows = conn.execute(
                "SELECT id, topic, body, headers, key, priority, published_at, attempts,"
                " reason, dead_at FROM mq_dead WHERE gid = ? ORDER BY dseq LIMIT ?",
                (gid, limit),
            ).fetchall()
            return [
                DeadLetter(r[0], r[1], bytes(r[2]), _headers(r[3]), r[4], r[5], utc(r[6]),
                           r[7], r[8], utc(r[9]))
                for r in rows
            ]

        return self._read(read, "dead_letters")

    @staticmethod
    def _id_filter(ids: Collection[str] | None) -> tuple[str, tuple[Any, ...]]:
        if ids is None:
            return "", ()
        return " AND id IN (SELECT value FROM json_each(?))", (json.dumps(sorted(ids)),)

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        where, args = self._id_filter(ids)

        gids: list[int] = []

        def txn(conn: sqlite3.Connection) -> int:
            gid = self._gid(conn, group)
            gids[:] = [gid]
            cur = conn.execute(
                "INSERT INTO mq_queue (gid, state, due, priority, attempts, token, key, id,"
                " topic, published_at, headers, body) SELECT gid, 0, 0, priority, 0, 0, key,"
                # A replay drops the TTL: an expired message would expire again at once.
                " id, topic, published_at, json_remove(headers, '$.\"" + wire.EXPIRES_AT
                + "\"'), body FROM mq_dead WHERE gid = ?"
                + where + " ORDER BY dseq",
                (gid, *args),
            )
            moved = cur.rowcount
            conn.execute("DELETE FROM mq_dead WHERE gid = ?" + where, (gid, *args))
            return int(moved)

        return self._write(txn, "replay_dead_letters", wake=gids)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        where, args = self._id_filter(ids)

        def txn(conn: sqlite3.Connection) -> int:
            gid = self._gid(conn, group)
            return int(conn.execute(
                "DELETE FROM mq_dead WHERE gid = ?" + where, (gid, *args)
            ).rowcount)

        return self._write(txn, "purge_dead_letters")

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.close()
            except sqlite3.Error as exc:
                raise ConnectionFailed(f"sqlite close of {self.url.redacted()} failed: "
                                       f"{exc}") from exc
        self._shared.wake()  # receivers of this driver notice the close


class SQLiteSubscription(DriverSubscription):
    """One consumer of one group; receipts are ``(seq, lease_token)``."""

    def __init__(self, driver: SQLiteDriver, spec: GroupSpec, gid: int) -> None:
        self._d = driver
        self._gid = gid
        self._lease = spec.lease
        self._claim = _CLAIM_ORDERED if spec.ordered else _CLAIM
        # settling the head of a key unblocks the next one only in ordered groups
        self._wake_on_settle: tuple[int, ...] = (gid,) if spec.ordered else ()
        self._held: dict[int, int] = {}  # seq -> token of leases this consumer holds
        self._closed = False
        self._seen_version: int | None = None
        self._seen: tuple[int, int] = (-1, -1)
        self._next_due: float | None = None

    def _try_claim(self, max_messages: int) -> list[Delivery]:
        d = self._d
        now = d.now()
        token = random.getrandbits(62) or 1
        gid = self._gid

        def txn(conn: sqlite3.Connection) -> list[Any]:
            conn.execute(_PROMOTE, (gid, now))
            cur = conn.execute(self._claim, (now + self._lease, token, gid, max_messages))
            rows = cur.fetchall()
            if not rows:
                self._next_due = conn.execute(_NEXT_DUE, (gid,)).fetchone()[0]
            return rows

        with d._lock:
            # Record what we have seen *before* looking, so a commit racing with this
            # claim still changes data_version / gen and triggers another look.
            self._seen = d._shared.stamp(self._gid)
            self._seen_version = d._read(
                lambda c: c.execute("PRAGMA data_version").fetchone()[0], "receive")
            rows = d._write(txn, "receive")
        if not rows:
            return []
        rows.sort(key=lambda r: (-r[6], r[0]))
        out = []
        for seq, mid, topic, body, headers, key, prio, attempts, published in rows:
            self._held[seq] = token
            out.append(Delivery(mid, topic, bytes(body), _headers(headers), key, prio,
                                attempts, published, (seq, token)))
        return out

    def _changed(self) -> bool:
        """Cheap idle check: did anything happen that could make a message deliverable?"""
        d = self._d
        if d._shared.stamp(self._gid) != self._seen:
            return True
        if self._next_due is not None and d.now() >= self._next_due:
            return True
        version = d._read(lambda c: c.execute("PRAGMA data_version").fetchone()[0], "receive")
        return bool(version != self._seen_version)

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        self._check_open()
        d = self._d
        deadline = time.monotonic() + timeout
        interval = d.poll_min
        out = self._try_claim(max_messages)
        while not out:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed or d._closed:
                return []
            wait = min(interval, remaining)
            if self._next_due is not None and isinstance(d.clock, SystemClock):
                wait = min(wait, max(0.0, self._next_due - d.now()) + 0.001)
            woken = d._shared.wait(self._gid, self._seen, wait)
            if self._closed or d._closed:
                return []
            interval = d.poll_min if woken else min(interval * 2, d.poll_max)
            if self._changed():
                out = self._try_claim(max_messages)
        return out

    def ack(self, receipts: Sequence[Any]) -> None:
        self._check_open()
        if not receipts:
            return
        now = self._d.now()
        for seq, _ in receipts:
            self._held.pop(seq, None)
        self._d._write(
            lambda conn: conn.executemany(
                "DELETE FROM mq_queue WHERE seq = ? AND token = ? AND state = 1 AND due > ?",
                [(seq, token, now) for seq, token in receipts]),
            "ack", wake=self._wake_on_settle,
        )

    def nack(self, receipt: Any, delay: float) -> None:
        self._check_open()
        seq, token = receipt
        self._held.pop(seq, None)
        self._release(((seq, token),), delay)

    def _release(self, receipts: Sequence[tuple[int, int]], delay: float) -> None:
        now = self._d.now()
        state, due = (DELAYED, now + delay) if delay > 0 else (READY, 0.0)
        self._d._write(
            lambda conn: conn.executemany(
                "UPDATE mq_queue SET state = ?, due = ?"
                " WHERE seq = ? AND token = ? AND state = 1 AND due > ?",
                [(state, due, seq, token, now) for seq, token in receipts]),
            "nack", wake=(self._gid,),
        )

    def extend(self, receipt: Any, seconds: float) -> None:
        self._check_open()
        seq, token = receipt
        now = self._d.now()
        self._d._write(
            lambda conn: conn.execute(
                "UPDATE mq_queue SET due = ? WHERE seq = ? AND token = ? AND state = 1"
                " AND due > ?", (now + seconds, seq, token, now)),
            "extend",
        )

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        self._check_open()
        seq, token = receipt
        self._held.pop(seq, None)
        now = self._d.now()

        def txn(conn: sqlite3.Connection) -> None:
            cur = conn.execute(
                f"INSERT INTO mq_dead ({_DEAD_COLUMNS}, attempts, reason, dead_at)"
                f" SELECT {_DEAD_COLUMNS}, ?, ?, ? FROM mq_queue WHERE seq = ? AND token = ?"
                " AND state = 1 AND due > ?",
                (attempts, reason, now, seq, token, now),
            )
            if cur.rowcount:
                conn.execute("DELETE FROM mq_queue WHERE seq = ?", (seq,))

        self._d._write(txn, "dead_letter", wake=self._wake_on_settle)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("subscription is closed")
        self._d._check_open()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        held, self._held = list(self._held.items()), {}
        if held and not self._d._closed:
            self._release(held, 0.0)
        self._d._shared.wake()
