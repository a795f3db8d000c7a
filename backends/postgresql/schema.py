"""The tables, their migration and the statements, in the schema the URL names (checked to
be a plain identifier before it goes into a statement). Times are epoch seconds of the
driver's clock, never the server's ``now()`` (docs/backends/postgresql.md, "Time")."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import psycopg

from mqabstract.errors import ConnectionFailed, InvalidArgument
from mqabstract.model import Envelope

__all__ = ["DELAYED", "LEASED", "READY", "SCHEMA_VERSION", "Statements", "check_schema",
           "decode_headers", "encode_headers", "migrate", "part_lock", "rows"]

READY, LEASED, DELAYED = 0, 1, 2
SCHEMA_VERSION = 1
_IDENT = re.compile(r"[a-z_][a-z0-9_]{0,47}\Z")


def partition_ddl(n: int) -> tuple[str, str]:
    """Partition ``n`` of ``mq_queue``: made apart, then attached (ATTACH takes SHARE UPDATE
    EXCLUSIVE on the parent, so it waits for no reader, where PARTITION OF would)."""
    return (f"CREATE TABLE {{s}}.mq_queue_{n} (LIKE {{s}}.mq_queue) WITH (fillfactor = 80,"
            " autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0)",
            f"ALTER TABLE {{s}}.mq_queue ATTACH PARTITION {{s}}.mq_queue_{n} FOR VALUES IN ({n})")


# One list per version: opening a schema at version n runs the lists after n, in order.
_MIGRATIONS: tuple[tuple[str, ...], ...] = ((
    """CREATE TABLE {s}.mq_meta (name text PRIMARY KEY, value bigint NOT NULL)""",
    """INSERT INTO {s}.mq_meta VALUES ('groups', 0)""",
    """CREATE TABLE {s}.mq_groups (
        gid integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        name text NOT NULL UNIQUE, pattern text NOT NULL, max_attempts integer NOT NULL,
        lease double precision NOT NULL, ordered boolean NOT NULL,
        created_at double precision NOT NULL)""",
    # One row per (group, message), in one of a ring of LIST partitions by `part`
    # (docs/backends/postgresql.md, "Bloat"): rows go to the partition mq_parts calls
    # current; a drained partition goes away by TRUNCATE, not VACUUM. Claims rewrite
    # state/due/attempts/token in place; a lower fillfactor leaves room for those.
    """CREATE SEQUENCE {s}.mq_seq""",
    """CREATE TABLE {s}.mq_parts (part smallint PRIMARY KEY, state smallint NOT NULL,
        since double precision NOT NULL, seq0 bigint NOT NULL)""",
    """CREATE FUNCTION {s}.mq_part() RETURNS smallint LANGUAGE sql STABLE
        AS 'SELECT part FROM {s}.mq_parts WHERE state = 1'""",
    """CREATE TABLE {s}.mq_queue (
        seq bigint NOT NULL DEFAULT nextval('{s}.mq_seq'),
        part smallint NOT NULL DEFAULT {s}.mq_part(),
        gid integer NOT NULL, state smallint NOT NULL, due double precision NOT NULL,
        priority smallint NOT NULL, attempts integer NOT NULL, token bigint NOT NULL,
        key text, id text NOT NULL, topic text NOT NULL,
        published_at double precision NOT NULL, headers text, body bytea NOT NULL
    ) PARTITION BY LIST (part)""",
    """CREATE INDEX mq_queue_seq ON {s}.mq_queue (seq)""",
    """CREATE INDEX mq_queue_ready ON {s}.mq_queue (gid, priority DESC, seq)
        WHERE state = 0""",
    """CREATE INDEX mq_queue_waiting ON {s}.mq_queue (gid, due) WHERE state <> 0""",
    """CREATE INDEX mq_queue_key ON {s}.mq_queue (gid, key, seq) WHERE key IS NOT NULL""",
    *(step for n in range(3) for step in (*partition_ddl(n),
      f"INSERT INTO {{s}}.mq_parts VALUES ({n}, {int(n == 0)}, 0, 0)")),
    """CREATE TABLE {s}.mq_dead (
        dseq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        gid integer NOT NULL, id text NOT NULL, topic text NOT NULL, key text,
        priority smallint NOT NULL, published_at double precision NOT NULL, headers text,
        body bytea NOT NULL, attempts integer NOT NULL, reason text NOT NULL,
        dead_at double precision NOT NULL)""",
    """CREATE INDEX mq_dead_gid ON {s}.mq_dead (gid, dseq)""",
    """CREATE INDEX mq_dead_id ON {s}.mq_dead (gid, id)""",
),)
assert len(_MIGRATIONS) == SCHEMA_VERSION


def encode_headers(headers: Mapping[str, str]) -> str | None:
    """Headers as a JSON object in a text column (NULL when there are none)."""
    return json.dumps(dict(headers), separators=(",", ":"), ensure_ascii=False) if headers else None


def decode_headers(text: str | None) -> dict[str, str]:
    return json.loads(text) if text else {}


def check_schema(name: str) -> str:
    """``name`` when it is a plain lower-case identifier (it goes into statements)."""
    if not _IDENT.match(name):
        raise InvalidArgument(f"option schema must be a lower-case identifier "
                              f"([a-z_][a-z0-9_]*, at most 48 characters), not {name!r}")
    return name


def migrate(conn: psycopg.Connection[tuple[Any, ...]], schema: str, where: str) -> None:
    """Create or upgrade ``schema``'s tables in one transaction, holding an advisory lock
    keyed by the schema name, so processes opening it at once wait for each other instead
    of racing on ``CREATE``. A schema written by a newer version is refused."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 1837))",
                     (f"mqabstract:{schema}",))
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        conn.execute(f"CREATE TABLE IF NOT EXISTS {schema}.mq_version (version integer NOT NULL)")
        row = conn.execute(f"SELECT max(version) FROM {schema}.mq_version").fetchone()
        version = int(row[0]) if row and row[0] is not None else 0
        if version > SCHEMA_VERSION:
            raise ConnectionFailed(f"schema {schema} of {where} was written by a newer "
                                   f"mqabstract (version {version} > {SCHEMA_VERSION})")
        for steps in _MIGRATIONS[version:]:
            for step in steps:
                conn.execute(step.format(s=schema))
        if version < SCHEMA_VERSION:
            conn.execute(f"DELETE FROM {schema}.mq_version")
            conn.execute(f"INSERT INTO {schema}.mq_version VALUES (%s)", (SCHEMA_VERSION,))


