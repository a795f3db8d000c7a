"""The Spark sink on ``local[2]``: batch and streaming writes through every available backend.

What is checked: the delivered count equals the row count, bodies / keys / headers / topics
arrive intact, ids are the documented deterministic ones, a task retried after a failure
re-publishes only under identical ids, and bad columns or options fail before anything is
published. sqlite always runs; RabbitMQ, Kafka and SQS run when their driver module exists
and ``tests/brokers.py`` finds a broker (in CI a missing broker fails).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

import mqabstract
from mqabstract.errors import InvalidArgument
from mqabstract.spark_sink import check_schema, message_id
from mqabstract.spark_sink.source import _Plan

from ..brokers import resolve_url

SCHEMES = {"rabbitmq": "amqp", "kafka": "kafka", "sqs": "sqs"}
#: Rows per test write; SQS (moto) slows down with queue depth, so it gets fewer.
ROWS = {"sqlite": 2000, "rabbitmq": 2000, "kafka": 2000, "sqs": 300}


@pytest.fixture(params=["sqlite", "rabbitmq", "kafka", "sqs"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(kind, url) of a backend the sink must serve (brokers via tests/brokers.py, which
    fails rather than skips under CI)."""
    kind = request.param
    if kind == "sqlite":
        return kind, f"sqlite:///{tmp_path / 'sink.db'}"
    return kind, resolve_url(kind)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sink.db'}"


@dataclass(frozen=True)
class Got:
    id: str
    topic: str
    body: bytes
    headers: dict[str, str]
    key: str | None
    priority: int


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def tag() -> str:
    return uuid.uuid4().hex[:10]


def declare(url: str, group: str, pattern: str) -> None:
    with mqabstract.connect(url) as mq:
        mq.declare(group, pattern)


