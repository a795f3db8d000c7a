"""The ``mqabstract`` PySpark data source: DataFrames published through any shared backend.

Batch (``df.write.format("mqabstract")``) and Structured Streaming
(``df.writeStream.format("mqabstract")``) both go through Arrow writers, so a task sees
column batches and turns each into ``Broker.publish_columns`` calls (values, keys and
headers converted per column) without per-row Spark ``Row`` objects. Everything that can
be checked without data — options, column names and types, the backend's reach and
capabilities — is checked on the driver in ``writer()`` / ``streamWriter()``, so a bad
job fails before any message is sent.

Delivery is at-least-once: a task returns its commit message only after the broker has
confirmed every message it published, and a retried task or replayed micro-batch publishes
again under the same deterministic ids, so consumers can drop duplicates by ``Message.id``.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import logging
import os
import queue
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as _field
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
)

import mqabstract
from mqabstract import codec, names
from mqabstract.capabilities import Feature
from mqabstract.errors import InvalidArgument, MQError, ValidationError
from mqabstract.model import OutgoingMessage
from mqabstract.url import BrokerURL

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = ["SHORT_NAME", "MQDataSource", "SinkCommit", "message_id", "register"]

log = logging.getLogger("mqabstract.spark_sink")

SHORT_NAME = "mqabstract"
DEFAULT_BATCH_SIZE = 5000

#: Options the sink reads (Spark lower-cases option keys before we see them).
OPTIONS = {
    "url": "broker URL; default $MQ_URL, else the embedded SQLite default (resolved on the "
    "driver so every executor uses the same one)",
    "topic": "topic for every row; overrides a `topic` column",
    "batch_size": f"messages per publish_batch call (default {DEFAULT_BATCH_SIZE})",
    "job_id": "id prefix for batch writes (default: a random UUID per save()); set it to make "
    "a re-run of the same job produce the same ids",
    "traceparent": "W3C trace context added to every row's headers (a row's own header "
    "wins), so consumers continue this trace; e.g. from mqabstract.otel.trace_headers()",
    "tracestate": "W3C tracestate sent with `traceparent`",
}
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
#: Keys Spark itself may pass along; accepted and ignored.
_SPARK_OPTIONS = frozenset({"path", "checkpointlocation", "queryname"})

_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
_NUMERIC = (*_INTEGRAL, FloatType, DoubleType, DecimalType)
_TEXT = (StringType, BinaryType)


# -- schema ----------------------------------------------------------------------------------
def _fail(column: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"mqabstract sink: column {column!r}: {why}")


def _check_headers_type(t: DataType) -> None:
    if isinstance(t, MapType):
        if not isinstance(t.keyType, StringType) or not isinstance(t.valueType, _TEXT):
            raise _fail(
                "headers", f"a map must be map<string,string|binary>, got {t.simpleString()}"
            )
        return
    if isinstance(t, ArrayType) and isinstance(t.elementType, StructType):
        fields = {f.name: f.dataType for f in t.elementType.fields}
        if (
            set(fields) == {"key", "value"}
            and isinstance(fields["key"], StringType)
            and isinstance(fields["value"], _TEXT)
        ):
            return
    raise _fail(
        "headers",
        "must be map<string,string> or array<struct<key:string,value:string|binary>>, "
        f"got {t.simpleString()}",
    )


def check_schema(schema: StructType, topic_option: str | None) -> dict[str, str]:
    """Validate the DataFrame's columns; return ``{column: kind}`` for the writers.

    Raises ``InvalidArgument`` naming the first unknown, missing or wrongly typed column.
    """
    kinds: dict[str, str] = {}
    for field in schema.fields:
        name, t = field.name, field.dataType
        if name == "value":
            if isinstance(t, StringType):
                kinds[name] = "str"
            elif isinstance(t, BinaryType):
                kinds[name] = "bytes"
            elif isinstance(t, (StructType, MapType, ArrayType)):
                if isinstance(t, MapType) and not isinstance(t.keyType, StringType):
                    raise _fail(name, f"a JSON map needs string keys, got {t.simpleString()}")
                kinds[name] = "json"
            else:
                raise _fail(
                    name,
                    f"must be string, binary, or struct/map/array (sent as JSON), "
                    f"got {t.simpleString()}",
                )
        elif name == "key":
            if not isinstance(t, _TEXT):
                raise _fail(name, f"must be string or binary (UTF-8), got {t.simpleString()}")
            kinds[name] = "str" if isinstance(t, StringType) else "binary"
        elif name == "headers":
            _check_headers_type(t)
            kinds[name] = "map" if isinstance(t, MapType) else "pairs"
        elif name == "topic":
            if not isinstance(t, StringType):
                raise _fail(name, f"must be string, got {t.simpleString()}")
            kinds[name] = "topic"
        elif name == "priority":
            if not isinstance(t, _INTEGRAL):
                raise _fail(name, f"must be an integer type (0-9), got {t.simpleString()}")
            kinds[name] = "int"
        elif name in ("delay", "ttl"):
            if not isinstance(t, _NUMERIC):
                raise _fail(name, f"must be a number of seconds, got {t.simpleString()}")
            kinds[name] = "float"
        else:
            raise _fail(
                name,
                "unknown column; the sink takes value, key, headers, topic, priority, delay, "
                "ttl (select or drop the others)",
            )
    if "value" not in kinds:
        raise _fail("value", "required column is missing")
    if topic_option is None and "topic" not in kinds:
        raise _fail("topic", "missing: give a `topic` column or the `topic` option")
    return kinds


# -- ids ---------------------------------------------------------------------------------------
def message_id(job: str, batch: int, partition: int, row: int) -> str:
    """The deterministic id of one row: ``<job>.<batch>.<partition>.<row>``.

    ``job`` is the streaming query id (stable across restarts from a checkpoint) or, for a
    batch write, the ``job_id`` option or a UUID drawn once per ``save()``. ``row`` counts
    from 0 within the task's partition, so a retried task or replayed micro-batch over the
    same input reproduces the same ids.
    """
    return f"{job}.{batch}.{partition}.{row}"


# -- Arrow → messages ------------------------------------------------------------------------
def _json_default(value: object) -> object:
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _plain(t: pa.DataType) -> Callable[[Any], Any] | None:
    """A converter from ``to_pylist`` output to JSON-ready objects (None: already ready).

    Only maps need it: Arrow gives them as lists of (key, value) pairs, JSON wants objects.
    """
    import pyarrow as pa

    if pa.types.is_map(t):
        conv = _plain(t.item_type)
        if conv is None:
            return lambda v: {str(k): x for k, x in v}
        return lambda v: {str(k): (None if x is None else conv(x)) for k, x in v}
    if pa.types.is_struct(t):
        fields = [(t.field(i).name, _plain(t.field(i).type)) for i in range(t.num_fields)]
        todo = [(n, c) for n, c in fields if c is not None]
        if not todo:
            return None

        def struct(v: dict[str, Any]) -> dict[str, Any]:
            for n, c in todo:
                if v[n] is not None:
                    v[n] = c(v[n])
            return v

        return struct
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        conv = _plain(t.value_type)
        if conv is None:
            return None
        return lambda v: [None if x is None else conv(x) for x in v]
    return None


def _text(value: object, column: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"column {column!r}: binary value is not UTF-8") from exc
    return value  # type: ignore[return-value]


@dataclass
class _Call:
    """One ``publish_columns`` call (or, with priority/delay/ttl columns, one
    ``publish_batch``): the rows of one topic from one Arrow batch."""

    topic: str
    ids: list[str]
    bodies: list[Any]
    keys: list[str | None] | None = None
    headers: dict[str, str] | None = None
    row_headers: list[dict[str, str] | None] | None = None
    priorities: list[int | None] | None = None
    delays: list[float | None] | None = None
    ttls: list[float | None] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def send(self, broker: mqabstract.Broker) -> None:
        if self.priorities is None and self.delays is None and self.ttls is None:
            broker.publish_columns(self.topic, self.bodies, ids=self.ids, keys=self.keys,
                                   headers=self.headers, row_headers=self.row_headers)
            return
        n = len(self.ids)
        none: list[Any] = [None] * n
        keys, rows = self.keys or none, self.row_headers or none
        prios, delays = self.priorities or none, self.delays or none
        ttls = self.ttls or none
        broker.publish_batch([
            OutgoingMessage(self.topic, self.bodies[i],
                            {**(self.headers or {}), **(rows[i] or {})} or None, keys[i],
                            prios[i], delays[i], None, self.ids[i], ttls[i])
            for i in range(n)
        ])

    def pick(self, rows: list[int]) -> _Call:
        """The call for some of these rows (split by topic)."""
        def sub(col: list[Any] | None) -> list[Any] | None:
            return None if col is None else [col[i] for i in rows]

        return _Call(self.topic, [self.ids[i] for i in rows], [self.bodies[i] for i in rows],
                     sub(self.keys), self.headers, sub(self.row_headers),
                     sub(self.priorities), sub(self.delays), sub(self.ttls))


@dataclass(frozen=True)
class _Plan:
    """What a task needs, decided on the driver; pickled into every task."""

    url: str
    topic: str | None
    kinds: Mapping[str, str]
    batch_size: int
    trace: Mapping[str, str] = _field(default_factory=dict)  #: traceparent/tracestate

    def calls(self, rb: pa.RecordBatch, prefix: str, base: int) -> list[_Call]:
        """One Arrow batch as publish calls, column by column; row ``i`` gets id
        ``prefix + str(base + i)``. Values, keys and headers are converted once per column;
        rows are split by topic only when a ``topic`` column holds several."""
        n = rb.num_rows
        ids = [f"{prefix}{r}" for r in range(base, base + n)]
        cols = {name: rb.column(name) for name in self.kinds}
        value_col = cols["value"]
        if value_col.null_count:
            bad = value_col.is_null().to_pylist().index(True)
            raise _fail("value", f"null in row {ids[bad]}; publish an empty string or binary")
        values: list[Any] = value_col.to_pylist()
        shared: dict[str, str] | None = None
        if self.kinds["value"] == "json":
            conv = _plain(value_col.type)
            if conv is not None:
                values = [conv(v) for v in values]
            dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                                     default=_json_default).encode
            values = [dumps(v).encode("utf-8") for v in values]
            shared = {codec.CONTENT_TYPE: codec.JSON}
        if self.trace:
            shared = {**self.trace, **(shared or {})}
        row_headers: list[dict[str, str] | None] | None = None
        if "headers" in cols:
            is_map = self.kinds["headers"] == "map"
            row_headers = []
            for h in cols["headers"].to_pylist():
                merged: dict[str, str] = {}
                if h:
                    for k, v in (h if is_map else ((e["key"], e["value"]) for e in h)):
                        if v is not None:
                            merged[k] = _text(v, "headers")
                row_headers.append(merged or None)
        keys: list[Any] | None = None
        if "key" in cols:
            keys = cols["key"].to_pylist()
            if self.kinds["key"] == "binary":
                keys = [None if k is None else _text(k, "key") for k in keys]
        prios = cols["priority"].to_pylist() if "priority" in cols else None
        delays = None
        if "delay" in cols:
            delays = [None if d is None else float(d) for d in cols["delay"].to_pylist()]
        ttls = None
        if "ttl" in cols:
            ttls = [None if d is None else float(d) for d in cols["ttl"].to_pylist()]
        if self.topic is not None:
            return [_Call(self.topic, ids, values, keys, shared, row_headers, prios, delays,
                          ttls)]
        topics = cols["topic"].to_pylist()
        if cols["topic"].null_count:
            bad = topics.index(None)
            raise _fail("topic", f"null in row {ids[bad]} and no `topic` option is set")
        whole = _Call(topics[0], ids, values, keys, shared, row_headers, prios, delays, ttls)
        if len(set(topics)) == 1:
            return [whole]
        by_topic: dict[str, list[int]] = {}
        for i, t in enumerate(topics):
            by_topic.setdefault(t, []).append(i)
        calls = []
        for t, rows in by_topic.items():
            call = whole.pick(rows)
            call.topic = t
            calls.append(call)
        return calls


# -- the writers -------------------------------------------------------------------------------
@dataclass
class SinkCommit(WriterCommitMessage):
    """What one task reports once the broker confirmed all its messages."""

    partition: int
    attempt: int
    messages: int
    first_id: str | None
    last_id: str | None


def _publish_partition(
    plan: _Plan, batches: Iterator[pa.RecordBatch], job: str, batch_id: int
) -> SinkCommit:
    """Publish a task's rows in ``batch_size`` chunks; return after the last is confirmed.

    A sender thread owns the connection and publishes chunk N while this thread converts
    chunk N+1, so broker round trips overlap with Arrow → message conversion. At most two
    chunks wait in between, which bounds memory.
    """
    from pyspark import TaskContext

    ctx = TaskContext.get()
    partition = ctx.partitionId() if ctx else 0
    attempt = ctx.attemptNumber() if ctx else 0
    prefix = f"{job}.{batch_id}.{partition}."
    chunks: queue.Queue[list[_Call] | None] = queue.Queue(maxsize=2)
    failures: list[BaseException] = []

    def send() -> None:
        try:
            with mqabstract.connect(plan.url) as broker:
                while (chunk := chunks.get()) is not None:
                    for call in chunk:
                        try:
                            call.send(broker)
                        except ValidationError as exc:  # name the row, not the index
                            where = (f"row {call.ids[exc.index]}: "
                                     if exc.index is not None else "")
                            raise type(exc)(f"mqabstract sink: {where}{exc}") from exc
        except BaseException as exc:
            failures.append(exc)
            while chunks.get() is not None:  # unblock the converting thread
                pass

    sender = threading.Thread(target=send, name=f"mqabstract-sink-{partition}", daemon=True)
    sender.start()
    row = 0
    size = plan.batch_size
    try:
        for rb in batches:
            for start in range(0, rb.num_rows, size):
                if failures:
                    break
                piece = rb.slice(start, size)  # zero-copy
                chunks.put(plan.calls(piece, prefix, row))
                row += piece.num_rows
            if failures:
                break
    finally:
        chunks.put(None)
        sender.join()
    if failures:
        raise failures[0]
    first, last = (prefix + "0", prefix + str(row - 1)) if row else (None, None)
    return SinkCommit(partition, attempt, row, first, last)


class MQBatchWriter(DataSourceArrowWriter):
    """``df.write``: one id prefix (job) per ``save()``, drawn on the driver."""

    def __init__(self, plan: _Plan, job: str) -> None:
        self.plan = plan
        self.job = job

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommit:  # type: ignore[override]
        return _publish_partition(self.plan, iterator, self.job, 0)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total = sum(m.messages for m in messages if isinstance(m, SinkCommit))
        log.info("mqabstract sink: job %s published %d messages", self.job, total)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        done = sum(m.messages for m in messages if isinstance(m, SinkCommit))
        log.warning(
            "mqabstract sink: job %s failed; %d messages from finished tasks stay published "
            "(at-least-once: a re-run with the same job_id repeats their ids)", self.job, done,
        )


class MQStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream``: ids from the query id and micro-batch id, read from the task."""

    def __init__(self, plan: _Plan, fallback_job: str) -> None:
        self.plan = plan
        self.fallback_job = fallback_job

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommit:  # type: ignore[override]
        from pyspark import TaskContext

        ctx = TaskContext.get()
        # Structured Streaming sets these local properties on every micro-batch job.
        query = ctx.getLocalProperty("sql.streaming.queryId") if ctx else None
        batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
        return _publish_partition(
            self.plan, iterator, query or self.fallback_job, int(batch) if batch else 0
        )

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        total = sum(m.messages for m in messages if isinstance(m, SinkCommit))
        log.info("mqabstract sink: micro-batch %d published %d messages", batchId, total)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("mqabstract sink: micro-batch %d failed; it will be replayed with the "
                    "same ids", batchId)


