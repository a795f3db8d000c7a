"""The client surface (``client.py``) on confluent-kafka (librdkafka).

librdkafka does the protocol work in its own threads (fetching, batching, heartbeats,
reconnects); this module only translates. Its rebalance callbacks run inside ``consume``
on the polling thread. A consumer without a group is not allowed by the Python
binding: readers carry a group id they never join or commit (``READER_GROUP``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from mqabstract import wire
from mqabstract.url import redact

from .client import (
    TP,
    TXN_TIMEOUT_MS,
    Admin,
    Client,
    ClientError,
    Created,
    Fetched,
    Kind,
    Listener,
    Member,
    Mover,
    Outgoing,
    Pending,
    Producer,
    Reader,
    Settings,
)

__all__ = ["CLIENT", "READER_GROUP"]

log = logging.getLogger("mqabstract.kafka")

#: The group id of group-less readers: never joined, never committed (not listed by the
#: broker: a group exists there only once it has members or offsets).
READER_GROUP = "__mqa..reader"

_E = ck.KafkaError
_FENCED = {_E.ILLEGAL_GENERATION, _E.UNKNOWN_MEMBER_ID, _E.REBALANCE_IN_PROGRESS,
           _E.FENCED_INSTANCE_ID, _E._ASSIGNMENT_LOST}
_TOO_LARGE = {_E.MSG_SIZE_TOO_LARGE, _E.RECORD_LIST_TOO_LARGE,
              getattr(_E, "_MSG_SIZE_TOO_LARGE", _E.MSG_SIZE_TOO_LARGE)}
_TIMEOUT = {_E._TIMED_OUT, _E.REQUEST_TIMED_OUT, _E._MSG_TIMED_OUT, _E._TIMED_OUT_QUEUE}
_DOWN = {_E._TRANSPORT, _E._ALL_BROKERS_DOWN, _E._RESOLVE, _E.NOT_COORDINATOR,
         _E.COORDINATOR_NOT_AVAILABLE, _E.COORDINATOR_LOAD_IN_PROGRESS, _E._WAIT_COORD,
         _E.LEADER_NOT_AVAILABLE, _E.NOT_LEADER_FOR_PARTITION, _E.UNKNOWN_TOPIC_OR_PART,
         _E._UNKNOWN_PARTITION, _E.BROKER_NOT_AVAILABLE, _E.NETWORK_EXCEPTION,
         getattr(_E, "_DESTROY", _E._TRANSPORT)}


def _error(err: Any, where: str = "") -> ClientError:
    """A librdkafka ``KafkaError`` as :class:`ClientError`."""
    code = err.code()
    text = redact(f"{where}{err.name()}: {err.str()}")[:1500]
    if code in _FENCED:
        kind = Kind.FENCED
    elif code == _E.OFFSET_METADATA_TOO_LARGE:
        kind = Kind.METADATA_TOO_LARGE
    elif code in _TOO_LARGE:
        kind = Kind.TOO_LARGE
    elif code == _E.INVALID_SESSION_TIMEOUT:
        kind = Kind.BAD_SESSION
    elif code in _TIMEOUT:
        kind = Kind.TIMEOUT
    elif err.fatal():
        kind = Kind.FATAL
    elif err.retriable() or code in _DOWN:
        kind = Kind.TRANSIENT
    else:
        kind = Kind.OTHER
    return ClientError(kind, text, err.name())


def classify(exc: BaseException) -> ClientError:
    """confluent-kafka's exceptions as :class:`ClientError`."""
    if isinstance(exc, ClientError):
        return exc
    if isinstance(exc, ck.KafkaException) and exc.args and isinstance(exc.args[0], _E):
        return _error(exc.args[0])
    if isinstance(exc, BufferError):
        return ClientError(Kind.TRANSIENT, f"producer queue full: {exc}", "BufferError")
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return ClientError(Kind.TRANSIENT, redact(str(exc))[:1500], type(exc).__name__)
    return ClientError(Kind.OTHER, redact(f"{type(exc).__name__}: {exc}")[:1500],
                       type(exc).__name__)


