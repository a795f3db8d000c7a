"""The outbox in an application's PostgreSQL database (``mqabstract.outbox`` on psycopg).

Table ``<schema>.mq_outbox``, one row per message, ``part`` its relay partition
(``rows.part``: a key's rows share one). Two rules make "commit order per key" hold with
several writers and several relays:

* **Writers of one key take turns.** ``insert`` takes a transaction advisory lock on each
  key it writes (``pg_advisory_xact_lock(outbox lock, crc32(key))``, in sorted order) before
  the row gets its ``seq``, and holds it until the caller's transaction ends. So a key's rows
  get their ``seq`` in the order their transactions commit, and while a transaction with a
  row of key k is open no later row of k can be committed: a relay reading the committed
  rows of k by ``seq`` can never pass one still in flight (it is not visible yet, and
  nothing after it is). Different keys never wait for each other (but for CRC collisions).
* **One relay per partition at a time.** A claim is a transaction that takes
  ``pg_try_advisory_xact_lock(outbox lock, part)``, reads the partition's oldest rows, and
  after the target confirmed them deletes them and commits. Another relay skips a locked
  partition; a killed relay's transaction ends with its connection, releasing the lock and
  keeping the rows (published again by the next claim: duplicates with the same ids). The
  claim sets ``idle_in_transaction_session_timeout`` to the relay's lease, so the server
  also ends the claim of a relay that hangs.

``publish_direct`` is for a target that is the ``postgresql://`` broker in the same
database: the message goes straight into the broker's queue rows inside the caller's
transaction (the driver's own routed insert statement), so it is delivered if and only if
the transaction commits; no outbox row, no relay.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from mqabstract.clock import Clock, SystemClock
from mqabstract.emulation.routes import Routes
from mqabstract.errors import InvalidArgument, MQError, NotFound, Timeout
from mqabstract.model import Envelope, OutgoingMessage
from mqabstract.outbox.rows import (
    PARTS,
    Row,
    claimed,
    encode_headers,
    key_lock,
    part,
)
from mqabstract.outbox.source import Source
from mqabstract.url import BrokerURL

from .driver import PostgreSQLDriver
from .schema import Statements, check_schema, rows
from .store import translate

__all__ = ["CAPABILITIES", "PGOutbox", "insert", "publish_direct", "setup"]

_COLUMNS = ("part, id, topic, key, priority, deliver_at, expires_at, published_at, headers,"
            " body")
_ROUTE_TRIES = 10
#: What ``publish_direct`` checks messages against: the broker's own limits.
CAPABILITIES = PostgreSQLDriver.CAPABILITIES
_statements = functools.lru_cache(maxsize=32)(Statements)  # per schema, as a driver's


def _lock_class(schema: str, what: str = "key") -> str:
    """SQL for the first half of an outbox advisory lock: writers' key locks (``key``) and
    relays' partition locks (``part``) are classes of their own."""
    return f"hashtext('mqabstract-outbox-{what}:{schema}')"


@contextlib.contextmanager
def _errors(what: str, where: str, password: str | None = None) -> Iterator[None]:
    """``store.translate``, with a missing outbox table named as such."""
    try:
        with translate(what, where, password, kind="outbox"):
            yield
    except MQError as exc:
        if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
            raise NotFound(f"{exc} (create the outbox once with "
                           "mqabstract.outbox.setup(conn), or start a relay on it)") from exc
        raise


def _where(conn: psycopg.Connection[Any]) -> str:
    info = conn.info
    return f"postgresql://{info.user}@{info.host}:{info.port}/{info.dbname}"


