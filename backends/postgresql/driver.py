"""``PostgreSQLDriver``: the connection pool, schema, routing, groups and dead letters."""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from itertools import repeat
from typing import Any, ClassVar

import psycopg
import psycopg.errors
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from mqabstract import wire
from mqabstract.capabilities import Capabilities
from mqabstract.clock import Clock, SystemClock
from mqabstract.driver import Driver
from mqabstract.emulation.routes import Routes
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    InvalidURL,
    MQError,
    NotFound,
    Timeout,
)
from mqabstract.model import Columns, DeadLetter, Envelope, GroupSpec, GroupStats, utc
from mqabstract.options import Option, parse_options
from mqabstract.url import BrokerURL

from .schema import (
    DELAYED,
    READY,
    Statements,
    check_schema,
    decode_headers,
    encode_headers,
    migrate,
)
from .subscription import Listener, PostgreSQLSubscription, Waker

__all__ = ["PostgreSQLDriver"]

Conn = psycopg.Connection[tuple[Any, ...]]
#: added to ``poll_interval`` in ``release_margin``: one claim round trip and scheduling
RELEASE_SLACK = 0.25
_ROUTE_TRIES = 10
CHUNK_BYTES = 64 * 1024 * 1024  # bodies per INSERT statement of a large batch


class _Stale(Exception):
    """The groups version moved while a batch was written: route again."""


