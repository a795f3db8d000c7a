"""Spark sink throughput per backend, next to a hand-written ``mapInArrow`` publisher.

    .venv/bin/python bench/bench_spark.py [--backends sqlite,rabbitmq,kafka,sqs] [--rows N]

For each backend that is available (driver module present, broker answering: the URL in
``MQ_TEST_<KIND>_URL`` or the local default from ``scripts/brokers``), one ``local[2]``
session writes the same cached DataFrame (``value`` string of ~110 bytes, ``key``):

* **sink**: ``df.write.format("mqabstract")`` into a declared group;
* **raw**: ``df.mapInArrow(publisher)`` where the publisher uses the native client the way a
  careful hand-written job would, with the same durability: sqlite3 ``executemany`` into the
  backend's own table (one transaction per Arrow batch), pika with publisher confirms,
  confluent-kafka (librdkafka) ``produce`` per row with ``acks=all`` + idempotence, an id
  header, linger 5 ms and a final ``flush()`` checked for delivery errors, boto3
  ``send_message_batch`` of 10;
* **stream**: the same rows as four parquet files, read by a Structured Streaming query
  (``maxFilesPerTrigger`` 1, ``availableNow``: four micro-batches, reading parquet
  included) into ``writeStream.format("mqabstract")``;
* **spark-kafka** (Kafka only): Spark's own Kafka sink (``spark-sql-kafka-0-10`` from Maven
  Central, see ``scripts/spark-kafka/pom.xml``) with ``kafka.acks=all``,
  ``kafka.enable.idempotence=true``, ``kafka.linger.ms=5``, other settings its defaults.

Every run counts what arrived (the group's stored messages; for the plain Kafka topics the
sum of their end offsets) and prints rows/s with the sink/raw and sink/spark-kafka ratios.
Numbers, not assertions.
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
DEFAULT_ROWS = {"sqlite": 1_000_000, "rabbitmq": 20_000, "kafka": 1_000_000, "sqs": 3_000}

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
    port = brokerctl.default_port(kind)
    url = explicit or (str(brokerctl.broker_url(kind, port))
                       if brokerctl.ready(kind, port) else "")
    if kind == "sqs" and "endpoint_url=http://127.0.0.1" in url:
        # the local moto server takes any credentials; AWS would not
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    if url:
        return url
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


def kafka_servers(url: str) -> str:
    return ",".join(f"{h}:{p or 9092}" for h, p in BrokerURL.parse(url).hosts)


def kafka_topic(url: str, name: str) -> str:
    """A fresh two-partition topic (replication as the broker's default)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_servers(url)})
    for future in admin.create_topics([NewTopic(name, 2)]).values():
        future.result(30)
    return name


def kafka_count(url: str, topic: str) -> int:
    """Records in ``topic``: the sum of its partitions' end offsets."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": kafka_servers(url), "group.id": "bench-count"})
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                   for p in parts)
    finally:
        consumer.close()


def raw_kafka(url: str, group: str) -> Publisher:
    servers = kafka_servers(url)
    topic = kafka_topic(url, f"bench-raw-{group}")

    def publish(batches: Iterator[Any]) -> Iterator[Any]:
        from confluent_kafka import Producer
        from pyspark import TaskContext

        errors: list[Any] = []

        def report(err: Any, _msg: Any) -> None:
            errors.append(err)

        producer = Producer({"bootstrap.servers": servers, "acks": "all",
                             "enable.idempotence": True, "linger.ms": 5,
                             "delivery.report.only.error": True, "on_delivery": report})
        part = TaskContext.get().partitionId()
        produce, n = producer.produce, 0
        for rb in batches:
            values = rb.column("value").to_pylist()
            keys = rb.column("key").to_pylist()
            for v, k in zip(values, keys, strict=True):
                while True:
                    try:
                        produce(topic, v, k, headers=[("id", f"raw.{part}.{n}")])
                        break
                    except BufferError:  # librdkafka's queue is full: let it send some
                        producer.poll(0.05)
                n += 1
        if producer.flush(120) or errors:  # every record acknowledged by all replicas
            raise RuntimeError(f"raw kafka: undelivered records {errors[:1]}")
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
def bench(spark: Any, kind: str, url: str, rows: int, workdir: str) -> dict[str, float]:
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

    sink_topic = f"bench.sink.{tag}"
    # The same rows as parquet files for the streaming run: four micro-batches.
    files = f"{workdir}/stream-{tag}"
    df.repartition(4).write.parquet(files)

    def run_sink() -> None:
        df.write.format("mqabstract").option("url", url).option("topic", sink_topic) \
            .mode("append").save()

    def run_raw() -> None:
        total = df.mapInArrow(raw, "n long").agg(F.sum("n")).collect()[0][0]
        assert total == rows, total

    spark_topic = ""

    def run_spark_kafka() -> None:
        (df.write.format("kafka").option("kafka.bootstrap.servers", kafka_servers(url))
         .option("topic", spark_topic).option("kafka.acks", "all")
         .option("kafka.enable.idempotence", "true").option("kafka.linger.ms", "5")
         .mode("append").save())

    def run_stream() -> None:
        query = (spark.readStream.schema(df.schema).option("maxFilesPerTrigger", 1)
                 .parquet(files).writeStream.format("mqabstract").option("url", url)
                 .option("topic", f"bench.stream.{tag}")
                 .option("checkpointLocation", f"{workdir}/checkpoint-{tag}")
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        if query.exception() is not None:
            raise RuntimeError(f"streaming run failed: {query.exception()}")

    runs: list[tuple[str, Callable[[], None]]] = [("raw", run_raw), ("sink", run_sink),
                                                  ("stream", run_stream)]
    if kind == "kafka":
        spark_topic = kafka_topic(url, f"bench-spark-{group}")
        runs.append(("spark-kafka", run_spark_kafka))
    out: dict[str, float] = {}
    for name, fn in runs:
        start = time.perf_counter()
        fn()
        out[name] = rows / (time.perf_counter() - start)
    with mqabstract.connect(url) as mq:
        stats = mq.stats(group)
        out["stored"] = float(stats.ready) if stats.ready is not None else float("nan")
        with contextlib.suppress(MQError):
            mq.delete_group(group)
    if kind == "kafka":  # the group's stats count no backlog on Kafka: count the topics
        from mqabstract.backends.kafka import kafka_topic_name

        out["stored"] = float(kafka_count(url, kafka_topic_name(sink_topic)))
        out["stream stored"] = float(
            kafka_count(url, kafka_topic_name(f"bench.stream.{tag}")))
        out["raw stored"] = float(kafka_count(url, f"bench-raw-{group}"))
        out["spark-kafka stored"] = float(kafka_count(url, spark_topic))
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
        builder = SparkSession.builder
        if urls.get("kafka"):  # Spark's own Kafka sink, from Maven Central
            jars = brokerctl.spark_kafka_jars()
            builder = builder.config("spark.jars", ",".join(str(j) for j in jars))
            print(f"spark-kafka jars: {', '.join(j.name for j in jars)}")
        import pyspark

        print(f"pyspark {pyspark.__version__}, local[2]")
        spark = (builder.master("local[2]").appName("mqabstract-bench")
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
            r = bench(spark, kind, url, rows, workdir)
            results[kind] = {"rows": rows, **r}
            line = (f"{kind:<9} rows={rows:>9,}  sink {r['sink']:>9,.0f} rows/s   raw "
                    f"{r['raw']:>9,.0f} rows/s   sink/raw {r['sink'] / r['raw']:.2f}x   "
                    f"streaming sink {r['stream']:>9,.0f} rows/s "
                    f"({r['stream'] / r['sink']:.2f}x the batch sink)")
            if "spark-kafka" in r:
                line += (f"   spark-kafka {r['spark-kafka']:>9,.0f} rows/s   "
                         f"sink/spark-kafka {r['sink'] / r['spark-kafka']:.2f}x")
            stored = {k: int(v) for k, v in r.items() if k.endswith("stored") and v == v}
            print(f"{line}\n{'':<9} arrived: {stored}", flush=True)
    spark.stop()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
