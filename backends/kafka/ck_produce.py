"""The producers on confluent-kafka: the one every publish goes through (``_Producer``,
its lanes) and the transactional one that re-publishes records (``_Mover``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any

import confluent_kafka as ck

from mqabstract import wire

from .ck_base import _E, _config, _error, classify, log
from .client import TP, TXN_TIMEOUT_MS, ClientError, Kind, Mover, Outgoing, Producer, Settings

__all__ = ["_Mover", "_Producer"]


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


_TIMED_OUT = ck.KafkaError._MSG_TIMED_OUT


def _id_of(headers: Sequence[tuple[str, Any]]) -> bytes | None:
    """A record's ``mq-id`` header value (to place a failure)."""
    for k, v in headers:
        if k == wire.ID:
            return v if isinstance(v, bytes) else str(v).encode()
    return None


class _Producer(Producer):
    """Sends through lanes (``_Lane``): a send takes an idle one or opens another, so
    concurrent sends never wait for each other's records; up to ``_IDLE`` stay open.

    A lane that timed a record out is closed, not reused. Its client may be cut off for
    good: librdkafka 2.16 drops every broker it knows, bootstrap ones included, when a
    stopping broker answers a metadata request with no brokers (confluentinc/librdkafka
    #5301), and such a client never connects again; after a broker restart every later
    publish through it timed out. The next send opens a new lane."""

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
        try:  # librdkafka connects lazily: a bad address fails here, at open
            first.p.list_topics(timeout=s.connect_timeout)
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
        try:
            clean = lane.p.flush(max(0.0, deadline - time.monotonic())) == 0
        except BaseException:
            self._give(lane, False)
            raise
        if clean and not lane.failures:  # every record acknowledged: the common case
            self._give(lane, True)
            return errors
        failures, lane.failures = lane.failures, []
        timed_out = any(err.code() == _TIMED_OUT for err, _ in failures)
        self._give(lane, clean and not timed_out)
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
        lane = self._take()  # (one that never timed out, or a new one)
        answered = False
        try:
            meta = lane.p.list_topics(topic, timeout=min(5.0, self.s.request_timeout_ms / 1000))
            answered = True
        except Exception as exc:
            if cached is not None:
                self.parts[topic] = (cached[0], time.monotonic() - 25)  # again in 5 s
                return cached[0]
            raise classify(exc) from exc
        finally:
            self._give(lane, answered)  # (unanswered: perhaps cut off, as above)
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
        p = None
        try:
            p = ck.Producer(self.cfg)
            # Completes (or aborts) what an earlier producer with this id left open.
            p.init_transactions(self.timeout)
        except Exception as exc:
            # Closed before the caller may make another with this transactional.id: a live
            # one whose init lands late would fence it.
            if p is not None:
                with contextlib.suppress(Exception):
                    p.close()
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