# The columns a publish writes, in the order ``rows`` builds them, with their array type.
_COLUMNS = ("gid int[]", "state smallint[]", "due float8[]", "priority smallint[]",
            "key text[]", "id text[]", "topic text[]", "published_at float8[]",
            "headers text[]", "body bytea[]")


def rows(envelopes: Iterable[Envelope],
         groups_for: Callable[[str], Iterable[int]]) -> list[list[Any]]:
    """The publish columns (``_COLUMNS``) of ``envelopes``: one row per group that
    ``groups_for(topic)`` routes each to (the driver's publish and ``publish_direct``)."""
    found = [(gid, READY if env.deliver_at is None else DELAYED, env.deliver_at or 0.0,
              env.priority, env.key, env.id, env.topic, env.published_at,
              encode_headers(env.headers), env.body)
             for env in envelopes for gid in groups_for(env.topic)]
    return [list(col) for col in zip(*found, strict=True)] if found else [[] for _ in _COLUMNS]


def part_lock(s: str) -> str:
    """SQL for the first half of a partition's writer lock (the second: the partition): a
    publish whose transaction outlives its statement holds it shared; the rotation calls a
    partition drained only while it holds it exclusive (docs: "Bloat")."""
    return f"hashtext('mqabstract-part:{s}')"


class Hot(NamedTuple):
    promote: str
    claim: str
    claim_ordered: str
    next_due: str


class Settle(NamedTuple):
    ack: str
    ack_one_claim: str  # every receipt from one claim: one token, not an array of them
    release: str
    extend: str
    dead_letter: str


