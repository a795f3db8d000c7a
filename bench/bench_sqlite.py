"""SQLite backend throughput, next to raw sqlite3 writing the same rows.

    .venv/bin/python bench/bench_sqlite.py [--n 50000] [--dir /tmp/mqbench] [--synchronous normal]

Prints msg/s for: single publish, batch publish, publish+receive+ack cycles (per-message
ack through the public API, and batched ack through the driver subscription), and the raw
sqlite3 baseline (one transaction per row; executemany of the same rows in one transaction
per batch) with the mqabstract/raw ratio. No assertions: numbers, not tests.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import mqabstract
from mqabstract.backends.sqlite import _SCHEMA

BODY = b"x" * 100


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def raw_conn(path: Path, sync: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={sync}")
    for stmt in _SCHEMA.split(";"):  # the backend's own tables and indexes: a fair baseline
        if stmt.strip():
            conn.execute(stmt)
    return conn


def raw_rows(n: int) -> list[tuple]:
    now = time.time()
    return [(1, 0, 0.0, 0, 0, 0, None, f"id{i}", "bench.t", now, None, BODY) for i in range(n)]


INSERT = ("INSERT INTO mq_queue (gid, state, due, priority, attempts, token, key, id, topic,"
          " published_at, headers, body) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)")


def raw_single(path: Path, n: int, sync: str) -> float:
    conn = raw_conn(path, sync)
    rows = raw_rows(n)
    start = time.perf_counter()
    for row in rows:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(INSERT, row)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return rate(n, elapsed)


def raw_batch(path: Path, n: int, batch: int, sync: str) -> float:
    conn = raw_conn(path, sync)
    rows = raw_rows(n)
    start = time.perf_counter()
    for i in range(0, n, batch):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT, rows[i : i + batch])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return rate(n, elapsed)


def mq_single(url: str, n: int) -> float:
    with mqabstract.connect(url) as mq:
        mq.declare("bench-single", "bench.single")
        start = time.perf_counter()
        for _ in range(n):
            mq.publish("bench.single", BODY)
        return rate(n, time.perf_counter() - start)


def mq_batch(url: str, n: int, batch: int) -> float:
    with mqabstract.connect(url) as mq:
        mq.declare("bench-batch", "bench.batch")
        msgs = [("bench.batch", BODY)] * batch
        start = time.perf_counter()
        for _ in range(n // batch):
            mq.publish_batch(msgs)
        return rate(n // batch * batch, time.perf_counter() - start)


def mq_cycle(url: str, n: int, batch: int, batched_ack: bool) -> float:
    """Publish in batches, receive up to ``batch`` at a time, ack every message."""
    group = f"bench-cycle-{int(batched_ack)}"
    topic = f"bench.cycle{int(batched_ack)}"
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe(group, topic)
        msgs = [(topic, BODY)] * batch
        done = 0
        start = time.perf_counter()
        while done < n:
            mq.publish_batch(msgs)
            got = sub.receive(batch, 1.0)
            if batched_ack:
                sub._inner.ack([m._receipt for m in got])  # driver-level batched ack
            else:
                for m in got:
                    m.ack()
            done += len(got)
        return rate(done, time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000, help="messages per batch measurement")
    ap.add_argument("--single", type=int, default=5_000, help="messages for single publish")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--cycle-batch", type=int, default=100)
    ap.add_argument("--synchronous", default="normal", choices=["normal", "full"])
    ap.add_argument("--dir", default=None, help="directory for the files (default: a tmpdir)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="mqbench-"))
    base.mkdir(parents=True, exist_ok=True)
    sync = args.synchronous.upper()
    url = f"sqlite:///{base.resolve()}/mq.db?synchronous={args.synchronous}"
    print(f"sqlite {sqlite3.sqlite_version}, synchronous={sync}, files in {base}")
    print(f"{'measurement':<48}{'mqabstract':>12}{'raw sqlite3':>13}{'ratio':>8}")

    def row(name: str, ours: float, raw: float | None = None) -> None:
        raw_s = f"{raw:>13,.0f}" if raw else f"{'-':>13}"
        ratio = f"{ours / raw:>8.2f}" if raw else f"{'':>8}"
        print(f"{name:<48}{ours:>12,.0f}{raw_s}{ratio}", flush=True)

    try:
        r_single = raw_single(base / "raw1.db", args.single, sync)
        row(f"publish single, 1 txn each (n={args.single})", mq_single(url, args.single),
            r_single)
        r_batch = raw_batch(base / "raw2.db", args.n, args.batch, sync)
        row(f"publish_batch of {args.batch} (n={args.n})", mq_batch(url, args.n, args.batch),
            r_batch)
        cyc = args.cycle_batch
        row(f"cycle: batch {cyc} + receive {cyc} + ack each", mq_cycle(url, args.n // 2, cyc,
                                                                        False))
        row(f"cycle: batch {cyc} + receive {cyc} + batched ack", mq_cycle(url, args.n // 2, cyc,
                                                                          True))
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print("msg/s; ratio = mqabstract / raw sqlite3 executemany of the same rows")


if __name__ == "__main__":
    main()
