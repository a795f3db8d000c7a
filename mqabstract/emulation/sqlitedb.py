"""SQLite files shared by processes: opening in WAL mode and waiting out other writers.

One place for what the SQLite driver and the dedupe store both need. SQLite's busy handler
(the connection's ``timeout``) waits for a lock another connection holds, but in some races
SQLite answers ``database is locked`` at once without calling it: several processes that
open a new (rollback-journal) file and switch it to WAL at the same moment, a read
transaction that wants to write while another connection is committing, WAL recovery.
So every use goes through :func:`retry_busy`, which retries such answers with back-off
until the caller's ``busy_timeout`` and then raises the retryable ``Timeout`` saying what
it waited for and how long — never a raw ``sqlite3`` error, never a wait it did not do.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ..errors import Timeout

__all__ = ["BUSY", "immediate", "is_busy", "open_wal", "retry_busy"]

T = TypeVar("T")

#: What SQLite says when another connection holds the lock it needs.
BUSY = re.compile(r"locked|busy", re.IGNORECASE)


def is_busy(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's "another connection holds the lock" answer."""
    return isinstance(exc, sqlite3.OperationalError) and bool(BUSY.search(str(exc)))


def retry_busy(fn: Callable[[], T], *, timeout: float, what: str,
               monotonic: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``fn``; while SQLite answers busy, retry with back-off (2 ms doubling to 50 ms)
    until ``timeout`` seconds have passed, then raise ``Timeout`` naming ``what``.

    Other ``sqlite3`` errors propagate unchanged: the caller maps them to its own error.
    ``fn`` must be safe to run again after a busy answer (a whole transaction, a pragma).
    """
    start = monotonic()
    pause = 0.002
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            waited = monotonic() - start
            if not is_busy(exc):
                raise
            if waited >= timeout:
                raise Timeout(f"{what}: another connection kept the file locked; waited "
                              f"{waited:.1f}s (busy_timeout {timeout:g}s): {exc}") from exc
        sleep(pause)
        pause = min(pause * 2, 0.05)


def ensure_wal(conn: sqlite3.Connection) -> str:
    """Put the file in WAL mode unless it already is; returns the mode it ended in.

    The mode is asked first: once the file is in WAL mode (every open after the first)
    nothing needs a lock. Switching takes an exclusive lock, which is what raced when
    several processes opened a new file at once.
    """
    mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    if mode != "wal":
        mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
    return mode


def open_wal(path: str, *, timeout: float, what: str, synchronous: str = "NORMAL",
             cached_statements: int = 128) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode, autocommit (transactions are explicit), usable
    from any thread (the caller serialises its use), whose busy handler waits ``timeout``.

    Raises ``Timeout`` when other connections kept the file locked that long, or
    ``sqlite3.Error`` (file missing, not a database, WAL unsupported) for the caller to map.
    """
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None,
                           check_same_thread=False, cached_statements=cached_statements)
    try:
        mode = retry_busy(lambda: ensure_wal(conn), timeout=timeout,
                          what=f"{what}: switching to WAL mode")
        if mode != "wal":
            raise sqlite3.OperationalError(f"cannot use WAL mode (journal_mode={mode})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One ``BEGIN IMMEDIATE`` transaction: committed when the block ends, rolled back when
    it raises (also on ``BaseException``: a thread stopped mid-write leaves nothing).

    A Ctrl-C can land where no handler sees it: the interpreter raises it just after the
    ``BEGIN`` returns from C, or inside ``contextlib``'s ``__enter__`` before the block
    starts. Both left the transaction open and every later write on the connection failed
    (``mqa tail`` exited without releasing its held messages). So the ``BEGIN`` sits
    inside the handler, and a transaction still open when a block starts — abandoned, as
    writes on one connection never nest — is rolled back first. An abandoned block is
    closed later by the garbage collector (``GeneratorExit``), maybe while a newer block's
    transaction is open or after the connection was closed: that close touches nothing."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):  # (the connection may be closed by then)
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
        raise
