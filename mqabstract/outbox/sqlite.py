"""The outbox in an application's SQLite file: tables ``<prefix>_outbox`` (the messages)
and ``<prefix>_outbox_relay`` (which relay holds the outbox, until when).

SQLite has one writer at a time, so transactions commit in the order their rows got their
``seq``: ``seq`` order is commit order, and a relay that reads committed rows by ``seq``
never passes a row of a transaction still open (that transaction holds the write lock; the
relay's claim waits for it). One relay holds the outbox at a time, under a lease it renews
with every claim; another takes over once the lease has ended (a killed holder's rows are
then published again: duplicates, with their ids).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

from ..clock import Clock, SystemClock
from ..emulation.sqlitedb import immediate, is_busy, open_wal, retry_busy
from ..errors import InvalidArgument, MQError, NotFound, Timeout
from ..model import OutgoingMessage
from .rows import Row, claimed, encode_headers
from .source import Source

__all__ = ["SQLiteOutbox", "insert", "setup"]

_PREFIX = re.compile(r"[a-z_][a-z0-9_]{0,47}\Z")
_COLUMNS = "id, topic, key, priority, deliver_at, expires_at, published_at, headers, body"


def prefix_of(schema: str) -> str:
    if not isinstance(schema, str) or not _PREFIX.match(schema):
        raise InvalidArgument(f"schema must be a lower-case identifier ([a-z_][a-z0-9_]*, at "
                              f"most 48 characters), not {schema!r}")
    return schema


def _ddl(p: str) -> tuple[str, ...]:
    return (
        f"CREATE TABLE IF NOT EXISTS {p}_outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
        " id TEXT NOT NULL, topic TEXT NOT NULL, key TEXT, priority INTEGER NOT NULL,"
        " deliver_at REAL, expires_at REAL, published_at REAL NOT NULL, headers TEXT,"
        " body BLOB NOT NULL, reason TEXT)",
        f"CREATE INDEX IF NOT EXISTS {p}_outbox_todo ON {p}_outbox (seq) WHERE reason IS NULL",
        f"CREATE TABLE IF NOT EXISTS {p}_outbox_relay (name TEXT PRIMARY KEY,"
        " holder TEXT NOT NULL, until REAL NOT NULL)",
    )


@contextlib.contextmanager
def _errors(what: str) -> Iterator[None]:
    """sqlite3's exceptions as ``mqabstract.errors``: a missing table ``NotFound`` (with
    what to do), a lock held too long ``Timeout``, anything else ``MQError``."""
    try:
        yield
    except MQError:
        raise
    except sqlite3.Error as exc:
        if "no such table" in str(exc):
            raise NotFound(f"sqlite outbox {what}: {exc} (create it once with "
                           "mqabstract.outbox.setup(conn))") from exc
        if is_busy(exc):
            raise Timeout(f"sqlite outbox {what}: {exc}") from exc
        raise MQError(f"sqlite outbox {what} failed: {type(exc).__name__}: {exc}") from exc


def setup(conn: sqlite3.Connection, schema: str) -> None:
    """Create the outbox tables (idempotent): inside the caller's transaction when one is
    open, else in one of its own."""
    p = prefix_of(schema)
    with _errors("setup"):
        if conn.in_transaction:
            for step in _ddl(p):
                conn.execute(step)
        else:
            with immediate(conn):
                for step in _ddl(p):
                    conn.execute(step)


def insert(conn: sqlite3.Connection, schema: str, rows: Sequence[Row]) -> None:
    """Write checked rows in the caller's transaction (``InvalidArgument`` when the
    connection is in autocommit mode with no transaction open: nothing would tie them to
    the caller's other writes)."""
    p = prefix_of(schema)
    if conn.isolation_level is None and not conn.in_transaction:
        raise InvalidArgument("outbox.publish needs the connection's transaction: this "
                              "sqlite3 connection is in autocommit mode with none open "
                              "(execute BEGIN first)")
    with _errors("publish"):
        conn.executemany(
            f"INSERT INTO {p}_outbox ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(r.id, r.topic, r.key, r.priority, r.deliver_at, r.expires_at, r.published_at,
              encode_headers(r.headers), r.body) for r in rows])


class SQLiteOutbox(Source):
    """A relay's side of a SQLite outbox file (``sqlite:///path?schema=mq``)."""

    def __init__(self, path: str, *, schema: str = "mq", lease: float = 30.0,
                 clock: Clock | None = None, busy_timeout: float = 30.0) -> None:
        self._p = prefix_of(schema)
        self.where = f"sqlite:///{path}"
        self._lease, self._busy = float(lease), float(busy_timeout)
        self._clock = clock or SystemClock()
        self._me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        with _errors("open"):
            self._conn = open_wal(path, timeout=self._busy, what=f"outbox {path}")
        setup(self._conn, schema)
        self._seqs: list[int] = []
        self._marks: dict[int, str] = {}

    def claim(self, max_messages: int, wait: float) -> list[OutgoingMessage]:
        p, now = self._p, self._clock.time()
        rows: list[tuple[Any, ...]] = []

        def take() -> None:
            with immediate(self._conn) as c:
                held = c.execute(f"SELECT holder, until FROM {p}_outbox_relay WHERE name = ?",
                                 ("relay",)).fetchone()
                if held is not None and held[0] != self._me and held[1] > now:
                    rows.clear()
                    return  # another relay holds the outbox
                c.execute(f"INSERT OR REPLACE INTO {p}_outbox_relay VALUES (?, ?, ?)",
                          ("relay", self._me, now + self._lease))
                rows[:] = c.execute(
                    f"SELECT seq, {_COLUMNS} FROM {p}_outbox WHERE reason IS NULL"
                    " ORDER BY seq LIMIT ?", (max_messages,)).fetchall()

        with _errors("claim"):
            retry_busy(take, timeout=self._busy, what=f"outbox {self.where}: claim")
        out, self._seqs, self._marks = claimed(rows, now)
        if not out and self._marks:
            self.confirm()
        return out

    def reject(self, index: int, reason: str) -> None:
        self._marks[self._seqs[index]] = reason

    def confirm(self) -> None:
        p = self._p
        marks, gone = self._marks, [s for s in self._seqs if s not in self._marks]

        def settle() -> None:
            with immediate(self._conn) as c:
                c.executemany(f"DELETE FROM {p}_outbox WHERE seq = ?", [(s,) for s in gone])
                c.executemany(f"UPDATE {p}_outbox SET reason = ? WHERE seq = ?",
                              [(r, s) for s, r in marks.items()])

        with _errors("confirm"):
            retry_busy(settle, timeout=self._busy, what=f"outbox {self.where}: confirm")
        self._seqs, self._marks = [], {}

    def release(self) -> None:
        self._seqs, self._marks = [], {}

    def close(self) -> None:
        """Give the outbox up (a standby relay takes over at once, not after the lease)."""
        self.release()
        with contextlib.suppress(sqlite3.Error, MQError):
            retry_busy(lambda: self._conn.execute(
                f"DELETE FROM {self._p}_outbox_relay WHERE name = ? AND holder = ?",
                ("relay", self._me)), timeout=min(self._busy, 5.0), what="outbox close")
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()