def setup(conn: psycopg.Connection[Any], schema: str) -> None:
    """Create the schema and the outbox table (idempotent), under an advisory lock so
    processes doing it at once wait for each other."""
    s = check_schema(schema)
    with _errors("outbox setup", _where(conn)), conn.transaction():
        # Asked first: CREATE INDEX IF NOT EXISTS would wait for every open transaction
        # that wrote an outbox row (a relay starting beside a long one would hang).
        found = conn.execute("SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT"
                             " NULL", (f"{s}.mq_outbox", f"{s}.mq_outbox_todo")).fetchone()
        if found is not None and found[0]:
            return
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 1837))",
                     (f"mqabstract:{s}",))
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.mq_outbox ("
            " seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, part smallint NOT NULL,"
            " id text NOT NULL, topic text NOT NULL, key text, priority smallint NOT NULL,"
            " deliver_at double precision, expires_at double precision,"
            " published_at double precision NOT NULL, headers text, body bytea NOT NULL,"
            " reason text)")
        conn.execute(f"CREATE INDEX IF NOT EXISTS mq_outbox_todo ON {s}.mq_outbox"
                     " (part, seq) WHERE reason IS NULL")


def _check_transaction(conn: psycopg.Connection[Any]) -> None:
    status = conn.info.transaction_status
    if conn.autocommit and status == psycopg.pq.TransactionStatus.IDLE:
        raise InvalidArgument("outbox.publish needs the caller's transaction: this psycopg "
                              "connection is in autocommit mode outside one (use "
                              "`with conn.transaction():`)")
    if status == psycopg.pq.TransactionStatus.INERROR:
        raise InvalidArgument("the connection's transaction has failed: roll it back first")


def insert(conn: psycopg.Connection[Any], schema: str, rows: Sequence[Row]) -> None:
    """Write checked rows in the caller's transaction: the keys' writer locks first (sorted:
    two transactions never wait for each other in a circle here), then one insert."""
    s = check_schema(schema)
    _check_transaction(conn)
    keys = sorted({key_lock(r.key) for r in rows if r.key is not None})
    with _errors("outbox publish", _where(conn)):
        if keys:
            conn.execute(f"SELECT pg_advisory_xact_lock({_lock_class(s)}, k)"
                         " FROM unnest(%b::int[]) AS k ORDER BY k", (keys,))
        cols = list(zip(*[(part(r), r.id, r.topic, r.key, r.priority, r.deliver_at,
                           r.expires_at, r.published_at, encode_headers(r.headers), r.body)
                          for r in rows], strict=True))
        conn.execute(
            f"INSERT INTO {s}.mq_outbox ({_COLUMNS}) SELECT * FROM unnest(%b::smallint[],"
            " %b::text[], %b::text[], %b::text[], %b::smallint[], %b::float8[], %b::float8[],"
            " %b::float8[], %b::text[], %b::bytea[])", [list(c) for c in cols])


def publish_direct(conn: psycopg.Connection[Any], schema: str,
                   envelopes: Sequence[Envelope]) -> None:
    """Route and insert ``envelopes`` into the broker's queue rows of ``schema`` inside the
    caller's transaction: the driver's own rows and statement (``Statements.publish``),
    which writes into the partition that is current, NOTIFYs on commit, writes only while
    the groups version read is current (a group declared meanwhile makes it route again),
    and holds the partition's writer lock until the caller's transaction ends, so the
    rotation cannot call the partition drained under an uncommitted row."""
    sql = _statements(check_schema(schema))
    _check_transaction(conn)
    with _errors("outbox publish_direct", _where(conn)):
        for _ in range(_ROUTE_TRIES):
            found = conn.execute(sql.routes).fetchall()
            version = int(found[0][0])
            routes: Routes[int] = Routes()  # the driver's routing, as the driver loads it
            routes.replace((gid, pattern) for _, gid, pattern in found if gid is not None)
            cols = rows(envelopes, routes.groups_for)
            if not cols[0]:
                return  # no group takes these topics (a publish to them reaches no one)
            row = conn.execute(*sql.publish(cols, version, held=True)).fetchone()
            if row is not None and row[0]:
                return
    raise Timeout(f"outbox publish_direct on {_where(conn)}: groups kept changing while "
                  f"routing ({_ROUTE_TRIES} tries)")