def _config(s: Settings) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "bootstrap.servers": ",".join(s.servers),
        "client.id": s.client_id,
        "socket.timeout.ms": s.request_timeout_ms,
        "socket.nagle.disable": True,  # small requests (commits, single publishes) at once
        "log_level": 3,  # errors only: librdkafka logs reconnects as warnings
    }
    if s.security_protocol:
        cfg["security.protocol"] = s.security_protocol
    if s.sasl_mechanism:
        cfg["sasl.mechanism"] = s.sasl_mechanism
    if s.sasl_username is not None:
        cfg["sasl.username"] = s.sasl_username
        cfg["sasl.password"] = s.sasl_password or ""
    for ours, theirs in (("ssl_cafile", "ssl.ca.location"),
                         ("ssl_certfile", "ssl.certificate.location"),
                         ("ssl_keyfile", "ssl.key.location"),
                         ("ssl_password", "ssl.key.password")):
        if getattr(s, ours):
            cfg[theirs] = getattr(s, ours)
    if not s.ssl_check_hostname:
        cfg["ssl.endpoint.identification.algorithm"] = "none"
    return cfg


def _native(tps: Collection[TP], offset: int = ck.OFFSET_INVALID) -> list[Any]:
    return [ck.TopicPartition(t, p, offset) for t, p in tps]


class _Lane:
    """One librdkafka producer, used by one ``send`` at a time: its ``flush`` then waits
    for that send's records only, so success needs no per-record callback. librdkafka
    reports only failures (``delivery.report.only.error``), to ``failed``."""

    __slots__ = ("failures", "p")

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.failures: list[tuple[Any, Any]] = []
        self.p = ck.Producer({**cfg, "delivery.report.only.error": True,
                              "on_delivery": self.failed})

    def failed(self, err: Any, msg: Any) -> None:
        self.failures.append((err, msg))


def _id_of(headers: Sequence[tuple[str, Any]]) -> bytes | None:
    """A record's ``mq-id`` header value (to place a failure)."""
    for k, v in headers:
        if k == wire.ID:
            return v if isinstance(v, bytes) else str(v).encode()
    return None


