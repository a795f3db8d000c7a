"""Spark sink throughput per backend, next to a hand-written ``mapInArrow`` publisher.

    .venv/bin/python bench/bench_spark.py [--backends sqlite,rabbitmq,kafka,sqs] [--rows N]

For each backend that is available (driver module present, broker answering: the URL in
``MQ_TEST_<KIND>_URL`` or the local default from ``scripts/brokers``), one ``local[2]``
session writes the same cached DataFrame (``value`` string of ~110 bytes, ``key``) twice:

* **sink**: ``df.write.format("mqabstract")`` into a declared group;
* **raw**: ``df.mapInArrow(publisher)`` where the publisher uses the native client the way a
  careful hand-written job would, with the same durability: sqlite3 ``executemany`` into the
  backend's own table (one transaction per Arrow batch), pika with publisher confirms,
  kafka-python with ``acks=all`` + idempotence and a final ``flush()``, boto3
  ``send_message_batch`` of 10.

Prints rows/s for both and the sink/raw ratio. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import contextlib

import brokerctl  # scripts/ is not a package: found via sys.path

import mqabstract
from mqabstract import registry
from mqabstract.errors import MQError
from mqabstract.url import BrokerURL

SCHEMES = {"sqlite": "sqlite", "rabbitmq": "amqp", "kafka": "kafka", "sqs": "sqs"}
DEFAULT_ROWS = {"sqlite": 200_000, "rabbitmq": 20_000, "kafka": 200_000, "sqs": 3_000}

Publisher = Callable[[Iterator[Any]], Iterator[Any]]


def broker_url(kind: str, workdir: str) -> str | None:
    """The URL to bench ``kind`` on, or None when its driver or broker is missing."""
    try:
        registry.resolve(SCHEMES[kind])
    except MQError as exc:
        print(f"{kind:<9} skipped: {exc}")
        return None
    if kind == "sqlite":
        return f"sqlite:///{workdir}/bench.db"
    explicit = os.environ.get(brokerctl.ENV_URL_VARS[kind], "").strip()
    if explicit:
        return explicit
    port = brokerctl.default_port(kind)
    if brokerctl.ready(kind, port):
        if kind == "sqs":  # the local moto server takes any credentials; AWS would not
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
        return str(brokerctl.broker_url(kind, port))
    print(f"{kind:<9} skipped: no broker (scripts/brokers up {kind})")
    return None


def _done(n: int) -> Any:
    import pyarrow as pa

    return pa.RecordBatch.from_pydict({"n": pa.array([n], pa.int64())})


# -- hand-written publishers (run inside Spark tasks; import clients there) -----------------------
def raw_sqlite(url: str, group: str) -> Publisher:
    import sqlite3

    from mqabstract.backends.sqlite import _db_path

    path = str(_db_path(BrokerURL.parse(url)))

    with sqlite3.connect(path) as conn:
        gid = conn.execute("SELECT gid FROM mq_groups WHERE name = ?", (group,)).fetchone()[0]

    def publish(batches: Iterator[Any]) -> Iterator[Any]:
        import sqlite3
        import time

        from pyspark import TaskContext

        part = TaskContext.get().partitionId()
        conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # the backend's default
        sql = ("INSERT INTO mq_queue (gid, state, due, priority, attempts, token, key, id, "
               "topic, published_at, headers, body) VALUES (?,0,0.0,0,0,0,?,?,?,?,?,?)")
        n = 0
        for rb in batches:
            now = time.time()
            values = rb.column("value").to_pylist()
            keys = rb.column("key").to_pylist()
            rows = [(gid, keys[i], f"raw.{part}.{n + i}", "bench.raw", now, None,
                     values[i].encode()) for i in range(rb.num_rows)]
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(sql, rows)
            conn.execute("COMMIT")
            n += rb.num_rows
        conn.close()
        yield _done(n)

    return publish


def raw_rabbitmq(url: str, group: str) -> Publisher:
    exchange, queue = f"bench-raw-{group}", f"bench-raw-{group}"

    def publish(batches: Iterator[Any]) -> Iterator[Any]:
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        ch.exchange_declare(exchange, "topic", durable=True, auto_delete=True)
        ch.queue_declare(queue, durable=True, arguments={"x-expires": 600_000})
        ch.queue_bind(queue, exchange, "bench.#")
        ch.confirm_delivery()  # basic_publish now returns after the broker's confirm
        n = 0
        for rb in batches:
            values = rb.column("value").to_pylist()
            keys = rb.column("key").to_pylist()
            for v, k in zip(values, keys, strict=True):
                ch.basic_publish(exchange, "bench.raw", v.encode(), pika.BasicProperties(
                    delivery_mode=2, message_id=f"raw{n}", headers={"key": k}))
                n += 1
        conn.close()
        yield _done(n)

    return publish


def raw_kafka(url: str, group: str) -> Publisher:
    parsed = BrokerURL.parse(url)
    servers = [f"{h}:{p or 9092}" for h, p in parsed.hosts]
    topic = f"bench-raw-{group}"
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=servers)
    admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()

    def publish(batches: Iterator[Any]) -> Iterator[Any]:
        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=servers, acks="all", enable_idempotence=True,
                                 linger_ms=5, batch_size=256 * 1024)
        n = 0
        for rb in batches:
            values = rb.column("value").to_pylist()
            keys = rb.column("key").to_pylist()
            for v, k in zip(values, keys, strict=True):
                producer.send(topic, value=v.encode(), key=k.encode(),
                              headers=[("id", f"raw{n}".encode())])
                n += 1
        producer.flush()  # every send acknowledged by all in-sync replicas
        producer.close()
        yield _done(n)

    return publish


def raw_sqs(url: str, group: str) -> Publisher:
    parsed = BrokerURL.parse(url)
    params = dict(parsed.params)
    endpoint, region = params.get("endpoint_url"), params.get("region", "us-east-1")
    import boto3

    queue_url = boto3.client("sqs", endpoint_url=endpoint, region_name=region).create_queue(
        QueueName=f"bench-raw-{group}")["QueueUrl"]

    def publish(batches: Iterator[Any]) -> Iterator[Any]:
        import boto3

        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=region)
        n = 0
        for rb in batches:
            values = rb.column("value").to_pylist()
            for start in range(0, len(values), 10):
                entries = [{"Id": str(i), "MessageBody": v}
                           for i, v in enumerate(values[start:start + 10])]
                result = sqs.send_message_batch(QueueUrl=queue_url, Entries=entries)
                if result.get("Failed"):
                    raise RuntimeError(f"SQS rejected {result['Failed']}")
            n += len(values)
        yield _done(n)

    return publish


RAW = {"sqlite": raw_sqlite, "rabbitmq": raw_rabbitmq, "kafka": raw_kafka, "sqs": raw_sqs}


# -- driver --------------------------------------------------------------------------------------
def bench(spark: Any, kind: str, url: str, rows: int) -> dict[str, float]:
    from pyspark.sql import functions as F

    tag = uuid.uuid4().hex[:8]
    group = f"bench-{tag}"
    df = spark.range(0, rows, numPartitions=2).select(
        F.concat(F.lit("message-"), F.col("id").cast("string"), F.lit("-"),
                 F.repeat(F.lit("x"), 100)).alias("value"),
        (F.col("id") % 1000).cast("string").alias("key"),
    ).cache()
    df.count()
    with mqabstract.connect(url) as mq:
        mq.declare(group, "bench.#")  # so sink messages are stored, like the raw ones
    raw = RAW[kind](url, group)

    def run_sink() -> None:
        df.write.format("mqabstract").option("url", url).option("topic", "bench.sink") \
            .mode("append").save()

    def run_raw() -> None:
        total = df.mapInArrow(raw, "n long").agg(F.sum("n")).collect()[0][0]
        assert total == rows, total

    out: dict[str, float] = {}
    for name, fn in (("raw", run_raw), ("sink", run_sink)):
        start = time.perf_counter()
        fn()
        out[name] = rows / (time.perf_counter() - start)
    with mqabstract.connect(url) as mq:
        stats = mq.stats(group)
        out["stored"] = float(stats.ready) if stats.ready is not None else float("nan")
        with contextlib.suppress(MQError):
            mq.delete_group(group)
    df.unpersist()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="sqlite,rabbitmq,kafka,sqs")
    parser.add_argument("--rows", type=int, help="rows per backend (default: per backend)")
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    from mqabstract.spark_sink import register

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mqabstract-bench-") as workdir:
        # resolved before the session starts: executors inherit the environment at launch
        urls = {kind: broker_url(kind, workdir) for kind in args.backends.split(",")}
        spark = (SparkSession.builder.master("local[2]").appName("mqabstract-bench")
                 .config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        # warm up the Python workers and Arrow paths once, outside any timing
        warm = f"sqlite:///{workdir}/warm.db"
        spark.range(1000).selectExpr("cast(id as string) as value").write.format("mqabstract") \
            .option("url", warm).option("topic", "warm").mode("append").save()
        for kind, url in urls.items():
            if url is None:
                continue
            rows = args.rows or DEFAULT_ROWS[kind]
            r = bench(spark, kind, url, rows)
            results[kind] = {"rows": rows, **r}
            print(f"{kind:<9} rows={rows:>8,}  sink {r['sink']:>9,.0f} rows/s   raw "
                  f"{r['raw']:>9,.0f} rows/s   sink/raw {r['sink'] / r['raw']:.2f}x", flush=True)
    spark.stop()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