class PostgreSQLDriver(Driver):
    """A PostgreSQL database as a durable, multi-process broker (see the package docs)."""

    name: ClassVar[str] = "postgresql"
    CAPABILITIES = Capabilities.all_native(
        max_body_bytes=16 * 1024 * 1024,
        max_batch=5000,
        max_receive=1000,
        min_lease=0.1,
        # poll_interval (default 0.5) + RELEASE_SLACK: see PostgreSQLDriver.__init__
        release_margin=0.5 + RELEASE_SLACK,
        shared_between_processes=True,
        durable=True,
        confirmed_survives="what a committed transaction survives on the server "
                           "(synchronous_commit, replication: the server's settings)",
        key_gate="broker",  # a key's later rows wait behind its unsettled head
    )
    OPTIONS: ClassVar[dict[str, Option]] = {
        "schema": Option(str, "mq", "schema holding the tables (created and migrated on open)"),
        "pool_size": Option(int, 4, "most pooled connections (receivers, settles, publishes)"),
        "connect_timeout": Option(float, 10.0, "seconds to connect before ConnectionFailed"),
        "poll_interval": Option(
            float, 0.5, "longest idle wait of receive between looks at the table, seconds "
            "(bounds delivery when NOTIFYs are lost, e.g. behind a transaction pooler)"),
        "listen": Option(bool, True, "wake receivers with LISTEN/NOTIFY (off: poll only)"),
        "clock": Option(object, None, "a mqabstract.Clock (tests pass FakeClock)"),
    }

    def __init__(self, url: BrokerURL, opts: Mapping[str, Any]) -> None:
        self.url = url
        self._where = url.redacted()
        clock = opts["clock"]
        if clock is not None and (isinstance(clock, str) or not hasattr(clock, "time")):
            raise InvalidArgument("option clock must be a mqabstract.Clock object")
        self.clock: Clock = clock or SystemClock()
        for name in ("connect_timeout", "poll_interval"):
            value = float(opts[name])
            if not math.isfinite(value) or value <= 0:
                raise InvalidArgument(f"option {name} must be a finite number of seconds > 0")
        if not 1 <= int(opts["pool_size"]) <= 1000:
            raise InvalidArgument("option pool_size must be between 1 and 1000")
        self.schema = check_schema(str(opts["schema"]))
        self.connect_timeout = float(opts["connect_timeout"])
        self.poll_interval = max(0.01, float(opts["poll_interval"]))
        self.sql = Statements(self.schema)
        self._caps = replace(self.CAPABILITIES,
                             release_margin=self.poll_interval + RELEASE_SLACK)
        self._conninfo, self._kwargs = self._libpq_params(url)
        self._lock = threading.Lock()
        self._closed = False
        self._routes: Routes[int] = Routes()
        self._groups_version = -1
        self.waker = Waker()
        self._listener: Listener | None = None
        self._listen = bool(opts["listen"])
        self._pool = ConnectionPool(self._conninfo, kwargs=self._kwargs, min_size=1,
                                    max_size=int(opts["pool_size"]), open=False,
                                    name=f"mqabstract-{self.schema}",
                                    timeout=self.connect_timeout)
        self.clock.on_advance(self.waker.wake)  # FakeClock.advance wakes every receiver

    def _libpq_params(self, url: BrokerURL) -> tuple[str, dict[str, Any]]:
        """conninfo without the password (the pool may show it), and the connect kwargs."""
        if not url.hosts:
            raise InvalidURL(f"postgresql URLs need a host: {self._where}")
        if not url.path or "/" in url.path:
            raise InvalidURL(f"postgresql URL needs a database name, e.g. "
                             f"postgresql://user:pass@host:5432/db: {self._where}")
        conninfo = make_conninfo(
            host=",".join(h for h, _ in url.hosts),
            port=",".join(str(p or 5432) for _, p in url.hosts),
            dbname=url.path, user=url.username or "")
        kwargs: dict[str, Any] = {
            # operators see which schema a connection serves (pg_stat_activity)
            "autocommit": True, "application_name": f"mqabstract:{self.schema}",
            # libpq counts whole seconds, at least 2
            "connect_timeout": max(2, math.ceil(self.connect_timeout)),
        }
        if url.password is not None:
            kwargs["password"] = url.password
        return conninfo, kwargs

    # -- connection -----------------------------------------------------------------------
    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> PostgreSQLDriver:
        driver = cls(url, parse_options(url, options, cls.OPTIONS, cls.name))
        try:
            with driver._translate("open"):
                # A direct connection first: a server that is down fails at once, where
                # the pool would keep retrying until its timeout.
                with driver.connect() as conn:
                    migrate(conn, driver.schema, driver._where)
                    driver._load_routes(conn)
                driver._pool.open(wait=True, timeout=driver.connect_timeout)
        except BaseException:
            driver._pool.close(timeout=0)
            raise
        return driver

    def connect(self) -> Conn:
        """A new connection outside the pool (migration, the LISTEN connection)."""
        return psycopg.connect(self._conninfo, **self._kwargs)

    def _scrub(self, exc: BaseException) -> str:
        text = str(exc).strip()
        password = self.url.password
        return text.replace(password, "***") if password else text

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """psycopg's exceptions become ``mqabstract.errors`` naming the redacted URL."""
        try:
            yield
        except MQError:
            raise
        except PoolClosed as exc:
            raise Closed(f"postgresql broker {self._where} is closed") from exc
        except PoolTimeout as exc:
            raise ConnectionFailed(f"postgresql {what} on {self._where}: no connection within "
                                   f"{self.connect_timeout:g}s: {self._scrub(exc)}") from exc
        except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
            raise Timeout(f"postgresql {what} on {self._where}: {self._scrub(exc)}") from exc
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise ConnectionFailed(f"postgresql {what} on {self._where} failed: "
                                   f"{self._scrub(exc)}") from exc
        except psycopg.Error as exc:
            raise MQError(f"postgresql {what} on {self._where} failed: "
                          f"{type(exc).__name__}: {self._scrub(exc)}") from exc

    @contextlib.contextmanager
    def conn(self, what: str) -> Iterator[Conn]:
        """A pooled connection (autocommit) with errors translated."""
        self.check_open()
        with self._translate(what), self._pool.connection() as conn:
            yield conn

    def check_open(self) -> None:
        if self._closed:
            raise Closed(f"postgresql broker {self._where} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def now(self) -> float:
        return self.clock.time()

    def notify(self, conn: Conn, gid: int) -> None:
        """Local receivers at once; other processes through NOTIFY (sent on commit)."""
        conn.execute(self.sql.notify, (str(gid),))
        self.waker.wake((gid,))

    # -- routing --------------------------------------------------------------------------
    def _load_routes(self, conn: Conn) -> None:
        rows = conn.execute(self.sql.routes).fetchall()
        with self._lock:
            self._groups_version = int(rows[0][0])
            self._routes.replace((gid, pattern) for _, gid, pattern in rows if gid is not None)

    def _route(self, topic: str) -> tuple[int, ...]:
        with self._lock:
            return self._routes.groups_for(topic)

    def _insert(self, build: Any) -> None:
        """Insert the rows ``build()`` routes with the cached groups, in one statement that
        only writes while the groups version is still the cached one; else reload the
        groups (another connection declared or deleted one) and route again."""
        with self.conn("publish") as conn:
            for _ in range(_ROUTE_TRIES):
                version = self._groups_version
                columns, gids = build()
                if not gids:
                    row = conn.execute(self.sql.version).fetchone()
                    if row is not None and row[0] == version:
                        return
                elif self._try_rows(conn, columns, version):
                    self.waker.wake(gids)
                    return
                self._load_routes(conn)
        raise Timeout(f"postgresql publish on {self._where}: groups kept changing while "
                      f"routing ({_ROUTE_TRIES} tries)")

    def _try_rows(self, conn: Conn, cols: list[list[Any]], version: int) -> bool:
        try:
            return self._write_rows(conn, cols, version)
        except _Stale:
            return False

    def _write_rows(self, conn: Conn, cols: list[list[Any]], version: int) -> bool:
        """One statement, or (rows of more than ``CHUNK_BYTES`` of bodies: a protocol
        message is at most 1 GiB) one per chunk in one transaction: all or nothing either
        way. False when the groups version moved (nothing written)."""
        cuts, size = [0], 0
        for i, body in enumerate(cols[-1]):
            if size and size + len(body) > CHUNK_BYTES:
                cuts.append(i)
                size = 0
            size += len(body)
        cuts.append(len(cols[-1]))
        # (a transaction costs a BEGIN and a COMMIT round trip: only when it is needed)
        with conn.transaction() if len(cuts) > 2 else contextlib.nullcontext():
            for start, stop in itertools.pairwise(cuts):
                row = conn.execute(self.sql.publish,
                                   (*(c[start:stop] for c in cols), version)).fetchone()
                if row is None or not row[0]:
                    raise _Stale  # rolls back the chunks before it
        return True

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        def build() -> tuple[list[list[Any]], set[int]]:
            cols: list[list[Any]] = [[] for _ in range(10)]
            touched: set[int] = set()
            for env in envelopes:
                gids = self._route(env.topic)
                if not gids:
                    continue
                touched.update(gids)
                state, due = (READY, 0.0) if env.deliver_at is None else (DELAYED, env.deliver_at)
                row = (state, due, env.priority, env.key, env.id, env.topic, env.published_at,
                       encode_headers(env.headers), env.body)
                for gid in gids:
                    cols[0].append(gid)
                    for col, value in zip(cols[1:], row, strict=True):
                        col.append(value)
            return cols, touched

        self._insert(build)

    def publish_columns(self, columns: Columns) -> None:
        """One topic: routed once, headers encoded once when every row shares them, the
        columns passed as arrays as they are."""
        n = len(columns.ids)
        shared = encode_headers(columns.headers)
        headers = [shared] * n if columns.row_headers is None else [
            encode_headers({**columns.headers, **own}) if own else shared
            for own in columns.row_headers]
        keys = list(columns.keys) if columns.keys is not None else [None] * n
        ids, bodies = list(columns.ids), list(columns.bodies)

        def build() -> tuple[list[list[Any]], set[int]]:
            gids = self._route(columns.topic)
            k = len(gids)
            fixed: list[list[Any]] = [[READY] * n * k, [0.0] * n * k, [0] * n * k]
            cols: list[list[Any]] = [[g for g in gids for _ in range(n)], *fixed, keys * k,
                                     ids * k,
                    list(repeat(columns.topic, n * k)), [columns.published_at] * n * k,
                    headers * k, bodies * k]
            return cols, set(gids)

        self._insert(build)

    # -- groups -----------------------------------------------------------------------------
    def _gid(self, conn: Conn, group: str) -> int:
        row = conn.execute(f"SELECT gid FROM {self.schema}.mq_groups WHERE name = %s",
                           (group,)).fetchone()
        if row is None:
            raise NotFound(f"group {group!r} does not exist on {self._where}")
        return int(row[0])

    def declare(self, spec: GroupSpec) -> None:
        s = self.schema
        wanted = (spec.pattern, spec.max_attempts, spec.lease, spec.ordered)
        with self.conn("declare") as conn, conn.transaction():
            created = conn.execute(
                f"INSERT INTO {s}.mq_groups (name, pattern, max_attempts, lease, ordered,"
                " created_at) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (name) DO NOTHING",
                (spec.name, *wanted, self.now())).rowcount
            if created:
                conn.execute(self.sql.bump)
            else:
                row = conn.execute(
                    f"SELECT pattern, max_attempts, lease, ordered FROM {s}.mq_groups"
                    " WHERE name = %s FOR UPDATE", (spec.name,)).fetchone()
                if row is None or row[0] != spec.pattern:
                    raise InvalidArgument(f"group {spec.name!r} exists with pattern "
                                          f"{row[0] if row else None!r}, not {spec.pattern!r}")
                if tuple(row) != wanted:  # policy follows the latest declare
                    conn.execute(f"UPDATE {s}.mq_groups SET max_attempts = %s, lease = %s,"
                                 " ordered = %s WHERE name = %s", (*wanted[1:], spec.name))
        if created:
            with self.conn("declare") as conn:
                self._load_routes(conn)

    def subscribe(self, spec: GroupSpec) -> PostgreSQLSubscription:
        with self.conn("subscribe") as conn:
            gid = self._gid(conn, spec.name)
        if self._listen:
            with self._lock:
                if self._listener is None:
                    self._listener = Listener(self.connect, self.sql.channel, self.waker)
        return PostgreSQLSubscription(self, spec, gid)

    def delete_group(self, group: str) -> None:
        s = self.schema
        with self.conn("delete_group") as conn:
            with conn.transaction():
                gid = self._gid(conn, group)
                for table in ("mq_queue", "mq_dead", "mq_groups"):
                    conn.execute(f"DELETE FROM {s}.{table} WHERE gid = %s", (gid,))
                conn.execute(self.sql.bump)
            self._load_routes(conn)

    def stats(self, group: str) -> GroupStats:
        now = self.now()
        with self.conn("stats") as conn:
            gid = self._gid(conn, group)
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE state = 0 OR due <= %s),"
                " count(*) FILTER (WHERE state = 1 AND due > %s),"
                " count(*) FILTER (WHERE state = 2 AND due > %s),"
                f" (SELECT count(*) FROM {self.schema}.mq_dead WHERE gid = %s)"
                f" FROM {self.schema}.mq_queue WHERE gid = %s",
                (now, now, now, gid, gid)).fetchone()
        assert row is not None
        return GroupStats(group, *(int(v) for v in row))

    def groups(self) -> list[str]:
        with self.conn("groups") as conn:
            return [name for (name,) in conn.execute(
                f"SELECT name FROM {self.schema}.mq_groups ORDER BY gid")]

    def ping(self) -> None:
        """``SELECT 1`` on a pooled connection: one round trip."""
        with self.conn("ping") as conn:
            conn.execute("SELECT 1").fetchone()

    # -- dead letters -----------------------------------------------------------------------
    @staticmethod
    def _id_filter(ids: Collection[str] | None) -> tuple[str, tuple[Any, ...]]:
        return ("", ()) if ids is None else (" AND id = ANY(%s::text[])", (sorted(ids),))

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        with self.conn("dead_letters") as conn:
            gid = self._gid(conn, group)
            rows = conn.execute(
                "SELECT id, topic, body, headers, key, priority, published_at, attempts,"
                f" reason, dead_at FROM {self.schema}.mq_dead WHERE gid = %s"
                " ORDER BY dseq LIMIT %s", (gid, limit)).fetchall()
        return [DeadLetter(r[0], r[1], bytes(r[2]), decode_headers(r[3]), r[4], r[5], utc(r[6]),
                           r[7], r[8], utc(r[9])) for r in rows]

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        where, args = self._id_filter(ids)
        s = self.schema
        with self.conn("replay_dead_letters") as conn, conn.transaction():
            gid = self._gid(conn, group)
            moved = conn.execute(
                f"WITH gone AS (DELETE FROM {s}.mq_dead WHERE gid = %s{where} RETURNING *)"
                f" INSERT INTO {s}.mq_queue (gid, state, due, priority, attempts, token, key,"
                " id, topic, published_at, headers, body) SELECT gid, 0, 0, priority, 0, 0,"
                # A replay drops the TTL: an expired message would expire again at once.
                " key, id, topic, published_at, (headers::jsonb - %s)::text, body FROM gone"
                " ORDER BY dseq", (gid, *args, wire.EXPIRES_AT)).rowcount
            if moved:
                self.notify(conn, gid)
        return int(moved)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        where, args = self._id_filter(ids)
        with self.conn("purge_dead_letters") as conn:
            gid = self._gid(conn, group)
            return int(conn.execute(f"DELETE FROM {self.schema}.mq_dead WHERE gid = %s{where}",
                                    (gid, *args)).rowcount)

    # -- lifecycle ------------------------------------------------------------------------
    def _poke(self) -> None:
        """A NOTIFY that is no group id: ends the listener's wait (others ignore it)."""
        with contextlib.suppress(psycopg.Error, PoolTimeout, PoolClosed), \
                self._pool.connection(timeout=1.0) as conn:
            conn.execute(self.sql.notify, ("stop",))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
        self.waker.wake()  # receivers of this driver notice the close
        if listener is not None:
            listener.stop(self._poke)
        with self._translate("close"):
            self._pool.close(timeout=self.connect_timeout)