class _Producer(Producer):
    """Sends through lanes (``_Lane``): a send takes an idle one or opens another, so
    concurrent sends never wait for each other's records; up to ``_IDLE`` stay open."""

    _IDLE = 4

    def __init__(self, s: Settings) -> None:
        cfg = _config(s)
        cfg.update({
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": s.linger_ms,
            "batch.size": 1_000_000,
            "message.max.bytes": 1_048_576,
            "queue.buffering.max.messages": 200_000,
            "allow.auto.create.topics": False,  # every topic is created explicitly
            "request.timeout.ms": s.request_timeout_ms,
            # A record not acknowledged by then is reported failed (a publish waits twice
            # the request timeout, as on kafka-python).
            "message.timeout.ms": 2 * s.request_timeout_ms,
            "topic.metadata.refresh.interval.ms": 30000,
        })
        self.cfg = cfg
        self.s = s
        self.lock = threading.Lock()
        self.idle: list[_Lane] = []
        self.parts: dict[str, tuple[set[int], float]] = {}
        first = _Lane(cfg)
        self.idle.append(first)
        self.p = first.p  # for metadata
        try:  # librdkafka connects lazily: a bad address fails here, at open
            self.p.list_topics(timeout=s.connect_timeout)
        except Exception as exc:
            raise classify(exc) from exc

    def _take(self) -> _Lane:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return _Lane(self.cfg)

    def _give(self, lane: _Lane, clean: bool) -> None:
        """Back to the idle lanes when nothing of this send is left in it (else closed:
        late reports must not reach the next send)."""
        with self.lock:
            if clean and len(self.idle) < self._IDLE:
                self.idle.append(lane)
                return
        threading.Thread(target=_drop, args=(lane, self.s.request_timeout_ms / 1000),
                         name="mqabstract-kafka-lane-close", daemon=True).start()

    def send(self, records: Sequence[Outgoing], timeout: float) -> list[ClientError | None]:
        deadline = time.monotonic() + timeout
        lane = self._take()
        errors: list[ClientError | None] = [None] * len(records)
        produce: Any = lane.p.produce
        try:
            for i, r in enumerate(records):
                try:
                    if r.partition is None:
                        produce(r.topic, r.value, r.key, headers=r.headers,
                                timestamp=r.timestamp_ms or 0)
                    else:
                        produce(r.topic, r.value, r.key, r.partition, headers=r.headers,
                                timestamp=r.timestamp_ms or 0)
                except Exception as exc:
                    args = (r.topic, r.value, r.key) if r.partition is None else (
                        r.topic, r.value, r.key, r.partition)
                    errors[i] = _again(lane, exc, deadline, partial(
                        produce, *args, headers=r.headers, timestamp=r.timestamp_ms or 0))
        except BaseException:
            self._give(lane, False)  # (records of this send may still report to it)
            raise
        return self._finish(lane, errors, lambda: [_id_of(r.headers) for r in records],
                            deadline, timeout)

    def send_rows(self, topic: str, values: Sequence[bytes], keys: Sequence[bytes | None] | None,
                  ids: Sequence[str], headers: list[tuple[str, bytes]],
                  row_headers: Sequence[list[tuple[str, bytes]] | None] | None,
                  timestamp_ms: int, timeout: float) -> list[ClientError | None]:
        """The column path's loop: one ``produce`` per row and nothing else; each row's
        header list lives only for its call (see ``Producer.send_rows``)."""
        deadline = time.monotonic() + timeout
        lane = self._take()
        n = len(values)
        errors: list[ClientError | None] = [None] * n
        produce: Any = lane.p.produce  # (its stubs want invariant header lists)
        ks = keys if keys is not None else [None] * n
        rows = row_headers if row_headers is not None else [None] * n
        ID = wire.ID
        try:
            for i, (value, key, mid, own) in enumerate(zip(values, ks, ids, rows, strict=True)):
                hdrs = [*headers, *own, (ID, mid)] if own else [*headers, (ID, mid)]
                try:
                    produce(topic, value, key, headers=hdrs, timestamp=timestamp_ms)
                except Exception as exc:
                    errors[i] = _again(lane, exc, deadline, partial(
                        produce, topic, value, key, headers=hdrs, timestamp=timestamp_ms))
        except BaseException:
            self._give(lane, False)
            raise
        return self._finish(lane, errors, lambda: ids, deadline, timeout)

    def _finish(self, lane: _Lane, errors: list[ClientError | None],
                ids: Callable[[], Sequence[Any]], deadline: float, timeout: float
                ) -> list[ClientError | None]:
        """Wait for the lane's records; place the failures librdkafka reported (by their
        ``mq-id`` header) and time out the rest when not all were acknowledged."""
        clean = False
        try:
            left = lane.p.flush(max(0.0, deadline - time.monotonic()))
            clean = left == 0
        finally:
            failures, lane.failures = lane.failures, []
            self._give(lane, clean)
        if failures:
            n = len(errors)
            rows = {(m if isinstance(m, bytes) else str(m).encode()): i
                    for i, m in enumerate(ids())} if n > 1 else {}
            for err, msg in failures:
                mid = dict(msg.headers() or ()).get(wire.ID) if n > 1 else None
                errors[rows.get(mid, 0) if mid is not None else 0] = _error(err)
        if not clean:
            late = ClientError(Kind.TIMEOUT, f"not acknowledged within {timeout:.1f}s")
            errors = [e or late for e in errors]
        return errors

    def partitions(self, topic: str) -> set[int] | None:
        """Cached for 30 s; while a node is away (a metadata request may wait for it) the
        last known answer is kept rather than stalling the caller's thread."""
        cached = self.parts.get(topic)
        if cached is not None and time.monotonic() - cached[1] < 30:
            return cached[0]
        try:
            meta = self.p.list_topics(topic, timeout=min(5.0, self.s.request_timeout_ms / 1000))
        except Exception as exc:
            if cached is not None:
                self.parts[topic] = (cached[0], time.monotonic() - 25)  # again in 5 s
                return cached[0]
            raise classify(exc) from exc
        found = meta.topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            return cached[0] if cached is not None else None
        parts = set(found.partitions)
        self.parts[topic] = (parts, time.monotonic())
        return parts

    def forget(self, topics: Collection[str]) -> None:
        for topic in topics:
            self.parts.pop(topic, None)

    def close(self, timeout: float) -> None:
        with self.lock:
            lanes, self.idle = self.idle, []
        for lane in lanes:
            _drop(lane, timeout)


def _again(lane: _Lane, exc: Exception, deadline: float, produce: Callable[[], None]
           ) -> ClientError | None:
    """A ``produce`` raised: while librdkafka's local queue is full, let it send some and
    try again until ``deadline``; any other error fails the row (returned)."""
    while isinstance(exc, BufferError):
        lane.p.poll(0.05)
        if time.monotonic() >= deadline:
            return ClientError(Kind.TIMEOUT, "producer queue full")
        try:
            produce()
            return None
        except Exception as again:
            exc = again
    return classify(exc)


def _drop(lane: _Lane, timeout: float) -> None:
    try:
        lane.p.flush(timeout)
    except Exception as exc:
        log.debug("kafka: producer flush at close: %s", exc)


def _result(future: Any, timeout: float) -> Any:
    try:
        return future.result(timeout=timeout)
    except ck.KafkaException as exc:
        raise classify(exc) from exc
    except TimeoutError as exc:
        raise ClientError(Kind.TIMEOUT, "admin request not answered") from exc


