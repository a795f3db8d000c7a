"""``PostgreSQLDriver``: the connection pool, schema, routing, groups and dead letters."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from mqabstract import wire
from mqabstract.capabilities import Capabilities
from mqabstract.clock import Clock, SystemClock
from mqabstract.driver import Driver
from mqabstract.emulation.routes import Routes
from mqabstract.errors import InvalidArgument, NotFound, Timeout
from mqabstract.model import Columns, DeadLetter, Envelope, GroupSpec, GroupStats, utc
from mqabstract.options import CLOCK, Option, parse_options
from mqabstract.url import BrokerURL

from .schema import READY, check_schema, decode_headers, encode_headers, migrate, rows
from .store import Conn, Store
from .subscription import PostgreSQLSubscription

__all__ = ["PostgreSQLDriver"]

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
        release_margin=0.5 + RELEASE_SLACK,  # poll_interval + slack (see __init__)
        shared_between_processes=True,
        durable=True,
        confirmed_survives="what a committed transaction survives on the server "
                           "(synchronous_commit, replication: the server's settings)",
        key_gate="broker",  # a key's later rows wait behind its unsettled head
    )
    OPTIONS: ClassVar[dict[str, Option]] = {
        "schema": Option(str, "mq", "schema holding the tables (created and migrated on open)"),
        "pool_size": Option(int, 4, "most pooled connections (receivers, settles, publishes)",
                            min=1, max=1000),
        "connect_timeout": Option(float, 10.0, "seconds to connect before ConnectionFailed",
                                  above=0),
        "poll_interval": Option(float, 0.5, "longest idle wait of receive between looks at "
                                "the table, seconds (bounds latency when NOTIFYs are lost)",
                                above=0),
        "listen": Option(bool, True, "wake receivers with LISTEN/NOTIFY (off: poll only)"),
        "clock": CLOCK,
    }

    def __init__(self, url: BrokerURL, opts: Mapping[str, Any]) -> None:
        self.url = url
        self.clock: Clock = opts["clock"] or SystemClock()
        self.schema = check_schema(str(opts["schema"]))
        poll = max(0.01, float(opts["poll_interval"]))
        self._caps = replace(self.CAPABILITIES, release_margin=poll + RELEASE_SLACK)
        self.store = Store(url, self.schema, self.clock, poll_interval=poll,
                           connect_timeout=float(opts["connect_timeout"]),
                           pool_size=int(opts["pool_size"]), listen=bool(opts["listen"]))
        self.sql = self.store.sql
        self._where = self.store.where
        self._lock = threading.Lock()
        self._routes: Routes[int] = Routes()
        self._groups_version = -1

    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> PostgreSQLDriver:
        driver = cls(url, parse_options(url, options, cls.OPTIONS, cls.name))

        def prepare(conn: Conn) -> None:
            migrate(conn, driver.schema, driver._where)
            driver._load_routes(conn)

        driver.store.open(prepare)
        return driver

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    # -- routing --------------------------------------------------------------------------
    def _load_routes(self, conn: Conn) -> None:
        rows = conn.execute(self.sql.routes).fetchall()
        with self._lock:
            self._groups_version = int(rows[0][0])
            self._routes.replace((gid, pattern) for _, gid, pattern in rows if gid is not None)

    def _route(self, topic: str) -> tuple[int, ...]:
        with self._lock:
            return self._routes.groups_for(topic)

    def _insert(self, build: Callable[[], list[list[Any]]]) -> None:
        """Insert the columns ``build()`` routes with the cached groups (column 0: group
        ids), in statements that only write while the groups version is still the cached
        one; else reload the groups (another connection declared or deleted one) and
        route again."""
        with self.store.conn("publish") as conn:
            for _ in range(_ROUTE_TRIES):
                version = self._groups_version
                cols = build()
                if not cols[0]:
                    row = conn.execute(self.sql.version).fetchone()
                    if row is not None and row[0] == version:
                        return
                else:
                    with contextlib.suppress(_Stale):
                        self._write_rows(conn, cols, version)
                        self.store.waker.wake(set(cols[0]))
                        return
                self._load_routes(conn)
        raise Timeout(f"postgresql publish on {self._where}: groups kept changing while "
                      f"routing ({_ROUTE_TRIES} tries)")

    def _write_rows(self, conn: Conn, cols: list[list[Any]], version: int) -> None:
        """One statement, or (more than ``CHUNK_BYTES`` of bodies: a protocol message is at
        most 1 GiB) one per chunk in one transaction: all or nothing either way."""
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
                row = conn.execute(*self.sql.publish([c[start:stop] for c in cols], version,
                                                     held=len(cuts) > 2)).fetchone()
                if row is None or not row[0]:
                    raise _Stale  # the groups version moved; rolls back earlier chunks

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        self._insert(lambda: rows(envelopes, self._route))

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

        def build() -> list[list[Any]]:
            gids = self._route(columns.topic)
            k, nk = len(gids), n * len(gids)
            return [[g for g in gids for _ in range(n)], [READY] * nk, [0.0] * nk, [0] * nk,
                    keys * k, ids * k, [columns.topic] * nk, [columns.published_at] * nk,
                    headers * k, bodies * k]

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
        with self.store.conn("declare") as conn:
            with conn.transaction():
                created = conn.execute(
                    f"INSERT INTO {s}.mq_groups (name, pattern, max_attempts, lease, ordered,"
                    " created_at) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (spec.name, *wanted, self.store.now())).rowcount
                row = None if created else conn.execute(
                    f"SELECT pattern, max_attempts, lease, ordered FROM {s}.mq_groups"
                    " WHERE name = %s FOR UPDATE", (spec.name,)).fetchone()
                if created:
                    conn.execute(self.sql.bump)
                elif row is None or row[0] != spec.pattern:
                    raise InvalidArgument(f"group {spec.name!r} exists with pattern "
                                          f"{row[0] if row else None!r}, not {spec.pattern!r}")
                elif tuple(row) != wanted:  # policy follows the latest declare
                    conn.execute(f"UPDATE {s}.mq_groups SET max_attempts = %s, lease = %s,"
                                 " ordered = %s WHERE name = %s", (*wanted[1:], spec.name))
            if created:
                self._load_routes(conn)

    def subscribe(self, spec: GroupSpec) -> PostgreSQLSubscription:
        with self.store.conn("subscribe") as conn:
            gid = self._gid(conn, spec.name)
        self.store.listen()
        return PostgreSQLSubscription(self.store, spec, gid)

    def delete_group(self, group: str) -> None:
        s = self.schema
        with self.store.conn("delete_group") as conn:
            with conn.transaction():
                gid = self._gid(conn, group)
                for table in ("mq_queue", "mq_dead", "mq_groups"):
                    conn.execute(f"DELETE FROM {s}.{table} WHERE gid = %s", (gid,))
                conn.execute(self.sql.bump)
            self._load_routes(conn)

    def stats(self, group: str) -> GroupStats:
        now = self.store.now()
        with self.store.conn("stats") as conn:
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
        with self.store.conn("groups") as conn:
            return [name for (name,) in conn.execute(
                f"SELECT name FROM {self.schema}.mq_groups ORDER BY gid")]

    def ping(self) -> None:
        """``SELECT 1`` on a pooled connection: one round trip."""
        with self.store.conn("ping") as conn:
            conn.execute("SELECT 1").fetchone()

    # -- dead letters -----------------------------------------------------------------------
    @staticmethod
    def _id_filter(ids: Collection[str] | None) -> tuple[str, tuple[Any, ...]]:
        return ("", ()) if ids is None else (" AND id = ANY(%s::text[])", (sorted(ids),))

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        with self.store.conn("dead_letters") as conn:
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
        with self.store.conn("replay_dead_letters") as conn, conn.transaction():
            gid = self._gid(conn, group)
            moved = conn.execute(
                f"WITH gone AS (DELETE FROM {s}.mq_dead WHERE gid = %s{where} RETURNING *)"
                f" INSERT INTO {s}.mq_queue (gid, state, due, priority, attempts, token, key,"
                " id, topic, published_at, headers, body) SELECT gid, 0, 0, priority, 0, 0,"
                # A replay drops the TTL: an expired message would expire again at once.
                " key, id, topic, published_at, (headers::jsonb - %s)::text, body FROM gone"
                " ORDER BY dseq", (gid, *args, wire.EXPIRES_AT)).rowcount
            if moved:
                self.store.notify(conn, gid)
        return int(moved)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        where, args = self._id_filter(ids)
        with self.store.conn("purge_dead_letters") as conn:
            gid = self._gid(conn, group)
            return int(conn.execute(f"DELETE FROM {self.schema}.mq_dead WHERE gid = %s{where}",
                                    (gid, *args)).rowcount)

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        self.store.close()