class PGOutbox(Source):
    """A relay's side of a PostgreSQL outbox (``postgresql://…/db?schema=mq``)."""

    def __init__(self, url: str, *, lease: float = 30.0, clock: Clock | None = None,
                 connect_timeout: float = 10.0) -> None:
        parsed = BrokerURL.parse(url)
        self.where = parsed.redacted()
        self._password = parsed.password
        unknown = set(parsed.param_dict()) - {"schema"}
        if unknown:
            raise InvalidArgument(f"unknown outbox URL options {sorted(unknown)}; the "
                                  "postgresql outbox takes schema=")
        if not parsed.hosts or not parsed.path:
            raise InvalidArgument(f"an outbox URL needs a host and a database: {self.where}")
        self._schema = check_schema(parsed.param("schema", "mq") or "mq")
        self._conninfo = psycopg.conninfo.make_conninfo(
            host=",".join(h for h, _ in parsed.hosts),
            port=",".join(str(p or 5432) for _, p in parsed.hosts),
            dbname=parsed.path, user=parsed.username or "",
            connect_timeout=max(2, math.ceil(connect_timeout)),
            application_name="mqabstract-relay")
        self._lease_ms = max(1000, int(lease * 1000))
        self._clock = clock or SystemClock()
        self._conn: psycopg.Connection[Any] | None = None
        self._next = random.randrange(PARTS)  # relays start apart, then go round
        self._seqs: list[int] = []
        self._marks: dict[int, str] = {}
        with self._errors("open"):
            setup(self._connect(), self._schema)

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _errors(f"outbox {what}", self.where, self._password)

    def _connect(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._conninfo, password=self._password)
        return self._conn

    def claim(self, max_messages: int, wait: float) -> list[OutgoingMessage]:
        s = self._schema
        with self._errors("claim"):
            try:
                conn = self._connect()
                for _ in range(PARTS):
                    p = self._next
                    self._next = (self._next + 1) % PARTS
                    conn.execute(f"SET LOCAL idle_in_transaction_session_timeout = "
                                 f"{self._lease_ms}")
                    locked = conn.execute(f"SELECT pg_try_advisory_xact_lock("
                                          f"{_lock_class(s, 'part')}, %s)", (p,)).fetchone()
                    rows = conn.execute(
                        f"SELECT seq, id, topic, key, priority, deliver_at, expires_at,"
                        f" published_at, headers, body FROM {s}.mq_outbox WHERE part = %s"
                        " AND reason IS NULL ORDER BY seq LIMIT %s",
                        (p, max_messages)).fetchall() if locked and locked[0] else []
                    out = self._take(rows)
                    if out:
                        return out
                    if self._marks:
                        self.confirm()
                    else:
                        conn.rollback()
            except BaseException:
                self._drop()
                raise
        return []

    def _take(self, rows: list[tuple[Any, ...]]) -> list[OutgoingMessage]:
        out, self._seqs, self._marks = claimed(rows, self._clock.time())
        return out

    def reject(self, index: int, reason: str) -> None:
        self._marks[self._seqs[index]] = reason

    def confirm(self) -> None:
        s = self._schema
        gone = [q for q in self._seqs if q not in self._marks]
        marks = self._marks
        self._seqs, self._marks = [], {}
        with self._errors("confirm"):
            try:
                conn = self._connect()
                conn.execute(f"DELETE FROM {s}.mq_outbox WHERE seq = ANY(%s::bigint[])", (gone,))
                for seq, reason in marks.items():
                    conn.execute(f"UPDATE {s}.mq_outbox SET reason = %s WHERE seq = %s",
                                 (reason, seq))
                conn.commit()
            except BaseException:
                self._drop()
                raise

    def release(self) -> None:
        self._seqs, self._marks = [], {}
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.rollback()
            except psycopg.Error:
                self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def close(self) -> None:
        self.release()
        self._drop()