def _outcomes(futures: Mapping[str, Any], timeout: float, fine: Collection[str] = ()
              ) -> dict[str, ClientError | None]:
    """Each admin future's outcome: None when it succeeded or failed with an error named in
    ``fine`` (e.g. "already exists" for a create)."""
    out: dict[str, ClientError | None] = {}
    for name, future in futures.items():
        try:
            _result(future, timeout)
            out[name] = None
        except ClientError as err:
            out[name] = None if err.native in fine else err
    return out


class _Admin(Admin):
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.timeout = s.request_timeout_ms / 1000
        self.a = AdminClient(_config(s))
        self.lock = threading.Lock()
        self.groups: collections.OrderedDict[str, tuple[Any, threading.Lock]] = (
            collections.OrderedDict())

    def create_topics(self, names: Collection[str], partitions: int, replication: int,
                      configs: Mapping[str, str]) -> dict[str, Created | ClientError]:
        new = [NewTopic(n, num_partitions=partitions, replication_factor=replication,
                        config=dict(configs)) for n in names]
        try:
            futures = self.a.create_topics(new, operation_timeout=self.timeout,
                                           request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[str, Created | ClientError] = {}
        for name, err in _outcomes(futures, self.timeout + 5).items():
            if err is not None and err.retriable:
                raise err  # the driver retries the whole call
            out[name] = (Created.NEW if err is None else Created.EXISTED
                         if err.native == "TOPIC_ALREADY_EXISTS" else err)
        return out

    def cluster_size(self) -> int:
        # DescribeCluster: the brokers without every topic's metadata (a full listing
        # costs ~0.1 s on a broker with hundreds of topics).
        try:
            future = self.a.describe_cluster(request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        return len(_result(future, self.timeout + 5).nodes)

    def replication(self, names: Collection[str]) -> dict[str, int]:
        # DescribeTopics (not a metadata request naming the topic: that may create it).
        try:
            futures = self.a.describe_topics(ck.TopicCollection(list(names)),
                                             request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[str, int] = {}
        for name, future in futures.items():
            try:
                desc = _result(future, self.timeout + 5)
            except ClientError as err:
                if err.native == "UNKNOWN_TOPIC_OR_PART":
                    continue
                raise
            if desc.partitions:
                out[name] = min(len(p.replicas) for p in desc.partitions)
        return out

    def list_topics(self) -> set[str]:
        try:
            return set(self.a.list_topics(timeout=self.timeout).topics)
        except Exception as exc:
            raise classify(exc) from exc

    # Group offsets go through a consumer of the group that never joins it, not through
    # AdminClient: librdkafka 2.16's ListConsumerGroupOffsets crashes the process (SIGSEGV in
    # rd_kafka_cgrp_op, an admin client has no group) when the coordinator answers with an
    # error, as it does while a broker restarts. A consumer's committed()/commit() take the
    # group's own code path; a commit from a non-member is accepted for a group without
    # members (the declaration shadow group).
    def _group_consumer(self, group: str) -> tuple[Any, threading.Lock]:
        with self.lock:
            found = self.groups.get(group)
            if found is None:
                while len(self.groups) >= 16:
                    _, (old, _lock) = self.groups.popitem(last=False)
                    old.close()
                cfg = _config(self.s)
                cfg.update({"group.id": group, "enable.auto.commit": False,
                            "enable.auto.offset.store": False})
                found = self.groups[group] = (ck.Consumer(cfg), threading.Lock())
            else:
                self.groups.move_to_end(group)
            return found

    def group_offsets(self, group: str, tps: Collection[TP]
                      ) -> dict[TP, tuple[int, str] | None]:
        consumer, lock = self._group_consumer(group)
        try:
            with lock:
                found = consumer.committed(_native(tps), timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[TP, tuple[int, str] | None] = {tp: None for tp in tps}
        for item in found:
            if item.error is not None:
                raise _error(item.error, f"{item.topic}[{item.partition}]: ")
            if item.offset >= 0:
                out[TP(item.topic, item.partition)] = (item.offset, item.metadata or "")
        return out

    def set_group_offsets(self, group: str, offsets: Mapping[TP, tuple[int, str]]) -> None:
        consumer, lock = self._group_consumer(group)
        native = [ck.TopicPartition(t, p, o, metadata=m) for (t, p), (o, m) in offsets.items()]
        try:
            with lock:
                done = consumer.commit(offsets=native, asynchronous=False)
        except Exception as exc:
            raise classify(exc) from exc
        for item in done or ():
            if item.error is not None:
                raise _error(item.error)

    def delete_topics(self, names: Collection[str]) -> None:
        try:
            futures = self.a.delete_topics(list(names), operation_timeout=self.timeout,
                                           request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        self._raise_first(_outcomes(futures, self.timeout + 5, ("UNKNOWN_TOPIC_OR_PART",)))

    def delete_groups(self, groups: Collection[str]) -> None:
        try:
            futures = self.a.delete_consumer_groups(list(groups),
                                                    request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        self._raise_first(_outcomes(futures, self.timeout + 5,
                                    ("GROUP_ID_NOT_FOUND", "NON_EMPTY_GROUP")))

    @staticmethod
    def _raise_first(outcomes: Mapping[str, ClientError | None]) -> None:
        for err in outcomes.values():
            if err is not None:
                raise err

    def close(self) -> None:
        # (AdminClient has no close: it is freed with its last reference)
        with self.lock:
            groups = list(self.groups.values())
            self.groups.clear()
        for consumer, lock in groups:
            with lock:
                consumer.close()


class _Record:
    """A fetched record with the attributes ``Fetched`` names."""

    __slots__ = ("headers", "key", "offset", "timestamp", "value")

    def __init__(self, msg: Any) -> None:
        self.offset: int = msg.offset()
        self.key: bytes | None = msg.key()
        self.value: bytes | None = msg.value()
        self.headers: list[tuple[str, bytes | None]] | None = msg.headers()
        self.timestamp: int = msg.timestamp()[1]


class _Reader(Reader):
    watched = True  # a group-less librdkafka consumer once stopped fetching after a restart

    def __init__(self, s: Settings, group: str = READER_GROUP, **extra: Any) -> None:
        cfg = _config(s)
        cfg.update({
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "allow.auto.create.topics": False,
            "enable.partition.eof": False,
            "fetch.wait.max.ms": s.fetch_max_wait_ms,
            "topic.metadata.refresh.interval.ms": 30000,
            # What librdkafka reads ahead while the data thread does not poll (its buffer
            # is full): 64 MiB by default; 16 MiB measured as fast here.
            "queued.max.messages.kbytes": s.prefetch_kbytes,
        })
        cfg.update(extra)
        self.timeout = s.request_timeout_ms / 1000
        self.assigned: set[TP] = set()  # as the caller sees it
        self.live: set[TP] = set()  # assigned in librdkafka: positioned by a seek
        self.next: dict[TP, int] = {}  # offset after the last record returned, per partition
        try:
            self.c = self._make(cfg)
        except Exception as exc:
            raise classify(exc) from exc

    def _make(self, cfg: dict[str, Any]) -> Any:
        return ck.Consumer(cfg)

    def assign(self, tps: Collection[TP]) -> None:
        """New partitions are handed to librdkafka by the ``seek`` that positions them,
        with their offset: nothing is fetched from a wrong place meanwhile."""
        wanted = set(tps)
        gone = self.live - wanted
        try:
            if gone:
                self.c.incremental_unassign(_native(gone))
        except Exception as exc:
            raise classify(exc) from exc
        self.live -= gone
        for tp in self.assigned - wanted:
            self.next.pop(tp, None)
        self.assigned = wanted

    def poll(self, timeout: float, max_records: int) -> dict[TP, list[Fetched]]:
        # librdkafka's batch consume waits for a full batch or the timeout: wait for one
        # record, then take what else is there without waiting.
        try:
            msgs = self.c.consume(1, timeout)
            if msgs and max_records > 1:
                msgs += self.c.consume(max_records - 1, 0)
        except Exception as exc:
            raise classify(exc) from exc
        return self._group(msgs)

    def _group(self, msgs: list[Any]) -> dict[TP, list[Fetched]]:
        out: dict[TP, list[Fetched]] = {}
        last: tuple[str, int] | None = None
        batch: list[Fetched] = []
        record = _Record
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != _E._PARTITION_EOF:
                    failure = _error(err)
                    if not failure.retriable:
                        raise failure
                    log.debug("kafka: fetch: %s", failure)
                continue
            here = (msg.topic(), msg.partition())
            if here != last:  # a fetch returns runs of one partition
                last = here
                tp = TP(*here)
                found = out.get(tp)
                batch = out[tp] = [] if found is None else found
            batch.append(record(msg))
        for tp, batch in out.items():
            self.next[tp] = batch[-1].offset + 1
        return out

    def seek(self, positions: Mapping[TP, int | None]) -> None:
        if not positions:
            return

        def native(tp: TP, offset: int | None) -> Any:
            return ck.TopicPartition(tp[0], tp[1],
                                     ck.OFFSET_BEGINNING if offset is None else offset)

        new = [tp for tp in positions if tp not in self.live]
        try:
            if new:
                self.c.incremental_assign([native(tp, positions[tp]) for tp in new])
                self.live.update(new)
            for tp, offset in positions.items():
                if tp not in new:
                    self.c.seek(native(tp, offset))
        except Exception as exc:
            raise classify(exc) from exc
        for tp, offset in positions.items():
            if offset is None:
                self.next.pop(tp, None)
            else:
                self.next[tp] = offset

    def position(self, tp: TP) -> int:
        if tp in self.next:
            return self.next[tp]
        low, _ = self._watermarks(tp)
        return low

    def _watermarks(self, tp: TP, timeout: float | None = None) -> tuple[int, int]:
        try:
            low, high = self.c.get_watermark_offsets(
                ck.TopicPartition(*tp), timeout=self.timeout if timeout is None else timeout)
        except Exception as exc:
            raise classify(exc) from exc
        return int(low), int(high)

    def end_offsets(self, tps: Collection[TP], timeout: float | None = None
                    ) -> dict[TP, int]:
        return {tp: self._watermarks(tp, timeout)[1] for tp in tps}

    def offsets_for_times(self, tps: Collection[TP], ms: int) -> dict[TP, int | None]:
        try:
            found = self.c.offsets_for_times(_native(tps, ms), timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[TP, int | None] = {tp: None for tp in tps}
        for item in found:
            if item.error is None and item.offset >= 0:
                out[TP(item.topic, item.partition)] = item.offset
        return out

    def close(self) -> None:
        try:
            self.c.close()
        except Exception as exc:
            log.debug("kafka: consumer close: %s", exc)


class _Done(Pending):
    """A commit that has completed (confluent-kafka commits synchronously here)."""

    __slots__ = ("error",)

    def __init__(self, error: ClientError | None) -> None:
        self.error = error

    def wait(self, timeout: float) -> ClientError | None:
        return self.error


#: Longest the group thread's poll yields to queued commits before it consumes anyway.
STEP_ASIDE = 0.25


class _Landing(Pending):
    """A commit queued for the committer thread; ``land`` gives its outcome."""

    __slots__ = ("error", "landed")

    def __init__(self) -> None:
        self.error: ClientError | None = None
        self.landed = threading.Event()

    def land(self, error: ClientError | None) -> None:
        self.error = error
        self.landed.set()

    def wait(self, timeout: float) -> ClientError | None:
        if not self.landed.wait(max(0.0, timeout)):
            return ClientError(Kind.TIMEOUT, f"commit not confirmed within {timeout:.2f}s")
        return self.error


class _Member(_Reader, Member):
    """librdkafka keeps the membership in its own threads; ``consume`` on the group thread
    runs the rebalance callbacks.

    The binding serialises calls on one consumer: a commit from another thread waits until
    the group thread's ``consume`` returns, and a thread that calls ``consume`` back to back
    starves it. So ``poll`` never waits inside ``consume``: it takes what is there and then
    waits outside (5 ms while commits are being made, 50 ms when idle), stepping aside
    while a commit waits (``gate``). Commits are synchronous calls made by one committer
    thread, in order (an asynchronous one's result would arrive in the group thread's
    ``consume``); the committing caller waits on a Pending with its own time limit.
    Records of the retry topic and rebalance callbacks wait at most one such slice.
    """

    def __init__(self, s: Settings, group: str, topic: str, revoked: Listener,
                 assigned: Listener) -> None:
        self.rebalancing = True  # until the first assignment
        self.busy_until = 0.0
        self.gate = threading.Condition()
        self.waiting = 0  # threads waiting to commit
        self.closed = False  # a closed librdkafka consumer must not be called (it crashes)
        self.commits: collections.deque[tuple[Any, Any, _Landing]] = collections.deque()
        self.committer: threading.Thread | None = None
        super().__init__(s, group, **{
            "session.timeout.ms": s.session_timeout_ms,
            "heartbeat.interval.ms": s.heartbeat_interval_ms,
            "max.poll.interval.ms": max(s.max_poll_interval_ms, s.session_timeout_ms),
        })
        self.topic = topic
        self.on_revoked = revoked
        self.on_assigned = assigned
        try:
            self.c.subscribe([topic], on_assign=self._assign, on_revoke=self._revoke,
                             on_lost=self._revoke)
        except Exception as exc:
            self.close()
            raise classify(exc) from exc

    def await_metadata(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                meta = self.c.list_topics(self.topic,
                                          timeout=max(0.1, deadline - time.monotonic()))
                found = meta.topics.get(self.topic)
                if found is not None and found.error is None and found.partitions:
                    return
            except Exception as exc:
                err = classify(exc)
                if not err.retriable:
                    raise err from exc
            if time.monotonic() >= deadline:
                raise ClientError(Kind.TIMEOUT,
                                  f"topic {self.topic} not in the broker's metadata")
            time.sleep(0.05)

    def poll(self, timeout: float, max_records: int) -> dict[TP, list[Fetched]]:
        # Step aside while commits wait, but not for ever: the callbacks of a rejoin run
        # only in this consume. After a broker outage every commit fails with
        # UNKNOWN_MEMBER_ID and receives retry them back to back; waiting for a moment
        # with no commit queued starved the rejoin, and the group never delivered again.
        with self.gate:
            end = time.monotonic() + STEP_ASIDE
            while self.waiting:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.gate.wait(min(0.05, left))
        try:
            msgs = self.c.consume(max_records, 0)
        except Exception as exc:
            raise classify(exc) from exc
        if not msgs:
            slice_ = 0.005 if time.monotonic() < self.busy_until else 0.05
            with self.gate:
                self.gate.wait(min(timeout, slice_))
        return self._group(msgs)

    def _assign(self, consumer: Any, partitions: list[Any]) -> None:
        tps = [TP(p.topic, p.partition) for p in partitions]
        # Nothing is fetched until start() assigns them at their offsets: an empty local
        # assignment now (the binding would otherwise assign them at the committed
        # offsets). Not "at the end, paused": the end-offset query of that assign, answered
        # after start()'s assign, made librdkafka query the end again and fetch from there,
        # skipping the records start() asked for (a retry copy written in between was
        # never delivered: seen in the differential test, with librdkafka's debug log).
        consumer.assign([])
        self.assigned = set(tps)
        self.rebalancing = False
        self.on_assigned(tps)

    def _revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self.rebalancing = True
        self.on_revoked([TP(p.topic, p.partition) for p in partitions])
        consumer.unassign()
        self.assigned = set()

    def start(self, positions: Mapping[TP, int | None]) -> None:
        if not positions:
            return
        try:
            self.c.assign([ck.TopicPartition(t, p, ck.OFFSET_BEGINNING if o is None else o)
                           for (t, p), o in positions.items()])
        except Exception as exc:
            raise classify(exc) from exc
        self.assigned = set(positions)

    def seek(self, positions: Mapping[TP, int | None]) -> None:
        self.start(positions)

    def stable(self) -> bool:
        return not self.rebalancing

    def group_meta(self) -> tuple[object, int | None]:
        with self.gate:
            if self.closed:
                raise ClientError(Kind.FENCED, "the group consumer is closed")
            meta = self.c.consumer_group_metadata()
        return meta, _generation(meta)

    def commit(self, offsets: Mapping[TP, tuple[int, str]],
               done: Callable[[ClientError | None], None]) -> Pending:
        """Queue the commit for the committer thread; its outcome comes as a Pending.

        The binding's commit is synchronous and has no time limit of its own: made by the
        caller, a broker that hangs (seen with ``docker pause``) held ``receive`` for as
        long as it hung, whatever its timeout. One committer thread keeps the commits in
        the order they were made; the caller waits on the Pending as long as it wants.
        """
        self.busy_until = time.monotonic() + 2.0
        native = [ck.TopicPartition(t, p, o, metadata=m) for (t, p), (o, m) in offsets.items()]
        pending = _Landing()
        with self.gate:
            if self.closed:
                failure = ClientError(Kind.FENCED, "the group consumer is closed")
                done(failure)
                return _Done(failure)
            self.waiting += 1
            self.commits.append((native, done, pending))
            if self.committer is None:
                self.committer = threading.Thread(target=self._commit_loop, daemon=True,
                                                  name=f"mq-kafka-commit-{self.topic}")
                self.committer.start()
            self.gate.notify_all()
        return pending

    def _commit_loop(self) -> None:
        while True:
            with self.gate:
                while not self.commits and not self.closed:
                    self.gate.wait(1.0)
                if not self.commits:
                    return  # closed, and nothing left to send
            native, done, pending = self.commits.popleft()
            failure: ClientError | None = None
            try:
                for item in self.c.commit(offsets=native, asynchronous=False) or ():
                    if item.error is not None:
                        failure = _error(item.error, f"{item.topic}[{item.partition}]: ")
                        break
            except Exception as exc:
                failure = classify(exc)
            finally:
                with self.gate:
                    self.waiting -= 1
                    self.gate.notify_all()
            done(failure)
            pending.land(failure)

    def close(self) -> None:
        with self.gate:
            self.closed = True
            while self.waiting:
                self.gate.wait(0.1)
        super().close()


def _generation(meta: object) -> int | None:
    """The generation in librdkafka's serialised group metadata (``CGMDv2:``, then the
    generation as a native int32, the group id and the member id, each NUL-ended);
    -1 when the member id is empty (not a member: the coordinator accepts a transactional
    offset commit without a member id from anyone). None for another format."""
    if not isinstance(meta, bytes) or not meta.startswith(b"CGMDv2:") or len(meta) < 11:
        return None
    generation = int.from_bytes(meta[7:11], sys.byteorder, signed=True)
    names = meta[11:].split(b"\0")
    return generation if len(names) > 2 and names[1] else -1


class _Mover(Mover):
    """A transactional librdkafka producer."""

    def __init__(self, s: Settings, transactional_id: str) -> None:
        cfg = _config(s)
        cfg.update({
            "transactional.id": transactional_id,
            "transaction.timeout.ms": TXN_TIMEOUT_MS,
            # A transaction right after another is answered CONCURRENT_TRANSACTIONS until
            # the broker wrote the last one's markers: ask again soon (100 ms by default
            # made every other nack take 100 ms).
            "retry.backoff.ms": 10,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 0,
            "message.max.bytes": 1_048_576,
            "allow.auto.create.topics": False,
            # (librdkafka: neither may exceed the transaction timeout)
            "socket.timeout.ms": min(s.request_timeout_ms, TXN_TIMEOUT_MS),
            "request.timeout.ms": min(s.request_timeout_ms, TXN_TIMEOUT_MS),
            "message.timeout.ms": min(TXN_TIMEOUT_MS, 2 * s.request_timeout_ms),
        })
        self.cfg = cfg
        self.timeout = s.request_timeout_ms / 1000
        self.p: Any = None
        self._open()

    def _open(self) -> None:
        try:
            p = ck.Producer(self.cfg)
            # Completes (or aborts) what an earlier producer with this id left open.
            p.init_transactions(self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        self.p = p

    def move(self, records: Sequence[Outgoing], offsets: Mapping[TP, tuple[int, str]],
             group_meta: object, timeout: float) -> None:
        if self.p is None:
            self._open()
        p = self.p
        end = time.monotonic() + timeout
        try:
            p.begin_transaction()
            for r in records:
                if r.partition is None:
                    p.produce(r.topic, r.value, r.key, headers=r.headers,
                              timestamp=r.timestamp_ms or 0)
                else:
                    p.produce(r.topic, r.value, r.key, r.partition, headers=r.headers,
                              timestamp=r.timestamp_ms or 0)
            p.send_offsets_to_transaction(
                [ck.TopicPartition(t, n, o, metadata=m) for (t, n), (o, m) in offsets.items()],
                group_meta, max(0.05, end - time.monotonic()))
            p.commit_transaction(max(0.05, end - time.monotonic()))
        except Exception as exc:
            err = classify(exc)
            native = exc.args[0] if isinstance(exc, ck.KafkaException) and exc.args else None
            abortable = native is None or not isinstance(native, _E) or (
                native.txn_requires_abort())
            try:
                if not abortable:  # (a commit that timed out, a fatal error)
                    raise err
                p.abort_transaction(max(0.5, end - time.monotonic()))
            except Exception:
                err.doubt = True
                self._replace()
            raise err from exc

    def _replace(self) -> None:
        """A new producer with the same transactional.id: its init_transactions completes
        or aborts the transaction this one left, so its outcome can be read back."""
        old, self.p = self.p, None
        threading.Thread(target=_drop_producer, args=(old, 1.0), daemon=True,
                         name="mqabstract-kafka-mover-close").start()
        with contextlib.suppress(ClientError):
            self._open()  # (else at the next move)

    def close(self, timeout: float) -> None:
        if self.p is not None:
            _drop_producer(self.p, timeout)
            self.p = None


def _drop_producer(p: Any, timeout: float) -> None:
    try:
        p.flush(timeout)
    except Exception as exc:
        log.debug("kafka: mover close: %s", exc)


class _Client(Client):
    name = "confluent"

    def producer(self, settings: Settings) -> Producer:
        try:
            return _Producer(settings)
        except ClientError:
            raise
        except Exception as exc:
            raise classify(exc) from exc

    def admin(self, settings: Settings) -> Admin:
        try:
            return _Admin(settings)
        except Exception as exc:
            raise classify(exc) from exc

    def reader(self, settings: Settings) -> Reader:
        return _Reader(settings)

    def member(self, settings: Settings, group: str, topic: str, revoked: Listener,
               assigned: Listener) -> Member:
        return _Member(settings, group, topic, revoked, assigned)

    def mover(self, settings: Settings, transactional_id: str) -> Mover:
        return _Mover(settings, transactional_id)


CLIENT = _Client()
