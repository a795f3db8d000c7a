"""PostgreSQL backend throughput, next to raw psycopg doing the same work in the same run.

    .venv/bin/python bench/bench_postgresql.py [--url $MQ_TEST_POSTGRESQL_URL] [--n 50000]
        [--batch 1000] [--cycle-batch 100] [--rounds 2] [--rss-to 200000]

Every measurement uses 100-byte bodies and one group, against the same server:

* publish: mqabstract ``Broker.publish_batch`` in chunks of ``batch`` against raw psycopg
  inserting the same rows (the driver's columns: group, state, due, priority, attempts,
  token, key, id, topic, published_at, headers, body) into a plain table with the same
  indexes as the driver's, one ``INSERT … SELECT FROM unnest(arrays)`` per chunk, arrays
  in binary: the fastest way psycopg has.
* consume: ``n`` messages published beforehand, received ``cycle-batch`` at a time and
  acked (mqabstract: ``Subscription.receive`` + ``ack_many``; raw: ``UPDATE … WHERE seq =
  ANY(ARRAY(SELECT seq … ORDER BY priority DESC, seq LIMIT k FOR UPDATE SKIP LOCKED))
  RETURNING …``, then ``DELETE … WHERE seq = ANY(…)`` of the claimed rows).
* cycle: ``publish_batch`` of ``cycle-batch``, receive them, ack them, ``n`` messages
  (raw: the same three statements as above).
* rss: one ``Broker`` running the cycle, its process's RSS after 100,000 messages and
  after ``rss-to`` (1,000,000 for the issue's figure: about 4 minutes at 5k msg/s).

Raw and mqabstract alternate every 2000 messages within a round (load drifts on a shared
machine); the best round of each is reported with the mqabstract / raw ratio. No
assertions: numbers, not tests.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import time
from collections.abc import Callable

import psycopg

import mqabstract

BODY = b"x" * 100
COLS = ("gid, state, due, priority, attempts, token, key, id, topic, published_at, headers,"
        " body")


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Raw:
    """Raw psycopg on a plain table with the driver's columns and indexes."""

    def __init__(self, url: str, schema: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.t = f"{schema}.raw_queue"
        for q in (f"CREATE SCHEMA {schema}",
                  f"CREATE TABLE {self.t} (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                  " gid integer NOT NULL, state smallint NOT NULL, due float8 NOT NULL,"
                  " priority smallint NOT NULL, attempts integer NOT NULL, token bigint NOT"
                  " NULL, key text, id text NOT NULL, topic text NOT NULL, published_at"
                  " float8 NOT NULL, headers text, body bytea NOT NULL) WITH (fillfactor = 80)",
                  f"CREATE INDEX ON {self.t} (gid, priority DESC, seq) WHERE state = 0",
                  f"CREATE INDEX ON {self.t} (gid, due) WHERE state <> 0",
                  f"CREATE INDEX ON {self.t} (gid, key, seq) WHERE key IS NOT NULL"):
            self.conn.execute(q)
        self.insert = (f"INSERT INTO {self.t} ({COLS}) SELECT 1, 0, 0, 0, 0, 0, NULL, r.id,"
                       " 'bench.raw', r.at, NULL, r.body FROM unnest(%b::text[], %b::float8[],"
                       " %b::bytea[]) AS r(id, at, body)")
        self.claim = (f"UPDATE {self.t} SET state = 1, due = %s, attempts = attempts + 1,"
                      f" token = %s WHERE seq = ANY(ARRAY(SELECT seq FROM {self.t} WHERE gid = 1"
                      " AND state = 0 ORDER BY priority DESC, seq LIMIT %s FOR UPDATE SKIP"
                      " LOCKED)) RETURNING seq, id, topic, body, headers, key, priority,"
                      " attempts, published_at")
        self.delete = f"DELETE FROM {self.t} WHERE seq = ANY(%b::bigint[])"

    def publish(self, k: int) -> None:
        ids = [secrets.token_hex(8) for _ in range(k)]
        self.conn.execute(self.insert, (ids, [time.time()] * k, [BODY] * k))

    def consume(self, k: int) -> int:
        rows = self.conn.execute(self.claim, (time.time() + 30, random.getrandbits(62), k),
                                 binary=True).fetchall()
        if rows:
            self.conn.execute(self.delete, ([r[0] for r in rows],))
        return len(rows)


def timed(n: int, step: Callable[[], int]) -> tuple[int, float]:
    """Messages done and seconds taken by ``step`` until ``n`` (or it got nothing)."""
    done, t0 = 0, time.perf_counter()
    while done < n:
        got = step()
        if not got:
            break
        done += got
    return done, time.perf_counter() - t0


def paired(n: int, raw: Callable[[], int], ours: Callable[[], int],
           chunk: int = 2000) -> tuple[float, float]:
    """Raw and mqabstract rates over ``n`` messages each, alternating every ``chunk`` so
    that load drifting on a shared machine hits both."""
    totals = [0, 0.0, 0, 0.0]
    for _ in range(0, n, chunk):
        for i, step in ((0, raw), (2, ours)):
            done, seconds = timed(chunk, step)
            totals[i] += done
            totals[i + 1] += seconds
    return rate(int(totals[0]), totals[1]), rate(int(totals[2]), totals[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=os.environ.get("MQ_TEST_POSTGRESQL_URL",
                                                    "postgresql://mq:mqsecret@127.0.0.1:55432/mqtest"))
    ap.add_argument("--n", type=int, default=50_000, help="messages per measurement")
    ap.add_argument("--batch", type=int, default=1000, help="publish_batch size")
    ap.add_argument("--cycle-batch", type=int, default=100, help="receive / cycle batch")
    ap.add_argument("--rounds", type=int, default=2, help="alternate raw/mqabstract runs")
    ap.add_argument("--rss-to", type=int, default=200_000,
                    help="messages for the RSS figure (1000000 for the issue's; 0: skip)")
    args = ap.parse_args()
    plain = args.url.split("?")[0]
    token = secrets.token_hex(4)
    raw_schema, mq_schema = f"bench_raw_{token}", f"bench_mq_{token}"
    raw = Raw(plain, raw_schema)
    mq = mqabstract.connect(f"{plain}?schema={mq_schema}")
    sub = mq.subscribe("bench", "bench.#")
    n, b, k = args.n, args.batch, args.cycle_batch
    out: dict[str, list[float]] = {}

    def keep(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    def mq_publish(size: int) -> int:
        mq.publish_batch([("bench.mq", BODY)] * size)
        return size

    def mq_consume() -> int:
        got = sub.receive(k, 1.0)
        sub.ack_many(got)
        return len(got)

    def raw_publish(size: int) -> int:
        raw.publish(size)
        return size

    def mq_cycle() -> int:
        mq_publish(k)
        return mq_consume()

    def raw_cycle() -> int:
        raw.publish(k)
        return raw.consume(k)

    try:
        for _ in range(args.rounds):
            for key, pair in (("publish", (lambda: raw_publish(b), lambda: mq_publish(b))),
                              ("consume", (lambda: raw.consume(k), mq_consume)),
                              ("cycle", (raw_cycle, mq_cycle))):
                raw_rate, mq_rate = paired(n, *pair, chunk=max(2000, b))
                keep(f"raw {key}", raw_rate)
                keep(f"mq {key}", mq_rate)
        rss: list[float] = []
        if args.rss_to:
            for upto in (100_000, args.rss_to):
                timed(upto - (100_000 if rss else 0), mq_cycle)
                rss.append(rss_mib())
    finally:
        sub.close()
        mq.close()
        raw.conn.execute(f"DROP SCHEMA {raw_schema} CASCADE")
        raw.conn.execute(f"DROP SCHEMA {mq_schema} CASCADE")
        raw.conn.close()

    best = {name: max(v) for name, v in out.items()}
    version = psycopg.connect(plain).info.server_version
    print(f"PostgreSQL {version // 10000}.{version % 10000} at "
          f"{mqabstract.BrokerURL.parse(plain).redacted()}, n={n}, best of {args.rounds} "
          f"rounds, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"{'measurement':<44}{'mqabstract':>12}{'raw psycopg':>13}{'ratio':>8}")
    for what, key, target in ((f"publish_batch of {b}", "publish", 0.8),
                              (f"receive({k}) + ack_many", "consume", 0.8),
                              (f"cycle: publish {k}, receive, ack_many", "cycle", None)):
        ours, theirs = best[f"mq {key}"], best[f"raw {key}"]
        note = f"  (target >= {target})" if target else "  (target >= 20,000 msg/s)"
        print(f"{what:<44}{ours:>12,.0f}{theirs:>13,.0f}{ours / theirs:>8.2f}{note}")
    if rss:
        print(f"consumer RSS: {rss[0]:.1f} MiB after 100,000 messages, {rss[1]:.1f} MiB after "
              f"{args.rss_to:,} (+{rss[1] - rss[0]:.1f} MiB; target < 50 MiB from 100k to 1M)")
    print("msg/s; ratio = mqabstract / raw psycopg on a plain table with the same indexes")


if __name__ == "__main__":
    main()