class MQDataSource(DataSource):
    """Spark data source ``mqabstract``: write-only, batch and streaming."""

    @classmethod
    def name(cls) -> str:
        return SHORT_NAME

    def _plan(self, schema: StructType, overwrite: bool) -> _Plan:
        opts = {k.lower(): v for k, v in self.options.items()}
        unknown = sorted(set(opts) - set(OPTIONS) - _SPARK_OPTIONS)
        if unknown:
            raise InvalidArgument(
                f"mqabstract sink: unknown option(s) {', '.join(unknown)}; known: "
                f"{', '.join(OPTIONS)} (backend options go in the URL query string)"
            )
        if overwrite:
            raise InvalidArgument(
                "mqabstract sink: save mode 'overwrite' has no meaning for a message broker "
                "(published messages cannot be replaced); use mode('append')"
            )
        topic = opts.get("topic") or None
        if topic is not None:
            names.check_topic(topic)
        kinds = check_schema(schema, topic)
        try:
            batch_size = int(opts.get("batch_size", DEFAULT_BATCH_SIZE))
        except ValueError:
            batch_size = 0
        if batch_size < 1:
            raise InvalidArgument(
                f"mqabstract sink: batch_size must be an int ≥ 1, got {opts['batch_size']!r}"
            )
        url = opts.get("url") or os.environ.get("MQ_URL") or mqabstract.default_url()
        _check_backend(url, kinds)
        return _Plan(url, topic, kinds, batch_size, _trace_headers(opts))

    def writer(self, schema: StructType, overwrite: bool) -> MQBatchWriter:
        plan = self._plan(schema, overwrite)
        job = self.options.get("job_id") or uuid.uuid4().hex
        names.check_id(message_id(job, 0, 0, 0))
        return MQBatchWriter(plan, job)

    def streamWriter(self, schema: StructType, overwrite: bool) -> MQStreamWriter:
        if self.options.get("job_id"):
            raise InvalidArgument(
                "mqabstract sink: job_id is for batch writes; streaming ids use the query id"
            )
        return MQStreamWriter(self._plan(schema, overwrite), uuid.uuid4().hex)