def drain(
    url: str, group: str, pattern: str, expected: int, timeout: float = 90.0, keep: bool = False
) -> list[Got]:
    """Receive and ack until ``expected`` messages arrived and one more wait finds nothing;
    then delete the group (tests share real brokers) unless ``keep``."""
    out: list[Got] = []
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe(group, pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msgs = sub.receive(max_messages=500, wait=2.0 if len(out) >= expected else 1.0)
            for m in msgs:
                out.append(Got(m.id, m.topic, m.body, dict(m.headers), m.key, m.priority))
                m.ack()
            if not msgs and len(out) >= expected:
                break
        sub.close()
        if not keep:
            mq.delete_group(group)
    return out


def save(df: Any, url: str, **options: str) -> None:
    """``df.write.format("mqabstract")`` with ``url`` and ``options``, in append mode."""
    writer = df.write.format("mqabstract").option("url", url).mode("append")
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.save()


def user_headers(h: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in h.items() if k != "content-type"}


# -- no JVM needed -----------------------------------------------------------------------------
def test_schema_accepts_kafka_like_columns() -> None:
    schema = StructType([
        StructField("value", StringType()),
        StructField("key", BinaryType()),
        StructField("headers", ArrayType(StructType([
            StructField("key", StringType()), StructField("value", BinaryType()),
        ]))),
        StructField("topic", StringType()),
        StructField("priority", IntegerType()),
        StructField("delay", LongType()),
    ])
    assert check_schema(schema, None) == {
        "value": "str", "key": "binary", "headers": "pairs", "topic": "topic",
        "priority": "int", "delay": "float",
    }


@pytest.mark.parametrize(
    ("fields", "topic", "column"),
    [
        ([("value", StringType()), ("extra", StringType())], "t", "extra"),
        ([("key", StringType())], "t", "value"),
        ([("value", LongType())], "t", "value"),
        ([("value", StringType()), ("key", LongType())], "t", "key"),
        ([("value", StringType()), ("headers", MapType(StringType(), LongType()))], "t",
         "headers"),
        ([("value", StringType()), ("headers", ArrayType(StringType()))], "t", "headers"),
        ([("value", StringType()), ("priority", StringType())], "t", "priority"),
        ([("value", StringType()), ("delay", StringType())], "t", "delay"),
        ([("value", StringType()), ("topic", BinaryType())], "t", "topic"),
        ([("value", StringType())], None, "topic"),
        ([("value", MapType(LongType(), StringType()))], "t", "value"),
    ],
)
def test_schema_names_the_bad_column(fields: list[Any], topic: str | None, column: str) -> None:
    schema = StructType([StructField(n, t) for n, t in fields])
    with pytest.raises(InvalidArgument, match=f"column '{column}'"):
        check_schema(schema, topic)


def test_arrow_rows_become_messages_with_json_and_ids() -> None:
    import pyarrow as pa

    rb = pa.RecordBatch.from_pydict({
        "value": pa.array(
            [{"n": 1, "m": [("a", 1.5)]}, {"n": 2, "m": []}],
            pa.struct([("n", pa.int64()), ("m", pa.map_(pa.string(), pa.float64()))]),
        ),
        "headers": pa.array([[("h", "x")], None], pa.map_(pa.string(), pa.string())),
        "key": pa.array([b"k1", None], pa.binary()),
    })
    plan = _Plan("sqlite:///unused.db", "t.x", {"value": "json", "headers": "map",
                                                 "key": "binary"}, 10)
    [call] = plan.calls(rb, "job.0.3.", 7)
    assert call.ids == ["job.0.3.7", "job.0.3.8"] and call.topic == "t.x"
    assert [json.loads(b) for b in call.bodies] == [{"n": 1, "m": {"a": 1.5}}, {"n": 2, "m": {}}]
    assert call.headers == {"content-type": "application/json"}
    assert call.row_headers == [{"h": "x"}, None]
    assert call.keys == ["k1", None]
    split = _Plan("sqlite:///unused.db", None, {"value": "bytes", "topic": "topic"}, 10).calls(
        pa.RecordBatch.from_pydict({"value": [b"a", b"b", b"c"], "topic": ["t.1", "t.2", "t.1"]}),
        "j.0.0.", 0)
    assert [(c.topic, c.ids, c.bodies) for c in split] == [
        ("t.1", ["j.0.0.0", "j.0.0.2"], [b"a", b"c"]), ("t.2", ["j.0.0.1"], [b"b"])]
    assert message_id("job", 0, 3, 7) == "job.0.3.7"


# -- batch -------------------------------------------------------------------------------------
def test_batch_write_delivers_every_row_intact(spark: Any, backend: tuple[str, str]) -> None:
    kind, url = backend
    n, t = ROWS[kind], tag()
    group, pattern = f"sink-{t}", f"sink.{t}.#"
    declare(url, group, pattern)
    df = spark.range(0, n, numPartitions=2).select(
        F.concat(F.lit("body-"), F.col("id").cast("string"), F.lit("-é")).alias("value"),
        F.concat(F.lit("k"), (F.col("id") % 7).cast("string")).alias("key"),
        F.create_map(F.lit("row"), F.col("id").cast("string"), F.lit("src"), F.lit("spark"))
        .alias("headers"),
        F.when(F.col("id") % 2 == 0, F.lit(f"sink.{t}.even"))
        .otherwise(F.lit(f"sink.{t}.odd")).alias("topic"),
    )
    started = time.monotonic()
    save(df, url, traceparent=TRACEPARENT, tracestate="mq=1")
    assert time.monotonic() - started < 120
    got = drain(url, group, pattern, n)
    assert len(got) == n
    ids = [g.id for g in got]
    assert len(set(ids)) == n
    job = {i.split(".")[0] for i in ids}
    assert len(job) == 1  # one save() → one id prefix
    for g in got:
        row = int(g.headers["row"])
        assert g.body == f"body-{row}-é".encode()
        assert g.key == f"k{row % 7}"
        assert user_headers(g.headers) == {"row": str(row), "src": "spark",
                                           "traceparent": TRACEPARENT, "tracestate": "mq=1"}
        assert g.topic == f"sink.{t}.{'even' if row % 2 == 0 else 'odd'}"
        assert g.id.split(".")[1] == "0"  # batch writes are batch 0


def test_json_binary_values_and_header_pairs(spark: Any, sqlite_url: str) -> None:
    t = tag()
    group, topic = f"sink-{t}", f"sink.{t}"
    declare(sqlite_url, group, topic)
    df = spark.range(0, 50, numPartitions=2).select(
        F.struct(F.col("id"), F.array(F.lit("a"), F.lit("b")).alias("tags"),
                 F.create_map(F.lit("x"), F.col("id")).alias("m")).alias("value"),
        F.array(F.struct(F.lit("trace").alias("key"),
                         F.col("id").cast("string").cast("binary").alias("value"))).alias("headers"),
    )
    save(df, sqlite_url, topic=topic)
    got = drain(sqlite_url, group, topic, 50, keep=True)
    assert len(got) == 50
    for g in got:
        doc = json.loads(g.body)
        assert doc == {"id": doc["id"], "tags": ["a", "b"], "m": {"x": doc["id"]}}
        assert g.headers == {"content-type": "application/json", "trace": str(doc["id"])}

    raw = spark.range(0, 20, numPartitions=1).select(
        F.unhex(F.lit("00FF10")).alias("value"), F.lit(None).cast("string").alias("key"),
        (F.col("id") % 10).cast("int").alias("priority"),
    )
    save(raw, sqlite_url, topic=topic)
    got = drain(sqlite_url, group, topic, 20)
    assert len(got) == 20
    assert {g.body for g in got} == {b"\x00\xff\x10"}
    assert all(g.key is None and "content-type" not in g.headers for g in got)
    assert [g.priority for g in got[:2]] == [9, 9]  # priority honoured by the group


def test_delay_column_holds_messages_back(spark: Any, sqlite_url: str) -> None:
    t = tag()
    group, topic = f"sink-{t}", f"sink.{t}"
    declare(sqlite_url, group, topic)
    df = spark.range(0, 10, numPartitions=1).select(
        F.col("id").cast("string").alias("value"),
        F.when(F.col("id") < 5, F.lit(None)).otherwise(F.lit(30.0)).alias("delay"),
    )
    save(df, sqlite_url, topic=topic)
    with mqabstract.connect(sqlite_url) as mq:
        stats = mq.stats(group)
    assert (stats.ready, stats.delayed) == (5, 5)


def test_ttl_column_expires_messages_into_dead_letters(spark: Any, sqlite_url: str) -> None:
    t = tag()
    group, topic = f"sink-{t}", f"sink.{t}"
    declare(sqlite_url, group, topic)
    df = spark.range(0, 6, numPartitions=1).select(
        F.col("id").cast("string").alias("value"),
        F.when(F.col("id") < 3, F.lit(None)).otherwise(F.lit(0.2)).alias("ttl"),
    )
    save(df, sqlite_url, topic=topic)
    time.sleep(0.5)
    with mqabstract.connect(sqlite_url) as mq:
        sub = mq.subscribe(group, topic)
        got = sorted(m.body for m in sub.receive(10, 1.0))
        dead = mq.dead_letters(group)
    assert got == [b"0", b"1", b"2"]
    assert sorted((d.body, d.reason) for d in dead) == [(b"3", "expired"), (b"4", "expired"),
                                                        (b"5", "expired")]


def test_task_retry_republishes_under_identical_ids(spark: Any, sqlite_url: str) -> None:
    """Partition 0's first attempt publishes a few chunks, then dies; Spark retries it."""
    from pyspark import TaskContext

    t = tag()
    group, topic = f"sink-{t}", f"sink.{t}"
    declare(sqlite_url, group, topic)
    n = 2000

    def flaky(batches: Any) -> Any:
        ctx = TaskContext.get()
        for i, batch in enumerate(batches):
            yield batch
            if ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and i == 4:
                time.sleep(1.5)  # let the sink publish (and confirm) what it already has
                raise RuntimeError("injected failure on the first attempt")

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        (
            spark.range(0, n, numPartitions=2)
            # ~200 KB per Arrow batch: more than Spark's 64 KB socket buffers, so batches
            # flow to the sink one by one instead of sitting in a buffer when the task dies
            .select(F.concat(F.col("id").cast("string"), F.lit("-"), F.repeat(F.lit("x"), 2000))
                    .alias("value"))
            .mapInArrow(flaky, "value string")
            .write.format("mqabstract").option("url", sqlite_url).option("topic", topic)
            .option("batch_size", "100").mode("append").save()
        )
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = drain(sqlite_url, group, topic, n)
    counts = Counter(g.id for g in got)
    assert len(counts) == n  # every row delivered
    assert len(got) > n, "the failed attempt should have published something before dying"
    bodies: dict[str, set[bytes]] = defaultdict(set)
    for g in got:
        bodies[g.id].add(g.body)
    assert all(len(b) == 1 for b in bodies.values())  # duplicates are identical
    assert max(counts.values()) == 2
    dup_partitions = {i.split(".")[2] for i, c in counts.items() if c > 1}
    assert dup_partitions == {"0"}


# -- fail fast ---------------------------------------------------------------------------------
BAD_WRITES = {
    "unknown column": (lambda df: df.withColumn("extra", F.lit(1)), {}, "column 'extra'"),
    "no value": (lambda df: df.withColumnRenamed("value", "body"), {}, "column 'body'"),
    "numeric value": (lambda df: df.withColumn("value", F.col("id")), {}, "column 'value'"),
    "bad headers": (lambda df: df.withColumn("headers", F.lit("x")), {}, "column 'headers'"),
    "bad priority": (lambda df: df.withColumn("priority", F.lit("high")), {},
                     "column 'priority'"),
    "no topic": (lambda df: df, {"topic": None}, "column 'topic'"),
    "unknown option": (lambda df: df, {"topci": "x"}, "unknown option"),
    "memory url": (lambda df: df, {"url": "memory://"}, "cannot be reached from Spark"),
    "bad traceparent": (lambda df: df, {"traceparent": "00-abc-def-01"}, "W3C traceparent"),
    "zero trace id": (lambda df: df, {"traceparent": f"00-{'0' * 32}-{'1' * 16}-01"},
                      "W3C traceparent"),
}


@pytest.mark.parametrize("case", list(BAD_WRITES))
def test_bad_columns_and_options_fail_before_any_publish(
    spark: Any, sqlite_url: str, case: str
) -> None:
    t = tag()
    group, topic = f"sink-{t}", f"sink.{t}"
    declare(sqlite_url, group, topic)
    change, options, message = BAD_WRITES[case]
    df = change(spark.range(0, 10).select("id", F.col("id").cast("string").alias("value")))
    df = df.drop("id")
    opts = {"url": sqlite_url, "topic": topic, **options}
    writer = df.write.format("mqabstract").mode("append")
    for k, v in opts.items():
        if v is not None:
            writer = writer.option(k, v)
    with pytest.raises(Exception, match=message):
        writer.save()
    with mqabstract.connect(sqlite_url) as mq:
        assert mq.stats(group).ready == 0


def test_overwrite_mode_is_refused(spark: Any, sqlite_url: str) -> None:
    df = spark.range(3).select(F.col("id").cast("string").alias("value"))
    with pytest.raises(Exception, match="overwrite"):
        df.write.format("mqabstract").option("url", sqlite_url).option("topic", "t") \
            .mode("overwrite").save()


def test_null_value_fails_the_task_naming_column_and_row(spark: Any, sqlite_url: str) -> None:
    df = spark.range(3, numPartitions=1).select(
        F.when(F.col("id") == 1, F.lit(None)).otherwise(F.lit("x")).alias("value"))
    with pytest.raises(Exception, match=r"column 'value': null in row \w+\.0\.0\.1"):
        save(df, sqlite_url, topic="t")


# -- streaming ---------------------------------------------------------------------------------
def test_streaming_write_delivers_every_row_with_query_ids(
    spark: Any, backend: tuple[str, str], tmp_path: Path
) -> None:
    kind, url = backend
    n, t = ROWS[kind] // 2, tag()
    group, pattern = f"sink-{t}", f"sink.{t}.#"
    declare(url, group, pattern)
    src = tmp_path / "in"
    for part in range(2):  # two files → two micro-batches with maxFilesPerTrigger=1
        spark.range(part * n, (part + 1) * n).coalesce(1).write.mode("append").parquet(str(src))
    stream = (
        spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).parquet(str(src))
        .select(
            F.col("id").cast("string").alias("value"),
            F.col("id").cast("string").alias("key"),
            F.create_map(F.lit("row"), F.col("id").cast("string")).alias("headers"),
        )
    )
    query = (
        stream.writeStream.format("mqabstract").option("url", url)
        .option("topic", f"sink.{t}.stream")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True).start()
    )
    assert query.awaitTermination(180)
    assert query.exception() is None
    got = drain(url, group, pattern, 2 * n)
    assert len(got) == 2 * n
    assert len({g.id for g in got}) == 2 * n
    assert {g.id.split(".")[0] for g in got} == {str(query.id)}
    assert {g.id.split(".")[1] for g in got} == {"0", "1"}
    for g in got:
        assert g.body.decode() == g.key == user_headers(g.headers)["row"]


