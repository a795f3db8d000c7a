"""PostgreSQL backend under a held xmin horizon: throughput, dead tuples and size over time.

    .venv/bin/python bench/bloat_postgresql.py [--url $MQ_TEST_POSTGRESQL_URL]
        [--baseline 60] [--hold-minutes 5] [--after 90] [--sample 5] [--batch 100]

One steady loop (``publish_batch`` of ``batch`` 100-byte messages, ``receive(batch)``,
``ack_many``) runs for the whole time in a schema of its own. After ``baseline`` seconds a
second connection runs ``BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1 FROM
<schema>.mq_queue LIMIT 1`` and stays in that transaction for ``hold-minutes`` (its
snapshot holds back the xmin horizon, so VACUUM can remove no row version deleted after
it, and it holds ACCESS SHARE on the tables it read), then rolls back; the loop goes on
for ``after`` seconds. Every ``sample`` seconds one line: the loop's msg/s over the
sample, the schema's ``n_dead_tup`` and ``n_live_tup`` (``pg_stat_user_tables``, summed
over its tables), its ``pg_total_relation_size`` and the load average. A summary at the
end compares the hold and the minute after it with the baseline. No assertions: numbers.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import threading
import time

import psycopg

import mqabstract

BODY = b"x" * 100


def stats(conn: psycopg.Connection, schema: str) -> tuple[int, int, int]:
    """(n_dead_tup, n_live_tup, bytes) over the schema's tables (partitions included)."""
    row = conn.execute(
        "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(n_live_tup), 0),"
        " coalesce(sum(pg_total_relation_size(relid)), 0)"
        " FROM pg_stat_user_tables WHERE schemaname = %s", (schema,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=os.environ.get("MQ_TEST_POSTGRESQL_URL",
                                                    "postgresql://mq:mqsecret@127.0.0.1:55432/mqtest"))
    ap.add_argument("--baseline", type=float, default=60.0, help="seconds before the hold")
    ap.add_argument("--hold-minutes", type=float, default=5.0, help="how long the reader holds")
    ap.add_argument("--after", type=float, default=90.0, help="seconds after the hold")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between lines")
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()

    schema = f"bloat_{secrets.token_hex(4)}"
    url = args.url + ("&" if "?" in args.url else "?") + f"schema={schema}"
    plain = args.url.split("?")[0]
    done = [0]
    stop = threading.Event()
    errors: list[BaseException] = []
    mq = mqabstract.connect(url)
    sub = mq.subscribe("bloat", "bloat.#")

    def loop() -> None:
        msgs = [("bloat.t", BODY)] * args.batch
        try:
            while not stop.is_set():
                mq.publish_batch(msgs)
                got = sub.receive(args.batch, 1.0)
                sub.ack_many(got)
                done[0] += len(got)
        except BaseException as exc:  # reported at the end
            errors.append(exc)

    worker = threading.Thread(target=loop, daemon=True)
    mon = psycopg.connect(plain, autocommit=True)
    reader: psycopg.Connection | None = None
    hold_at = args.baseline
    release_at = hold_at + args.hold_minutes * 60
    end_at = release_at + args.after
    rows: list[tuple[float, str, float, int, int, int]] = []
    print(f"schema {schema}, batch {args.batch}, hold {args.hold_minutes:g} min after "
          f"{args.baseline:g} s, {os.cpu_count()} cpus")
    print(f"{'t/s':>6} {'phase':<8}{'msg/s':>9}{'dead tup':>11}{'live tup':>10}"
          f"{'size MB':>9}  load")
    start = time.monotonic()
    worker.start()
    last_t, last_n = start, 0
    try:
        while True:
            now = time.monotonic()
            t = now - start
            if reader is None and hold_at <= t < release_at:
                reader = psycopg.connect(plain)
                reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                reader.execute(f"SELECT 1 FROM {schema}.mq_queue LIMIT 1").fetchall()
                print(f"{t:6.0f} repeatable-read reader open", flush=True)
            if reader is not None and t >= release_at:
                reader.rollback()
                reader.close()
                reader = None
                print(f"{t:6.0f} reader closed", flush=True)
            if t >= end_at or errors:
                break
            time.sleep(max(0.0, args.sample - (time.monotonic() - now)))
            now, n = time.monotonic(), done[0]
            rate = (n - last_n) / (now - last_t)
            last_t, last_n = now, n
            t = now - start
            phase = "base" if t <= hold_at else "hold" if t <= release_at else "after"
            dead, live, size = stats(mon, schema)
            rows.append((t, phase, rate, dead, live, size))
            load = os.getloadavg()[0]
            print(f"{t:6.0f} {phase:<8}{rate:9,.0f}{dead:11,}{live:10,}{size / 2**20:9.1f}"
                  f"  {load:.1f}", flush=True)
    finally:
        stop.set()
        worker.join(10)
        if reader is not None:
            reader.close()
        sub.close()
        mq.close()
        mon.execute(f"DROP SCHEMA {schema} CASCADE")
        mon.close()
    if errors:
        raise errors[0]
    summary(rows, release_at)


def summary(rows: list[tuple[float, str, float, int, int, int]], release_at: float) -> None:
    base = [r for r in rows if r[1] == "base"][1:]  # the first sample includes warm-up
    hold = [r for r in rows if r[1] == "hold"]
    after = [r for r in rows if r[1] == "after"]
    if not base or not hold:
        return
    b_rate = statistics.mean(r[2] for r in base)
    b_dead = max(r[3] for r in base)
    b_size = max(r[5] for r in base)
    print(f"baseline: {b_rate:,.0f} msg/s, at most {b_dead:,} dead tuples, "
          f"{b_size / 2**20:.1f} MB")
    print(f"hold: mean {statistics.mean(r[2] for r in hold) / b_rate:.2f}x, lowest "
          f"{min(r[2] for r in hold) / b_rate:.2f}x of the baseline rate; at most "
          f"{max(r[3] for r in hold):,} dead tuples, {max(r[5] for r in hold) / 2**20:.1f} MB")
    for what, col, limit in (("dead tuples", 3, b_dead * 1.5), ("size", 5, b_size * 1.5)):
        back = next((r[0] - release_at for r in after if float(r[col]) <= limit), None)
        when = f"{back:.0f} s after the reader ended" if back is not None else "not within the run"
        print(f"{what} back to <= 1.5x the baseline's highest: {when}")


if __name__ == "__main__":
    main()
