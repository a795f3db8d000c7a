"""The consumers on confluent-kafka: the group-less reader (``_Reader``) and the group
member (``_Member``), whose commits a committer thread makes in order.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import confluent_kafka as ck

from .ck_base import _E, READER_GROUP, _config, _error, _native, classify, log
from .client import TP, ClientError, Fetched, Kind, Listener, Member, Pending, Reader, Settings

__all__ = ["_Member", "_Reader"]


class _Record(NamedTuple):
    """A fetched record with the attributes ``Fetched`` names (a tuple: ``_group`` makes
    one per record without a Python call)."""

    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] | None
    timestamp: int


_new = tuple.__new__


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
        topic: str | None = None
        partition = -1
        batch: list[Fetched] = []
        record, new = _Record, _new
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != _E._PARTITION_EOF:
                    failure = _error(err)
                    if not failure.retriable:
                        raise failure
                    log.debug("kafka: fetch: %s", failure)
                continue
            p = msg.partition()
            t = msg.topic()
            if p != partition or t != topic:  # a fetch returns runs of one partition
                topic, partition = t, p
                tp = TP(t, p)
                found = out.get(tp)
                batch = out[tp] = [] if found is None else found
            batch.append(new(record, (msg.offset(), msg.key(), msg.value(), msg.headers(),
                                      msg.timestamp()[1])))
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

    def known_position(self, tp: TP) -> int | None:
        return self.next.get(tp)  # absent: seeked to the beginning (``seek`` with None)

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
        self.reading = 0  # threads inside librdkafka's consumer_group_metadata (group_meta)
        self.last_meta: object = None  # the last membership snapshot (group_meta)
        self.closed = False  # a closed librdkafka consumer must not be called (it crashes)
        self.commits: collections.deque[tuple[Any, Any, _Landing, object]] = (
            collections.deque())
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
        """The membership snapshot, never waiting on the network.

        librdkafka's ``consumer_group_metadata`` waits while the committer thread is inside
        a synchronous commit, and that commit has no time limit of its own: asked then (a
        paused broker), the caller's ``receive`` hung for as long as the broker did. While a
        commit is queued or in flight the last snapshot is used instead: a stale one is
        safe, the committer does not send a commit whose membership has moved on, and a
        fence re-reads the generation after its commit. No commit starts while a thread
        reads (``reading``: the committer waits for it), and ``close`` waits for readers.

        The read itself is made outside ``gate``: librdkafka answers it only once a
        rebalance callback running in the group thread's ``consume`` has returned, and that
        callback commits, so it takes ``gate``. Made under ``gate``, a ``receive`` that
        fenced just as a revocation began and that callback waited for each other for
        good (the zombie scenario hung 42 minutes, session 23: py-spy showed the one in
        ``consumer_group_metadata`` holding ``gate``, the other in ``revoked`` waiting for
        it)."""
        with self.gate:
            if self.closed:
                raise ClientError(Kind.FENCED, "the group consumer is closed")
            if (self.waiting or self.reading) and self.last_meta is not None:
                meta = self.last_meta
                return meta, _generation(meta)
            self.reading += 1
        try:
            meta = self.c.consumer_group_metadata()
        finally:
            with self.gate:
                self.reading -= 1
                self.gate.notify_all()
        with self.gate:
            self.last_meta = meta
        return meta, _generation(meta)

    def commit(self, offsets: Mapping[TP, tuple[int, str]],
               done: Callable[[ClientError | None], None],
               expect: object = None) -> Pending:
        """Queue the commit for the committer thread; its outcome comes as a Pending.

        The binding's commit is synchronous and has no time limit of its own: made by the
        caller, a broker that hangs (seen with ``docker pause``) held ``receive`` for as
        long as it hung, whatever its timeout. One committer thread keeps the commits in
        the order they were made; the caller waits on the Pending as long as it wants.
        A queued commit is not sent when the membership (member id, generation) differs
        from ``expect`` by then: librdkafka sends it with the generation current at send
        time, so a commit built before the member lost its partitions and sent after its
        rejoin would be accepted and overwrite the checkpoints of their new owner.
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
            self.commits.append((native, done, pending, expect))
            if self.committer is None:
                self.committer = threading.Thread(target=self._commit_loop, daemon=True,
                                                  name=f"mq-kafka-commit-{self.topic}")
                self.committer.start()
            self.gate.notify_all()
        return pending

    def _commit_loop(self) -> None:
        while True:
            with self.gate:
                while (not self.commits or self.reading) and not self.closed:
                    self.gate.wait(1.0)  # (a commit in flight would hold up a reader)
                if not self.commits:
                    return  # closed, and nothing left to send
            native, done, pending, expect = self.commits.popleft()
            failure: ClientError | None = None
            try:
                if expect is not None and self.c.consumer_group_metadata() != expect:
                    raise ClientError(Kind.FENCED, "the group membership changed since the "
                                                   "offsets were read: not sent")
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
            while self.waiting or self.reading:
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