def _trace_headers(opts: Mapping[str, str]) -> dict[str, str]:
    """The ``traceparent``/``tracestate`` options as headers, checked (W3C Trace Context:
    version-trace_id-parent_id-flags, ids not all zero)."""
    parent, state = opts.get("traceparent"), opts.get("tracestate")
    if parent is None:
        if state is not None:
            raise InvalidArgument("mqabstract sink: tracestate needs a traceparent")
        return {}
    match = _TRACEPARENT.fullmatch(parent)
    if match is None or parent.startswith("ff") or not int(match[1], 16) \
            or not int(match[2], 16):
        raise InvalidArgument(
            f"mqabstract sink: traceparent {parent[:80]!r} is not a W3C traceparent "
            "(00-<32 hex trace id>-<16 hex span id>-<2 hex flags>)")
    out = {"traceparent": parent}
    if state is not None:
        names.check_text_value(state, "tracestate")
        if len(state) > 512:
            raise InvalidArgument("mqabstract sink: tracestate is longer than 512 characters")
        out["tracestate"] = state
    return out


def _check_backend(url: str, kinds: Mapping[str, str]) -> None:
    """Open the backend once on the driver: reachable, shared between processes, and able to
    honour the priority/delay columns — or fail now, before any task runs."""
    redacted = BrokerURL.parse(url).redacted()
    try:
        broker = mqabstract.connect(url)
    except MQError as exc:
        raise type(exc)(f"mqabstract sink: cannot open {redacted}: {exc}") from exc
    try:
        caps = broker.capabilities
        if not caps.shared_between_processes:
            raise InvalidArgument(
                f"mqabstract sink: {redacted} ({broker.backend}) lives inside one process and "
                "cannot be reached from Spark executors; use a shared backend such as "
                "sqlite:///path/to/file.db, amqp://, kafka:// or sqs://"
            )
        for column, feature in (("priority", Feature.PRIORITY), ("delay", Feature.DELAY),
                                ("ttl", Feature.TTL)):
            if column in kinds and not caps.supports(feature):
                raise _fail(column, f"{broker.backend} does not support {feature.description}")
    finally:
        broker.close()


def register(spark: SparkSession) -> None:
    """Make ``format("mqabstract")`` available in ``spark`` (once per session)."""
    spark.dataSource.register(MQDataSource)
