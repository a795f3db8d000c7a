"""The ring of ``mq_queue`` partitions (docs/backends/postgresql.md, "Bloat"): rows go to
the current partition; every ``ROTATE_EVERY`` seconds of traffic another one becomes
current; a former one that holds no row any more is *drained* (the hot statements prune
it) and then emptied by ``TRUNCATE``, which a held xmin horizon does not stop (VACUUM
would keep every row version deleted after the oldest snapshot)."""

from __future__ import annotations

import psycopg
import psycopg.errors

from .schema import part_lock, partition_ddl

__all__ = ["rotate"]

FREE, CURRENT, OPEN, DRAINED = 0, 1, 2, 3  # mq_parts.state
ROTATE_EVERY = 1.0  # seconds a partition stays current while rows arrive
SETTLE = 0.5  # seconds a former partition waits before it is looked at (publishes in flight)
STRAGGLERS = 1000  # at most this many rows left: move them to the current partition
MAX_PARTS = 64


def _try(conn: psycopg.Connection, *steps: tuple[str, tuple[object, ...]]) -> bool:
    """Run ``steps`` in a savepoint; False when a lock was not granted within
    ``lock_timeout`` (a reader holds the partition: try again on a later pass)."""
    try:
        with conn.transaction():
            for query, args in steps:
                conn.execute(query, args)
        return True
    except psycopg.errors.LockNotAvailable:
        return False


def _alone(conn: psycopg.Connection, s: str, p: int) -> bool:
    """No transaction that wrote into partition ``p`` is open (its rows are not visible
    yet): the partition's writer lock (``schema.part_lock``), held until this pass ends."""
    row = conn.execute(f"SELECT pg_try_advisory_xact_lock({part_lock(s)}, %s)", (p,)).fetchone()
    return bool(row and row[0])


def rotate(conn: psycopg.Connection, s: str) -> tuple[int, ...]:
    """One maintenance pass for schema ``s``, by whichever process gets the advisory lock:
    rotate, drain former partitions (moving a few stragglers forward), truncate drained
    ones. Every lock it needs is waited for at most 20 ms, so it never stalls the queue
    behind a reader; what it cannot do now it does on a later pass. Returns the drained
    partitions (another process holding the lock: as they are now)."""
    drained = f"SELECT coalesce(array_agg(part ORDER BY part), '{{}}') FROM {s}.mq_parts" \
              " WHERE state = 3"
    with conn.transaction():
        got = conn.execute("SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 1838))",
                           (f"mqabstract:{s}",)).fetchone()
        if not got or not got[0]:
            return tuple(conn.execute(drained).fetchone()[0])  # type: ignore[index]
        conn.execute("SET LOCAL lock_timeout = '20ms'")
        row = conn.execute(f"SELECT extract(epoch FROM clock_timestamp())::float8,"
                           f" (SELECT last_value FROM {s}.mq_seq)").fetchone()
        assert row is not None
        now, last = row
        parts = {p: (state, since, seq0) for p, state, since, seq0 in conn.execute(
            f"SELECT part, state, since, seq0 FROM {s}.mq_parts ORDER BY part")}
        set_state = f"UPDATE {s}.mq_parts SET state = %s, since = %s, seq0 = %s WHERE part = %s"
        cur = next(p for p, v in parts.items() if v[0] == CURRENT)
        if now - parts[cur][1] >= ROTATE_EVERY and last > parts[cur][2]:
            new = next((p for p, v in parts.items() if v[0] == FREE), None)
            if new is None and len(parts) < MAX_PARTS:
                new = max(parts) + 1
                ddl = [(q.format(s=s), ()) for q in partition_ddl(new)]
                if not _try(conn, *ddl, (f"INSERT INTO {s}.mq_parts VALUES (%s, 0, 0, 0)",
                                         (new,))):
                    new = None
            if new is not None:
                conn.execute(set_state, (OPEN, now, 0, cur))
                conn.execute(set_state, (CURRENT, now, last, new))
                parts[cur], cur = (OPEN, now, 0), new
        for p, (state, since, _) in parts.items():
            if state != OPEN or now - since < SETTLE:
                continue
            table = f"{s}.mq_queue_{p}"
            alone = _alone(conn, s, p)
            (left,) = conn.execute(f"SELECT count(*) FROM (SELECT FROM {table} LIMIT %s) t",
                                   (STRAGGLERS + 1,)).fetchone() or (0,)
            if not left and alone:
                conn.execute(set_state, (DRAINED, now, 0, p))
            elif 0 < left <= STRAGGLERS:  # ready and delayed rows move on, keeping their seq
                conn.execute(f"UPDATE {s}.mq_queue SET part = %s WHERE part = %s AND seq ="
                             f" ANY(ARRAY(SELECT seq FROM {table} WHERE state <> 1"
                             " FOR UPDATE SKIP LOCKED))", (cur, p))
        for p, (state, _, _) in parts.items():
            table = f"{s}.mq_queue_{p}"
            if state == DRAINED and not _alone(conn, s, p):
                # A writer whose snapshot is older than the drain (publish_direct in a
                # REPEATABLE READ transaction) wrote into p: the claims must look at it.
                conn.execute(set_state, (OPEN, now, 0, p))
                continue
            if state == DRAINED and _try(conn, (f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE",
                                                ())):
                # Under the lock no insert is in flight: a row that came in after the
                # drain check (a publish routed before the rotation) is kept.
                empty = conn.execute(f"SELECT NOT EXISTS (SELECT FROM {table})").fetchone()
                if empty and empty[0]:
                    conn.execute(f"TRUNCATE {table}")
                conn.execute(set_state, (FREE if empty and empty[0] else OPEN, now, 0, p))
        return tuple(conn.execute(drained).fetchone()[0])  # type: ignore[index]
