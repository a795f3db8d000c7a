"""The project's demo pipeline: Spark publishes orders, a consumer group bills them.

    python -m mqabstract.spark_sink.demo [--rows 100000] [--consumers 2] [--url URL]

1. Spark (``local[2]``) generates ``--rows`` orders and publishes them through the
   ``mqabstract`` sink to ``orders.<region>.created`` (JSON value, customer key, headers).
2. A consumer group ``billing`` on ``orders.#`` processes them with ``Subscription.consume``
   as an idempotent consumer (``dedupe=SQLiteStore``): a redelivered order whose billing
   already succeeded is acked without billing it again.
   The handler fails on purpose: 2 % of orders fail once (a "flaky downstream") and are
   redelivered after a short backoff; 0.1 % always fail ("poison") and are dead-lettered
   after ``max_attempts`` deliveries.
3. A summary prints what was published, processed, retried and dead-lettered, with rates,
   and checks that every published order was either processed or dead-lettered.

Without ``--url`` it runs on the embedded backend (SQLite) in a fresh temporary file, so
runs never see each other's messages; ``--url default`` uses ``mqabstract.connect()``'s
default instead. ``scripts/demo`` sets up the venv and runs this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import mqabstract
from mqabstract import Backoff, Message
from mqabstract.dedupe import SQLiteStore

GROUP = "billing"
PATTERN = "orders.#"
MAX_ATTEMPTS = 3
REGIONS = ("eu", "us", "apac")
#: Short redelivery delays so the demo finishes quickly (production would use seconds).
BACKOFF = Backoff(initial=0.05, multiplier=2.0, maximum=0.5, jitter=0.1)


def is_flaky(order_id: int) -> bool:
    """Fails on the first delivery only: a transient downstream error."""
    return order_id % 50 == 7


def is_poison(order_id: int) -> bool:
    """Fails on every delivery: ends in the dead-letter store."""
    return order_id % 1000 == 13


class Billing:
    """The consumer's handler: bills an order. Duplicates never reach it: the consume loop
    drops them by message id (``dedupe``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.processed = 0
        self.revenue: Counter[str] = Counter()
        self.orders: Counter[str] = Counter()

    def __call__(self, msg: Message) -> None:
        order = msg.value
        oid = int(order["order_id"])
        if is_poison(oid):
            raise ValueError(f"order {oid}: amount fails validation")
        if is_flaky(oid) and msg.attempt == 1:
            raise ConnectionError(f"order {oid}: payment service timed out")
        with self.lock:
            self.processed += 1
            self.revenue[order["region"]] += order["amount"]
            self.orders[order["region"]] += 1


def spark_session(master: str = "local[2]", app: str = "mqabstract-demo",
                  **conf: str) -> Any:
    """A quiet local session with the sink registered; ``conf`` adds Spark settings.

    Shared by the demo and the sink's tests, so both run Spark the same way.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from mqabstract.spark_sink import register

    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def publish(spark: Any, url: str, rows: int) -> float:
    """Generate ``rows`` orders and write them through the sink; return seconds taken."""
    from pyspark.sql import functions as F

    region = F.element_at(F.array(*[F.lit(r) for r in REGIONS]),
                          (F.col("id") % len(REGIONS) + 1).cast("int"))
    orders = spark.range(0, rows, numPartitions=2).select(
        F.col("id").alias("order_id"),
        F.concat(F.lit("c"), (F.col("id") * 7 % 997).cast("string")).alias("customer"),
        ((F.col("id") * 7919 % 10000) / 100.0).alias("amount"),
        region.alias("region"),
    )
    out = orders.select(
        F.struct("order_id", "customer", "amount", "region").alias("value"),  # sent as JSON
        F.col("customer").alias("key"),
        F.create_map(F.lit("source"), F.lit("spark-demo"), F.lit("region"), F.col("region"))
        .alias("headers"),
        F.concat(F.lit("orders."), F.col("region"), F.lit(".created")).alias("topic"),
    )
    started = time.perf_counter()
    out.write.format("mqabstract").option("url", url).mode("append").save()
    return time.perf_counter() - started


def consume(url: str, consumers: int, expected: int, timeout: float, store: SQLiteStore
            ) -> tuple[Billing, Any, float]:
    """Run ``consumers`` competing consumers until the group is drained (or ``timeout``)."""
    billing = Billing()
    stop = threading.Event()
    stats: list[Any] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with mqabstract.connect(url) as mq:
                sub = mq.subscribe(GROUP, PATTERN, max_attempts=MAX_ATTEMPTS)
                stats.append(sub.consume(billing, batch=200, wait=0.2, backoff=BACKOFF,
                                         stop=stop, dedupe=store))
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"consumer-{i}") for i in range(consumers)]
    for t in threads:
        t.start()
    tty = sys.stdout.isatty()
    shown = 0.0
    with mqabstract.connect(url) as mq:
        while not stop.is_set():
            s = mq.stats(GROUP)
            done = billing.processed + (s.dead or 0)
            now = time.perf_counter()
            if tty or now - shown >= 5:
                shown = now
                print(f"{chr(13) if tty else ''}  consumed {billing.processed:>9,}  "
                      f"dead {s.dead or 0:>6,}  "
                      f"waiting {(s.ready or 0) + (s.leased or 0) + (s.delayed or 0):>9,}",
                      end="" if tty else "\n", flush=True)
            if done >= expected and not (s.ready or s.leased or s.delayed):
                break
            if time.perf_counter() - started > timeout:
                print("\n  timed out waiting for the group to drain", file=sys.stderr)
                break
            stop.wait(0.5)
    elapsed = time.perf_counter() - started
    stop.set()
    for t in threads:
        t.join()
    if tty:
        print()
    if errors:
        raise errors[0]
    total = mqabstract.ConsumeStats()
    for s in stats:
        for field in ("received", "acked", "retried", "dead_lettered", "failed",
                      "duplicates"):
            setattr(total, field, getattr(total, field) + getattr(s, field))
    return billing, total, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="orders to generate")
    parser.add_argument("--consumers", type=int, default=2, help="competing consumers")
    parser.add_argument("--url", help="broker URL ('default' = connect()'s default); "
                        "default: a SQLite file in a fresh temporary directory")
    parser.add_argument("--timeout", type=float, default=600.0, help="consume time limit, s")
    args = parser.parse_args(argv)
    # The summary reports dead letters; don't print a warning line for each of them.
    logging.getLogger("mqabstract").setLevel(logging.ERROR)

    workdir = None
    if args.url is None:
        workdir = tempfile.mkdtemp(prefix="mqabstract-demo-")
        # synchronous=normal: WAL stays crash-safe for the application; a power loss may drop
        # the last commits, which a throwaway demo file can afford.
        url = f"sqlite:///{workdir}/demo.db?synchronous=normal"
    elif args.url == "default":
        url = mqabstract.default_url()
    else:
        url = args.url
    try:
        return run(url, args.rows, args.consumers, args.timeout)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def run(url: str, rows: int, consumers: int, timeout: float) -> int:
    with mqabstract.connect(url) as mq:
        print(f"broker     {mq.url}  ({mq.backend})")
        mq.declare(GROUP, PATTERN, max_attempts=MAX_ATTEMPTS)
        before = mq.stats(GROUP)
    backlog = (before.ready or 0) + (before.delayed or 0) + (before.leased or 0)
    if backlog:
        print(f"note       group {GROUP!r} already holds {backlog:,} messages from an earlier run")

    print("spark      starting local[2] ...", flush=True)
    t0 = time.perf_counter()
    spark = spark_session()
    print(f"spark      ready in {time.perf_counter() - t0:.1f} s; publishing {rows:,} orders",
          flush=True)
    try:
        pub_s = publish(spark, url, rows)
    finally:
        spark.stop()
    print(f"published  {rows:,} in {pub_s:.1f} s", flush=True)

    print(f"consuming  group {GROUP!r} on {PATTERN!r} with {consumers} consumers, "
          f"max_attempts={MAX_ATTEMPTS}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mqabstract-dedupe-") as tmp, \
            SQLiteStore(os.path.join(tmp, "billed.db")) as store:
        billing, stats, con_s = consume(url, consumers, rows + backlog, timeout, store)
    with mqabstract.connect(url) as mq:
        after = mq.stats(GROUP)
        sample = mq.dead_letters(GROUP, limit=1)

    processed, dead = billing.processed, after.dead or 0
    expect_dead = sum(1 for i in range(rows) if is_poison(i))
    expect_retried = sum(1 for i in range(rows) if is_flaky(i) and not is_poison(i)) + \
        expect_dead * (MAX_ATTEMPTS - 1)
    width = 11
    print()
    print("summary")
    print(f"  published  {rows:>{width},}  {rows / pub_s:>10,.0f} rows/s  (Spark sink, local[2])")
    print(f"  processed  {processed:>{width},}  {processed / con_s:>10,.0f} msg/s   "
          f"({consumers} consumers, {con_s:.1f} s)")
    print(f"  retried    {stats.retried:>{width},}  (handler failed, redelivered after backoff; "
          f"expected {expect_retried:,})")
    print(f"  dead       {dead:>{width},}  (poison orders after {MAX_ATTEMPTS} attempts; "
          f"expected {expect_dead:,})")
    print(f"  duplicates {stats.duplicates:>{width},}  (redeliveries acked unbilled: dedupe store)")
    if sample:
        print(f"  e.g. dead  {sample[0].id}: {sample[0].reason}")
    for region in REGIONS:
        print(f"  revenue    {region:<5} {billing.revenue[region]:>14,.2f} "
              f"over {billing.orders[region]:,} orders")
    ok = processed + dead == rows + backlog and (backlog > 0 or dead == expect_dead)
    verdict = "OK: every order was processed or dead-lettered" if ok else (
        f"MISMATCH: {processed:,} processed + {dead:,} dead of {rows + backlog:,}")
    print(f"result     {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