def test_streaming_restart_resends_only_the_uncommitted_batch_with_its_ids(
    spark: Any, sqlite_url: str, tmp_path: Path
) -> None:
    """A query that stops after its sink wrote a micro-batch but before Spark committed it
    (here: the batch's commit-log entry removed) writes that batch again on restart from
    its checkpoint, under the same ids, and nothing else."""
    n, t = 500, tag()
    group, pattern = f"sink-{t}", f"sink.{t}.#"
    declare(sqlite_url, group, pattern)
    src, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    for part in range(2):  # two files → micro-batches 0 and 1 with maxFilesPerTrigger=1
        spark.range(part * n, (part + 1) * n).coalesce(1).write.mode("append").parquet(str(src))

    def run() -> str:
        stream = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1) \
            .parquet(str(src)).select(F.col("id").cast("string").alias("value"))
        query = (stream.writeStream.format("mqabstract").option("url", sqlite_url)
                 .option("topic", f"sink.{t}.stream")
                 .option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        assert query.awaitTermination(180)
        assert query.exception() is None
        return str(query.id)

    first = run()
    for name in ("1", ".1.crc"):  # batch 1 written by the sink, not committed
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    assert run() == first  # the same query, restarted from its checkpoint
    got = drain(sqlite_url, group, pattern, 3 * n)
    copies = Counter(g.id for g in got)
    batch_of = {g.id: g.id.split(".")[1] for g in got}
    assert len(got) == 3 * n, len(got)
    assert {mid for mid, c in copies.items() if c == 2} == {
        mid for mid, b in batch_of.items() if b == "1"}
    assert sorted(Counter(batch_of.values()).items()) == [("0", n), ("1", n)]
    bodies = defaultdict(set)
    for g in got:
        bodies[g.id].add(g.body)
    assert all(len(b) == 1 for b in bodies.values())  # a re-sent id carries the same row


def test_consumers_of_sink_rows_continue_the_writers_trace(spark: Any, sqlite_url: str) -> None:
    """The ``traceparent`` option: a consumer with the OpenTelemetry middleware processes
    each row in a span of the trace the Spark job ran in."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mqabstract.otel import OpenTelemetry

    t = tag()
    group, topic = f"sink-{t}", f"sink.{t}"
    declare(sqlite_url, group, topic)
    save(spark.range(0, 20, numPartitions=2).select(F.col("id").cast("string").alias("value")),
         sqlite_url, topic=topic, traceparent=TRACEPARENT)
    spans = InMemorySpanExporter()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(spans))
    otel = OpenTelemetry(tracer_provider=tracing, gauges=False)
    with mqabstract.connect(sqlite_url, middleware=[otel]) as mq:
        stats = mq.subscribe(group, topic).consume(lambda m: None, max_messages=20,
                                                   idle_timeout=5)
    assert stats.acked == 20
    process = [s for s in spans.get_finished_spans() if s.name.startswith("process ")]
    assert len(process) == 20
    assert {format(s.context.trace_id, "032x") for s in process} == {TRACE_ID}