class Statements:
    """The hot path's statements for one schema, built once per driver."""

    def __init__(self, s: str) -> None:
        self.channel = f"mq_{s}"  # LISTEN/NOTIFY channel: payload = group id
        returning = ("RETURNING seq, id, topic, body, headers, key, priority, attempts,"
                     " published_at, part")
        self._s = s
        self._publish: dict[tuple[tuple[bool, ...], bool], str] = {}
        self.version = f"SELECT value FROM {s}.mq_meta WHERE name = 'groups'"
        self.routes = (f"SELECT m.value, g.gid, g.pattern FROM {s}.mq_meta m"
                       f" LEFT JOIN {s}.mq_groups g ON true WHERE m.name = 'groups'")
        self.bump = f"UPDATE {s}.mq_meta SET value = value + 1 WHERE name = 'groups'"
        # Drained partitions (rotation.DRAINED) hold only row versions waiting for their
        # TRUNCATE: the hot statements prune them (a literal list, so the planner does:
        # it cannot prune on a parameter), so they never walk those dead index entries.
        live = "part <> ALL('{{skip}}'::smallint[])"
        promote = (
            f"UPDATE {s}.mq_queue SET state = 0 WHERE {live} AND seq = ANY(ARRAY(SELECT seq"
            f" FROM {s}.mq_queue WHERE {live} AND gid = %s AND state <> 0 AND due <= %s"
            " ORDER BY due LIMIT 1000 FOR UPDATE SKIP LOCKED))")
        pick = (f"SELECT q.seq FROM {s}.mq_queue q WHERE q.{live} AND q.gid = %s"
                " AND q.state = 0{gate} ORDER BY q.priority DESC, q.seq LIMIT %s"
                " FOR UPDATE SKIP LOCKED")
        claim = (f"UPDATE {s}.mq_queue SET state = 1, due = %s, attempts = attempts + 1,"
                 f" token = %s WHERE {live} AND seq = ANY(ARRAY({pick})) {returning}")
        # Ordered groups: a keyed row is deliverable only while it is the oldest row of its
        # key in the group (an earlier one leased, delayed or ready blocks it).
        ordered = claim.replace("{gate}", (
            f" AND (q.key IS NULL OR NOT EXISTS (SELECT 1 FROM {s}.mq_queue p"
            f" WHERE p.{live} AND p.gid = q.gid AND p.key = q.key AND p.seq < q.seq))"))
        next_due = (f"SELECT min(due) FROM {s}.mq_queue WHERE {live} AND gid = %s"
                    " AND state <> 0")
        # A settle names the partitions of its receipts (a leased row never moves): one
        # partition's table itself (the common case), else the parent pruned to those. It
        # finds rows by seq: "due - now > 0" rather than "due > now", which the planner
        # would take to the waiting index (every leased row).
        held = ("{mine} AND seq = ANY(%b::bigint[]) AND state = 1 AND due - %s > 0"
                " AND token = (%b::bigint[])[array_position(%b::bigint[], seq)]")
        dead = "gid, id, topic, key, priority, published_at, headers, body"
        self._hot = promote, claim.replace("{gate}", ""), ordered, next_due
        self._settle = Settle(
            f"DELETE FROM {{table}} WHERE {held}",
            "DELETE FROM {table} WHERE {mine} AND seq = ANY(%b::bigint[]) AND state = 1"
            " AND due - %s > 0 AND token = %s",
            f"UPDATE {{table}} SET state = %s, due = %s WHERE {held}",
            "UPDATE {table} SET due = %s WHERE {mine} AND seq = %s AND token = %s"
            " AND state = 1 AND due - %s > 0",
            "WITH gone AS (DELETE FROM {table} WHERE {mine} AND seq = %s AND token = %s"
            f" AND state = 1 AND due - %s > 0 RETURNING {dead})"
            f" INSERT INTO {s}.mq_dead ({dead}, attempts, reason, dead_at)"
            f" SELECT {dead}, %s, %s, %s FROM gone")
        self._built: dict[tuple[int, ...], Hot] = {}
        self._settles: dict[tuple[int, ...], Settle] = {}
        self.notify = f"SELECT pg_notify('{self.channel}', %s)"

    def publish(self, cols: Sequence[Sequence[Any]], version: int,
                held: bool = False) -> tuple[str, tuple[Any, ...]]:
        """The statement and arguments that write the publish columns ``cols`` (``rows``)
        into the current partition, with a NOTIFY per group, landing only while the
        groups version is ``version`` (else it writes nothing and returns a count of 0).
        The driver's publish and ``outbox.publish_direct`` both write through this.

        A column whose rows all hold one value travels once (never ids and bodies: those
        differ); the others as arrays in binary (%b: ten times cheaper to adapt than as
        text, and each array element costs the client time). ``held``: the statement runs
        in a transaction that may stay open after it (a chunked batch, the application's
        own): it holds the partition's writer lock (``part_lock``) until that ends, so the
        rotation does not call the partition drained while rows in it are uncommitted."""
        same = tuple(i not in (5, 9) and c.count(c[0]) == len(c) for i, c in enumerate(cols))
        args = [c[0] for c, one in zip(cols, same, strict=True) if one]
        args += [c for c, one in zip(cols, same, strict=True) if not one]
        return self._publish_sql(same, held), (*args, version)

    def _publish_sql(self, same: tuple[bool, ...], held: bool) -> str:
        if (same, held) not in self._publish:
            s, cols = self._s, [c.split()[0] for c in _COLUMNS]
            picks = [f"%s::{t[:-2]}" if one else f"r.{c}"
                     for (c, t), one in zip((c.split() for c in _COLUMNS), same, strict=True)]
            arrays = [f"%b::{c.split()[1]}" for c, one in zip(_COLUMNS, same, strict=True)
                      if not one]
            names = [c for c, one in zip(cols, same, strict=True) if not one]
            current = f"SELECT part FROM {s}.mq_parts WHERE state = 1"
            lock = (f"cur AS MATERIALIZED (SELECT part, pg_advisory_xact_lock_shared("
                    f"{part_lock(s)}, part) FROM {s}.mq_parts WHERE state = 1), ") if held else ""
            self._publish[same, held] = (
                f"WITH {lock}ins AS (INSERT INTO {s}.mq_queue (part, {', '.join(cols)},"
                " attempts, token)"
                f" SELECT ({'SELECT part FROM cur' if held else current}), {', '.join(picks)},"
                f" 0, 0 FROM unnest({', '.join(arrays)}) AS r({', '.join(names)})"
                f" WHERE (SELECT value FROM {s}.mq_meta WHERE name = 'groups') = %s"
                f" RETURNING gid) SELECT count(*), (SELECT count(pg_notify('{self.channel}',"
                " g::text)) FROM (SELECT DISTINCT gid FROM ins) AS d(g)) FROM ins")
        return self._publish[same, held]

    def hot(self, drained: tuple[int, ...]) -> Hot:
        """The receivers' statements, skipping the ``drained`` partitions (a leased row is
        never in one: a partition is drained only once it holds no row)."""
        if drained not in self._built:
            skip = ",".join(str(int(p)) for p in drained)
            self._built = {drained: Hot(*(q.replace("{skip}", skip) for q in self._hot))}
        return self._built[drained]

    def settle(self, parts: tuple[int, ...]) -> Settle:
        """The settles of receipts in partitions ``parts``."""
        if parts not in self._settles:
            if len(self._settles) > 64:
                self._settles.clear()
            table, mine = f"{self._s}.mq_queue_{int(parts[0])}", "true"
            if len(parts) > 1:
                table = f"{self._s}.mq_queue"
                mine = f"part = ANY('{{{','.join(str(int(p)) for p in parts)}}}'::smallint[])"
            self._settles[parts] = Settle(*(q.replace("{table}", table).replace("{mine}", mine)
                                            for q in self._settle))
        return self._settles[parts]
