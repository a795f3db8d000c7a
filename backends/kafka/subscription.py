"""A subscription: one consumer of a group, on a group member and a group-less reader."""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import re
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mqabstract import wire
from mqabstract.driver import DriverSubscription
from mqabstract.emulation import dead_headers
from mqabstract.errors import Closed, LeaseExpired, MQError, Timeout
from mqabstract.model import Delivery, GroupSpec
from mqabstract.names import topic_matches
from mqabstract.url import redact

from .client import TP, ClientError, Fetched, Kind, Outgoing, Pending
from .driver import KafkaDriver
from .errors import native, transient
from .names import HASHED, INTERNAL, slot, topic_regex, unescape
from .state import CKPT_RANGES, Part, Rec

__all__ = ["KafkaSubscription"]

log = logging.getLogger("mqabstract.kafka")

#: Longest a revocation waits for re-publishes in flight (it may run on the client's I/O
#: thread, so heartbeats wait as long).
_MOVING_WAIT = 3.0
#: Most copies one transaction of ``_move`` writes.
_MOVE_CHUNK = 500
#: A data partition that fetched nothing for this long while the broker holds records
#: beyond its position is read again by a new data consumer (``_check_stalled``).
_STALL_AFTER = 10.0
#: Longest the end-offset query of that check may hold the data thread, and the most
#: partitions it asks about per round (the longest idle first).
_STALL_PROBE = 2.0
_STALL_PROBE_MAX = 32
#: Held (delayed) records a consumer keeps before it stops fetching, in ``max_buffered``s.
HELD_FACTOR = 10


class _Unknown(Timeout):
    """A re-publish transaction whose outcome could not be found out (the broker away
    after its commit began): the copy may or may not be there."""


class KafkaSubscription(DriverSubscription):
    """One consumer of a group, on two consumers owned by two background threads.

    * The *group* consumer (``Member``) is the Kafka consumer-group member. It subscribes
      to the group's retry topic only, a fixed list: the group rebalances when members
      come and go, never because a topic matching the pattern appeared. Its retry
      partitions are this member's *slots*. Its thread does nothing but poll (keeping the
      membership), take new assignments and commit offsets (for the data partitions too:
      an offset commit is checked against the member's generation, not its assignment, on
      Apache Kafka and tansu alike).
    * The *data* consumer has no group: it is assigned, by hand, the partitions of the
      topics matching the pattern whose slot (``names.slot``) this member owns, and refreshes
      that list when topics appear, so a new topic is read from its first message without
      a rebalance. Its thread also expires leases, releases delayed records and hands
      idle records to other members.

    Threads: the application calls receive/settles from any thread; ``lock`` guards the
    state below; ``commit_lock`` orders commits. Settles that write (nack, dead letter,
    lease expiry) are fenced by a commit first (``_fence``) and retried by the caller.
    """

    def __init__(self, driver: KafkaDriver, spec: GroupSpec, declared_ms: int) -> None:
        self.d = driver
        self.spec = spec
        self.declared_ms = declared_ms
        self.retry = driver.retry_topic(spec.name)
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.commit_lock = threading.Lock()  # one commit built and sent at a time
        self.epoch = 0  # revocations so far (lock held)
        self.moving = 0  # re-publishes between their fence and their settled mark
        # Copies and the checkpoints that settle their originals are written in one
        # transaction (``_transfer``), on a transactional producer of this consumer.
        self.mover: Any = None
        self.txn_id = f"mqa..{spec.name}..{uuid.uuid4().hex}"
        self.last_sent: Pending | None = None  # the latest offset commit sent
        self.ckpt_limit = CKPT_RANGES  # halved if the broker keeps less commit metadata
        self.ready: deque[Rec] = deque()
        self.held: list[tuple[float, int, Rec]] = []
        self.leased: dict[int, Rec] = {}
        self.parts: dict[TP, Part] = {}
        self.suspended: dict[TP, tuple[Part, list[Rec]]] = {}
        self.new_assignment: set[TP] | None = None
        self.slots: set[int] = set()
        self.slot_version = 0
        self.tokens = itertools.count(1)
        self.seq = itertools.count()
        self.closed = False
        self.stopping = False
        self.group_stopping = False
        self.waiting = 0
        self.last_receive = time.monotonic()
        # Buffer full (``_full``): the data thread stops polling its reader, which is not
        # paused (librdkafka would discard its read-ahead and fetch it again on resume).
        # A receive that drains the buffer to half (``_drained``) wakes it.
        self.paused = False
        self.assigned_once = threading.Event()
        self.error: BaseException | None = None
        self.data_assigned: set[TP] = set()
        # Data thread only: when each data partition last returned a record or was
        # positioned (``_check_stalled``), and when that check may run next.
        self.data_seen: dict[TP, float] = {}
        self.stall_ends: dict[TP, int] = {}  # end offsets a new consumer was started for
        self.next_stall_check = 0.0
        self.applied_version = -1
        self.topic_version = -1
        self.next_refresh = 0.0
        self.matched: set[str] = set()
        self.partitions: dict[str, set[int]] = {}
        self.names: dict[str, str] = {}  # Kafka topic -> mqabstract topic
        opts = driver.opts
        self.group: Any = None
        self.data: Any = None
        try:
            self.slot_count = len(driver.partitions_for(self.retry)) or 1
            self.regex = re.compile(topic_regex(spec.pattern, driver.prefix))
            self.group = driver.client.member(driver.settings, spec.name, self.retry,
                                              self.revoked, self.assigned)
            self.group.await_metadata(opts["request_timeout_ms"] / 1000)
            self.data = driver.client.reader(driver.settings)
        except Exception as exc:
            for consumer in (self.group, self.data):
                if consumer is not None:
                    consumer.close()
            raise native(exc, f"cannot join group {spec.name!r}", driver.url) from exc
        self.group_thread = threading.Thread(
            target=self._run_group, name=f"mqa-kafka-g-{spec.name}", daemon=True)
        self.data_thread = threading.Thread(
            target=self._run_data, name=f"mqa-kafka-d-{spec.name}", daemon=True)
        self.group_thread.start()
        self.data_thread.start()
        # Wait for the first assignment so that consumers subscribed one after another
        # settle before they receive (fewer rebalances that take in-flight messages away).
        self.assigned_once.wait(opts["session_timeout_ms"] / 1000 * 3 + 5)
        if self.error is not None:  # e.g. the broker refused the session timeout
            failure = self.error
            self.close()
            raise native(failure, f"cannot join group {spec.name!r}", driver.url) from failure

    # -- group thread ------------------------------------------------------------------------
    def _run_group(self) -> None:
        retry_at = 0.0  # when to position a new assignment again after a failure
        try:
            while not self.group_stopping:
                try:
                    recs = self.group.poll(0.2, 1000)
                except Exception as exc:
                    # A poll can raise the connection error of a coordinator lookup made
                    # while the broker is down; the same consumer works again once the
                    # broker is back.
                    if not transient(exc):
                        raise
                    log.info("kafka: group consumer of %s waits for the broker: %s",
                             self.spec.name, redact(str(exc))[:300])
                    time.sleep(0.2)
                    continue
                if recs:
                    self._ingest(recs)
                if self.new_assignment is not None and time.monotonic() >= retry_at:
                    try:
                        self._take_assignment()
                    except Exception as exc:
                        if not transient(exc):
                            raise
                        # The broker is restarting: keep polling (heartbeats, the join)
                        # and position the assignment once it answers again.
                        log.info("kafka: assignment of %s not positioned yet: %s",
                                 self.spec.name, redact(str(exc))[:300])
                        retry_at = time.monotonic() + 0.5
                self._commit(sync=False)
        except Exception as exc:
            log.warning("kafka: group consumer of %s stopped: %s", self.spec.name,
                        redact(str(exc)))
            self.error = exc
        finally:
            try:
                self._commit(sync=True)
            except Exception as exc:
                log.debug("kafka: last commit of %s failed: %s", self.spec.name, exc)
            self.group.close()
            with self.cv:
                self.cv.notify_all()
            self.assigned_once.set()

    # -- checkpoints (offset commits) -------------------------------------------------------
    def _commit(self, sync: bool) -> None:
        """The group thread's commit: asynchronous between polls, synchronous at the end."""
        if sync:
            try:
                self._fence(self.d.opts["request_timeout_ms"] / 1000)
            except MQError as exc:
                log.debug("kafka: final commit of %s: %s", self.spec.name, exc)
        else:
            # (not waiting for commit_lock: a transaction may hold it; next round)
            self._send_checkpoints(None, patience=0)

    def _checkpoints(self, force: Collection[TP]) -> dict[TP, tuple[int, str]]:
        """The checkpoints that changed since last sent, plus those of ``force``."""
        offsets: dict[TP, tuple[int, str]] = {}
        with self.lock:
            for tp, part in self.parts.items():
                point, meta = part.checkpoint(self.ckpt_limit)
                if point is None:
                    continue
                if point != part.committed or meta != part.meta or tp in force:
                    offsets[tp] = (point, meta)
                    part.committed, part.meta = point, meta
        return offsets

    def _schedule(self, force: Collection[TP], patience: float = -1) -> Pending | None:
        """Send the changed checkpoints (plus those of ``force``) as one commit; None when
        there was nothing to send (or ``commit_lock`` was not free within ``patience``).

        Built and sent under ``commit_lock``: commits go out in the order their contents
        were read, so a later commit never carries an older mark. A client may commit
        synchronously under it (confluent-kafka), so a rebalance listener, which can run
        inside the poll such a commit waits for, passes a ``patience``.
        """
        if not self.commit_lock.acquire(timeout=patience):
            return None
        try:
            offsets = self._checkpoints(force)
            if not offsets:
                return None
            sent: Pending = self.group.commit(
                offsets, lambda err: self._committed(offsets, err))
            self.last_sent = sent
            return sent
        finally:
            self.commit_lock.release()

    def _send_checkpoints(self, force: Collection[TP] | None, patience: float = -1) -> None:
        """Commit changed checkpoints, not waiting for the outcome where the client lets
        us (a failed one is sent again with the next)."""
        try:
            self._schedule(force or (), patience)
        except ClientError as exc:
            log.debug("kafka: commit of %s not sent: %s", self.spec.name, exc)

    def _fence(self, budget: float, force: Collection[TP] = ()) -> None:
        """Commit the checkpoints (changed ones and those of ``force``) and wait for them.

        An offset commit is validated against the member id and generation: when it
        succeeds, this consumer was a current member of the group, so nobody else owns
        these partitions, and whoever takes them over later reads these checkpoints (its
        assignment comes after this commit). It is the proof required before records are
        handed out or re-published: a consumer that was frozen past its session, or lost
        the partitions in a rebalance it has not seen yet, gets ``Kind.FENCED`` here.

        Raises ``LeaseExpired`` when membership is lost or a rebalance is under way,
        ``Timeout`` / ``ConnectionFailed`` when the coordinator does not answer in time.
        """
        if not self.group.stable():
            raise LeaseExpired(f"group {self.spec.name!r} is rebalancing")
        try:
            sent = self._schedule(force)
        except ClientError as exc:
            raise native(exc, f"commit of {self.spec.name!r} failed", self.d.url) from exc
        if sent is None:
            return
        err = sent.wait(max(0.05, budget))
        if err is None:
            return
        if err.kind is Kind.TIMEOUT:
            raise Timeout(f"commit of {self.spec.name!r} not confirmed within {budget:.2f}s")
        if err.kind is Kind.METADATA_TOO_LARGE:
            # offset.metadata.max.bytes below Apache Kafka's default 4096: list fewer
            # settled ranges (the rest is delivered again after a takeover).
            self.ckpt_limit //= 2
        if err.kind is Kind.FENCED:
            raise LeaseExpired(f"consumer of {self.spec.name!r} is no longer a member of the "
                               f"current generation: {err.native}") from err
        raise native(err, f"commit of {self.spec.name!r} failed", self.d.url) from err

    def _committed(self, offsets: Mapping[TP, tuple[int, str]], error: ClientError | None
                   ) -> None:
        """A commit landed, or failed (e.g. during a rebalance: sent again with the next)."""
        with self.lock:
            for tp, sent in offsets.items():
                if error is not None:
                    part = self.parts.get(tp)
                    if part is not None and (part.committed, part.meta) == sent:
                        part.committed, part.meta = part.confirmed, part.sent_meta
                    continue
                part = self.parts.get(tp) or self.suspended.get(tp, (None, None))[0]
                if part is not None:
                    part.confirmed, part.sent_meta = sent

    # -- rebalance (group consumer) -------------------------------------------------------
    def revoked(self, revoked: Collection[TP]) -> None:
        """The member's listener: slots are going (before the rejoin)."""
        slots = {tp.partition for tp in revoked if tp.topic == self.retry}
        with self.cv:
            # Re-publishes that passed their fence finish first, so that the checkpoint
            # below lists their originals as settled (else the next owner delivers the
            # original with the attempt the copy has). Later ones see the new epoch and
            # write nothing. This may block the client's I/O thread (heartbeats) for at
            # most _MOVING_WAIT; the writes go through the producer, not this consumer.
            self.epoch += 1
            end = time.monotonic() + _MOVING_WAIT
            while self.moving and time.monotonic() < end:
                self.cv.wait(max(0.001, end - time.monotonic()))
            gone = {tp for tp in self.parts
                    if tp in set(revoked)
                    or (tp.topic != self.retry and slot(tp, self.slot_count) in slots)}
        # Scheduled here, in the listener: sent before the JoinGroup that follows; if it
        # fails, the next owner re-delivers (attempt + 1).
        log.debug("kafka: %s revoked %s", self.spec.name, sorted(gone))
        self._send_checkpoints(gone, patience=0.2)
        with self.cv:
            for tp in gone:
                part = self.parts.pop(tp, None)
                if part is None:
                    continue
                stash = [r for r in self.ready if r.tp == tp]
                stash += [r for _, _, r in self.held if r.tp == tp]
                part.revoked_at = (part.committed, part.meta)
                self.suspended[tp] = (part, stash)
            self.ready = deque(r for r in self.ready if r.tp not in gone)
            self.held = [h for h in self.held if h[2].tp not in gone]
            heapq.heapify(self.held)
            self.slots -= slots
            self.slot_version += 1

    def assigned(self, assigned: Collection[TP]) -> None:
        """The member's listener: only bookkeeping (the member keeps new partitions paused);
        the group thread positions them (``_take_assignment``)."""
        log.debug("kafka: %s assigned %s", self.spec.name, sorted(assigned))
        with self.lock:
            self.new_assignment = set(assigned)

    def _take_assignment(self) -> None:
        with self.lock:
            assigned, self.new_assignment = self.new_assignment, None
            epoch = self.epoch
        if assigned is None:
            return
        try:
            committed = self.d.committed(self.spec.name, assigned) if assigned else {}
        except Exception:
            with self.lock:  # retried by the group thread unless a newer one came
                if self.new_assignment is None:
                    self.new_assignment = assigned
            raise
        adopted = self._adopt(assigned, committed, epoch=epoch)
        if adopted is None:
            return  # revoked again meanwhile: the next assignment follows
        fresh, positions = adopted
        for tp in fresh:  # the retry topic belongs to the group: from its beginning
            found = committed.get(tp)
            positions[tp] = found[0] if found is not None else None
        self.group.start(positions)
        with self.cv:
            self._forget_suspended([t for t in self.suspended
                                    if t.topic == self.retry and t not in assigned])
            self.slots = {tp.partition for tp in assigned}
            self.slot_version += 1
            self.cv.notify_all()

    def _forget_suspended(self, tps: Collection[TP]) -> None:
        """Partitions that went to another member for good (lock held): their leases are
        stale, the new owner redelivers from the committed offset."""
        gone = set(tps)
        for tp in gone:
            self.suspended.pop(tp, None)
        if gone:
            for token, rec in list(self.leased.items()):
                if rec.tp in gone:
                    del self.leased[token]

    def _adopt(self, assigned: Collection[TP], committed: Mapping[TP, tuple[int, str] | None],
               epoch: int | None = None, version: int | None = None
               ) -> tuple[list[TP], dict[TP, int | None]] | None:
        """Take partitions over: keep our in-flight state where nobody committed since we
        had them (the stored checkpoint is still the one we sent: another owner that handed
        anything out would have committed its own first). Returns the partitions that need
        a start position (a fresh partition starts from its checkpoint, ``Part``) and the
        positions of those taken back.

        None, adopting nothing, when the assignment is stale: revoked again (``epoch``) or
        the slots changed (``version``) since it was read. Adopting it would make this
        member hand out records of partitions another member owns: the coordinator checks
        commits against the generation, not the assignment."""
        fresh: list[TP] = []
        back: dict[TP, int | None] = {}
        with self.cv:
            if ((epoch is not None and epoch != self.epoch)
                    or (version is not None and version != self.slot_version)):
                return None
            now = time.time()
            for tp in assigned:
                found = committed.get(tp)
                stored = found if found is not None else (None, None)
                old = self.suspended.pop(tp, None)
                if old is not None and old[0].next_fetch and stored in (
                        old[0].revoked_at, (old[0].confirmed, old[0].sent_meta)):
                    log.debug("kafka: %s takes %s back (checkpoint %s)", self.spec.name,
                              tp, stored)
                    part, stash = old
                    if stored != (part.committed, part.meta):
                        part.committed, part.meta = stored
                    self.parts[tp] = part
                    back[tp] = part.next_fetch
                    for rec in stash:
                        if rec.due > now:
                            heapq.heappush(self.held, (rec.due, next(self.seq), rec))
                        else:
                            self.ready.append(rec)
                    continue
                self.parts[tp] = Part(found)
                log.debug("kafka: %s takes %s over (checkpoint %s)", self.spec.name, tp,
                          stored)
                fresh.append(tp)
            # Leases on partitions that are not ours any more are stale now.
            for token, rec in list(self.leased.items()):
                if rec.tp in fresh:
                    del self.leased[token]
            self.cv.notify_all()
        return fresh, back

    # -- data thread --------------------------------------------------------------------------
    def _run_data(self) -> None:
        pause = 0.0  # back-off while the broker does not answer
        try:
            while not self.stopping:
                if pause:
                    with self.cv:
                        if not self.stopping:
                            self.cv.wait(pause)
                try:
                    self._refresh_data()
                    self._tick()
                    if not self.data_assigned or self.paused:
                        wait = min(0.2, self._poll_ms() / 1000)
                        with self.cv:
                            if self.paused:  # until a receive drained the buffer
                                self.cv.wait_for(lambda: self.stopping or self._drained(), wait)
                            elif not self.stopping:  # unassigned: any notify ends it
                                self.cv.wait(wait)
                        pause = 0.0
                        continue
                    recs = self.data.poll(self._poll_ms() / 1000, 1000)
                    if recs:
                        now = time.monotonic()
                        for tp in recs:
                            self.data_seen[tp] = now
                        self._ingest(recs)
                    pause = 0.0
                    self._check_stalled()
                except Exception as exc:
                    # A broker restart or outage: retry; the subscription recovers with
                    # the broker (the same object, as the contract requires).
                    if not transient(exc):
                        raise
                    if not pause:
                        log.info("kafka: consumer of %s waits for the broker: %s",
                                 self.spec.name, redact(str(exc))[:300])
                    pause = min(max(pause * 2, 0.1), 2.0)
        except Exception as exc:
            log.warning("kafka: consumer of %s stopped: %s", self.spec.name, redact(str(exc)))
            self.error = exc
        finally:
            self.data.close()
            with self.cv:
                self.cv.notify_all()
            self.assigned_once.set()

    def _refresh_data(self) -> None:
        """Assign the data consumer the matching partitions of our slots.

        Pattern matching is ours (a new matching topic must not rebalance the group, and
        kafka-python 3.0's pattern subscription can hang in ``poll``). The topic list is read
        every ``metadata_max_age_ms``, and at once when this process created a topic.
        """
        now = time.monotonic()
        with self.lock:
            version, slots = self.slot_version, set(self.slots)
        topics_changed = self.d.topic_version != self.topic_version
        if version == self.applied_version and now < self.next_refresh and not topics_changed:
            return
        if now >= self.next_refresh or topics_changed:
            self.topic_version = self.d.topic_version
            self.next_refresh = now + self.d.opts["metadata_max_age_ms"] / 1000
            self.matched = {t for t in self.d.topic_names()
                            if self.regex.match(t) and not t.startswith(INTERNAL)}
        wanted: set[TP] = set()
        for topic in self.matched:
            parts = self.partitions.get(topic)
            if not parts:
                # The producer's per-topic metadata: no full-cluster metadata request.
                parts = self.partitions[topic] = self.d.partitions_for(topic)
            for p in parts:
                tp = TP(topic, p)
                if slot(tp, self.slot_count) in slots:
                    wanted.add(tp)
        new = wanted - self.data_assigned
        with self.lock:
            # A rebalance may revoke and give back a slot between two refreshes (a fast
            # join: one poll of the group thread): its data partitions stay assigned to
            # the data consumer but were suspended (no longer in ``parts``). Adopt them
            # again, or their records are dropped and their leases never expire.
            if version == self.slot_version:
                new |= {tp for tp in wanted & self.data_assigned if tp not in self.parts}
        if wanted != self.data_assigned:
            for tp in self.data_assigned - wanted:
                self.data_seen.pop(tp, None)
                self.stall_ends.pop(tp, None)
            with self.cv:
                for tp in self.data_assigned - wanted:
                    self.parts.pop(tp, None)
                self.ready = deque(r for r in self.ready
                                   if r.tp.topic == self.retry or r.tp in wanted)
                # Leases on partitions revoked for a rebalance (suspended) stay: the
                # partition may come back with them.
                for token, rec in list(self.leased.items()):
                    if (rec.tp.topic != self.retry and rec.tp not in wanted
                            and rec.tp not in self.suspended):
                        del self.leased[token]
            self.data.assign(wanted)
            self.data_assigned = wanted
        if new:
            try:
                committed = self.d.committed(self.spec.name, new)
                fresh, positions = self._adopt(new, committed, version=version) or ([], {})
                start = []
                for tp in fresh:
                    found = committed.get(tp)
                    if found is not None:
                        positions[tp] = found[0]
                    else:
                        start.append(tp)
                if start:
                    positions.update(self._start_offsets(start))
                self.data.seek(positions)
                now = time.monotonic()
                for tp in positions:
                    self.data_seen[tp] = now
            except Exception:
                # Not positioned (broker away): unassign them, so that they are neither
                # read from a wrong offset nor left out; the next refresh tries again.
                with self.cv:
                    for tp in new:
                        self.parts.pop(tp, None)
                    self.ready = deque(r for r in self.ready if r.tp not in new)
                    self.held = [h for h in self.held if h[2].tp not in new]
                    heapq.heapify(self.held)
                self.data_assigned = wanted - new
                self.data.assign(self.data_assigned)
                raise
        with self.cv:
            # Suspended data partitions that did not come back went to another member.
            if version == self.slot_version and slots:
                self._forget_suspended([t for t in self.suspended
                                        if t.topic != self.retry and t not in wanted])
        self.applied_version = version
        if version > 0 and slots:
            self.assigned_once.set()

    def _check_stalled(self) -> None:
        """Read again, with a new data consumer, partitions whose fetching stopped.

        In a CI run of test_broker_restart the data consumer returned none of the records
        written after the broker restart for 90 s, with no error, while its partitions
        stayed ours (11 ids lost; suspected: librdkafka's group-less consumer wedged by
        the restart, e.g. in its KIP-1102 re-bootstrap of the decommissioned broker; not
        reproduced in 115 restarts). A partition we own that returned nothing for
        ``_STALL_AFTER`` while the broker's end offset is beyond our position is such a
        stall, whatever its cause: a new consumer takes every data partition over at the
        same positions. Costs one end-offset query per idle partition (at most
        ``_STALL_PROBE_MAX``) per ``_STALL_AFTER``; a failed query (broker away) waits
        for the next round. Only for readers that declare it (``Reader.watched``: the
        librdkafka one; kafka-python's end-offset query cannot be bounded in time).
        """
        now = time.monotonic()
        if (now < self.next_stall_check or not self.data_assigned
                or not self.data.watched):
            return
        self.next_stall_check = now + _STALL_AFTER / 2
        with self.lock:
            owned = [tp for tp in self.data_assigned if tp in self.parts]
        idle = [tp for tp in owned if now - self.data_seen.setdefault(tp, now) >= _STALL_AFTER]
        if not idle:
            return
        idle = sorted(idle, key=self.data_seen.__getitem__)[:_STALL_PROBE_MAX]
        try:
            probe_end = now + _STALL_PROBE  # one bound for the whole round
            ends: dict[TP, int] = {}
            for tp in idle:
                left = probe_end - time.monotonic()
                if left <= 0:
                    break
                ends.update(self.data.end_offsets([tp], timeout=left))
            behind = {}
            for tp in ends:
                at, end = self.data.position(tp), ends[tp]
                # (A gap that a new consumer did not read either is no stall: control
                # records of transactions are never returned. Tried once per end offset.)
                if end > at and end > self.stall_ends.get(tp, -1):
                    behind[tp] = (at, end)
                else:
                    self.data_seen[tp] = now  # idle, not stalled: again in _STALL_AFTER
        except Exception as exc:  # (a check: never what stops the data thread)
            log.debug("kafka: stall check of %s: %s", self.spec.name, redact(str(exc))[:300])
            return
        if not behind:
            return
        log.warning("kafka: consumer of %s fetched nothing for %.0fs from partitions with "
                    "records to read (position, end): %s; a new consumer takes over",
                    self.spec.name, _STALL_AFTER,
                    {f"{t}[{p}]": v for (t, p), v in sorted(behind.items())})
        try:
            self._renew_reader()
        except Exception as exc:
            log.warning("kafka: new consumer of %s not started (tried again in %.0fs): %s",
                        self.spec.name, _STALL_AFTER, redact(str(exc))[:300])
            return
        for tp, (_, end) in behind.items():
            self.stall_ends[tp] = end
        # A renewal that did not help (a producer's open transaction keeps the end ahead
        # of what read_committed returns) is not repeated every round.
        self.next_stall_check = time.monotonic() + _STALL_AFTER * 6

    def _renew_reader(self) -> None:
        """Replace the data consumer by a new one at the same assignment and positions:
        the partitions we own at their positions; the others (taken back or adopted
        later) are positioned by ``_refresh_data`` as before."""
        with self.lock:
            owned = [tp for tp in self.data_assigned if tp in self.parts]
        positions = {tp: self.data.position(tp) for tp in owned}
        old, new = self.data, self.d.client.reader(self.d.settings)
        try:
            new.assign(self.data_assigned)
            new.seek(positions)
        except Exception:
            new.close()
            raise
        self.data = new
        now = time.monotonic()
        for tp in positions:
            self.data_seen[tp] = now
        # The old consumer may be wedged: its close must not hold the data thread.
        threading.Thread(target=old.close, name=f"mqa-kafka-close-{self.spec.name}",
                         daemon=True).start()

    def _start_offsets(self, tps: Collection[TP]) -> dict[TP, int | None]:
        """Where a group starts on partitions it never committed: its declaration time.

        The first record at or after the declaration (``offsets_for_times``). When there
        is none, every record present is older, so the group starts at the end offset
        read *before* that query: a record written in between is not skipped (a lazy
        ``seek_to_end`` would skip it). tansu may report an end that is too low after a
        batched produce: that only makes us read older records, which ``_decode`` drops
        by timestamp, so this is right on Apache Kafka and on tansu.
        """
        ends = self.data.end_offsets(tps)
        found = self.data.offsets_for_times(tps, self.declared_ms)
        out: dict[TP, int | None] = {}
        for tp in tps:
            hit = found.get(tp)
            out[tp] = hit if hit is not None else ends.get(tp, 0)
        return out

    def _poll_ms(self) -> int:
        """Sleep in poll until the next due record, lease end or hand-off check."""
        now = time.time()
        wake = now + 0.2
        with self.lock:
            if self.held:
                wake = min(wake, self.held[0][0])
            for rec in self.leased.values():
                # (an expired lease on a suspended partition waits for the assignment)
                wake = min(wake, max(rec.deadline, now + 0.05))
            if self.ready and not self.waiting:
                wake = min(wake, now + self.d.opts["handoff_ms"] / 2000)
        return int(max(0.005, wake - now) * 1000)

    def _full(self) -> bool:
        """(Under ``lock``.) Whether the data thread stops fetching: more ready records
        than ``max_buffered``, or more held (delayed) ones than ``HELD_FACTOR`` times that.
        Held records leave only when due: at the ready bound, a backlog of delayed ones
        would stop undelayed traffic until they are."""
        limit: int = self.d.opts["max_buffered"]
        return len(self.ready) > limit or len(self.held) > HELD_FACTOR * limit

    def _drained(self) -> bool:
        """(Under ``lock``.) Whether the buffer is down to where a paused data thread
        fetches again: half of each bound."""
        limit: int = self.d.opts["max_buffered"]
        return len(self.ready) <= limit // 2 and len(self.held) <= HELD_FACTOR * limit // 2

    def _tick(self) -> None:
        now = time.time()
        expired: list[Rec] = []
        handoff: list[Rec] = []
        with self.cv:
            for token, rec in list(self.leased.items()):
                if rec.deadline <= now:
                    if rec.tp in self.parts:
                        del self.leased[token]
                        expired.append(rec)
                    elif rec.tp not in self.suspended:
                        del self.leased[token]  # the partition moved: its owner redelivers
                    # else: revoked for a rebalance; decided when the assignment settles
            released = False
            while self.held and self.held[0][0] <= now:
                _, _, rec = heapq.heappop(self.held)
                if rec.tp in self.parts:
                    rec.since = time.monotonic()
                    self.ready.append(rec)
                    released = True
            if released:
                self.cv.notify_all()
            handoff = self._pick_handoff()
            for rec in handoff:
                part = self.parts.get(rec.tp)
                if part is not None and rec.offset + 1 > part.mark:
                    # Counted as handed out: if we die before the original is committed
                    # done, its next owner gives it an attempt above the copy's.
                    part.mark = rec.offset + 1
            full, drained = self._full(), self._drained()
            epoch = self.epoch  # the partitions these records were taken from are ours
        if expired or handoff:
            self._move(expired, handoff, epoch)
        if full and not self.paused and self.data_assigned:
            self.paused = True
        elif drained and self.paused:
            self.paused = False
            now = time.monotonic()  # paused is not stalled: idle time counts from here
            for tp in self.data_assigned:
                self.data_seen[tp] = now

    def _fence_tick(self, expired: list[Rec], handoff: list[Rec], epoch: int) -> object:
        """Before re-publishing expired leases or handing records off: ``_fence`` (it
        also makes sure no earlier commit of ours lands after the transaction's). A
        consumer woken from a freeze longer than its session still has its old leases and
        buffers; its partitions' new owner redelivers those records from the checkpoint.
        Returns the group snapshot the transaction is fenced with (``_transfer``), the
        move counted (``_begin_move``); on failure, or when a revocation began since
        ``epoch``, None: nothing is written and the records go back (``_put_back``)."""
        budget = min(max(0.5, self.spec.lease / 4), self.d.opts["request_timeout_ms"] / 1000)
        try:
            if self.epoch != epoch:
                raise LeaseExpired("a rebalance began")
            self._fence(budget, force={rec.tp for rec in (*expired, *handoff)})
            meta = self._snapshot()
            if not self._begin_move(epoch):
                raise LeaseExpired("a rebalance began")
        except MQError as exc:
            log.info("kafka: %d records of %s not re-published: %s",
                     len(expired) + len(handoff), self.spec.name, redact(str(exc))[:300])
            self._put_back(expired, handoff)
            return None
        return meta

    def _snapshot(self) -> object:
        """The member's group snapshot (generation, member id) for a transaction. Taken
        before ``_begin_move`` checks the revocation epoch: a snapshot of a later
        generation (after a rejoin) always comes with a revocation, which that check sees.
        A member without a generation is refused: the coordinator would accept its
        transactional offset commit (the one for clients outside group management)."""
        try:
            meta, generation = self.group.group_meta()
        except ClientError as exc:
            raise native(exc, f"consumer of {self.spec.name!r}", self.d.url) from exc
        if generation is not None and generation < 0:
            raise LeaseExpired(f"consumer of {self.spec.name!r} is not a member of the group")
        return meta

    def _put_back(self, expired: Collection[Rec], handoff: Sequence[Rec]) -> None:
        """Records whose copy was not written: the leases are kept (tried again shortly,
        or dropped when the partition turns out to have moved), the hand-offs are ready
        again (with their partition's stash while it is suspended)."""
        with self.cv:
            retry_at = time.time() + 0.5
            for rec in expired:
                if rec.tp in self.parts or rec.tp in self.suspended:
                    rec.deadline = retry_at
                    self.leased[next(self.tokens)] = rec
            mono = time.monotonic()
            for rec in reversed(handoff):
                if rec.tp in self.parts:
                    rec.since = mono
                    self.ready.appendleft(rec)
                elif rec.tp in self.suspended:
                    self.suspended[rec.tp][1].insert(0, rec)
            self.cv.notify_all()

    def _begin_move(self, epoch: int) -> bool:
        """After a successful ``_fence``: count a re-publish in flight, unless a revocation
        began since ``epoch`` (then write nothing). ``revoked`` waits for those counted."""
        with self.cv:
            if self.epoch != epoch:
                return False
            self.moving += 1
            return True

    def _end_move(self) -> None:
        with self.cv:
            self.moving -= 1
            self.cv.notify_all()

    def _move(self, expired: list[Rec], handoff: list[Rec], epoch: int) -> None:
        """Write the copies of expired leases (attempt + 1) and idle hand-offs (same
        attempt) and settle their originals, a chunk per transaction (``_transfer``);
        each chunk is fenced first. What is not written goes back (``_put_back``)."""
        budget = self.d.opts["request_timeout_ms"] / 1000
        todo: deque[tuple[Rec, bool]] = deque(
            [(rec, True) for rec in expired] + [(rec, False) for rec in handoff])
        while todo:
            meta = self._fence_tick([r for r, lapsed in todo if lapsed],
                                    [r for r, lapsed in todo if not lapsed], epoch)
            if meta is None:
                return
            chunk = [todo.popleft() for _ in range(min(len(todo), _MOVE_CHUNK))]
            try:
                self._transfer([(rec, self._copy(rec, rec.n + 1 if lapsed else rec.n, 0.0,
                                                 avoid_self=True, hop=not lapsed))
                                for rec, lapsed in chunk], meta, budget)
            except MQError as exc:
                log.info("kafka: %d records of %s not re-published: %s", len(todo) + len(chunk),
                         self.spec.name, redact(str(exc))[:300])
                if isinstance(exc, _Unknown):
                    with self.lock:  # the copies may be there: never their attempt again
                        for rec, _ in chunk:
                            rec.n += 1
                rest = [*chunk, *todo]
                self._put_back([r for r, lapsed in rest if lapsed],
                               [r for r, lapsed in rest if not lapsed])
                return
            finally:
                self._end_move()

    def _pick_handoff(self) -> list[Rec]:
        """Ready records nobody here asks for go to another consumer of the group.

        A Kafka partition belongs to one consumer; if that consumer stops receiving (busy,
        hung), its fetched records would wait. After ``handoff_ms`` without a receive they
        are re-published to a retry partition owned by another member (back-off doubles
        per hop, so idle groups do not ping-pong).
        """
        if self.spec.ordered or not self.ready or self.waiting \
                or not self._other_retry_partitions():
            # (ordered groups never: the portable layer's gate holds a key's later
            # messages only where its earlier ones come back, to this consumer)
            return []
        now = time.monotonic()
        base = self.d.opts["handoff_ms"] / 1000
        if now - self.last_receive < base:
            return []
        out = [r for r in self.ready if now - r.since >= base * (2 ** min(r.hops, 6))]
        if out:
            ids = {id(r) for r in out}
            self.ready = deque(r for r in self.ready if id(r) not in ids)
        return out

    def _other_retry_partitions(self) -> list[int]:
        parts = self.d.partitions_for(self.retry)
        mine = {tp.partition for tp in self.parts if tp.topic == self.retry}
        return sorted(set(parts) - mine)

    def _ingest(self, batches: Mapping[TP, list[Fetched]]) -> None:
        # Decoded before taking the lock: receive, ack and commits wait on it.
        decoded = [(tp, [(r.offset, self._decode(tp, r, tp.topic == self.retry))
                         for r in records]) for tp, records in batches.items()]
        now = time.time()
        mono = time.monotonic()
        added = False
        with self.cv:
            for tp, recs in decoded:
                part = self.parts.get(tp)
                if part is None:
                    continue  # not (or no longer) ours: its owner reads it
                inherited = part.inherited
                for offset, rec in recs:
                    part.fetched(offset)
                    if offset < inherited and offset in part.done:
                        continue  # settled by an earlier owner (its checkpoint says so)
                    if rec is None:
                        part.done.add(offset)
                        continue
                    if offset < inherited:
                        # Handed to an application by owners that died, froze or lost the
                        # partition before settling it: one attempt more than any of them
                        # gave, and not before the last of their leases ends.
                        rec.n += part.extra_attempts(offset)
                        rec.due = max(rec.due, min(part.hold, now + self.d.capabilities.max_lease))
                    if rec.due > now:
                        heapq.heappush(self.held, (rec.due, next(self.seq), rec))
                    else:
                        rec.since = mono
                        self.ready.append(rec)
                        added = True
            if added:
                self.cv.notify_all()

    def _decode(self, tp: TP, r: Any, retry: bool) -> Rec | None:
        """A fetched record as a ``Rec``; None for records this group must skip. The
        wire-schema headers go to their fields (defaults for records of plain clients)."""
        headers, meta = wire.split(r.headers or ())
        f = wire.read(meta)
        key = r.key
        if retry:
            topic = f.topic or ""
            text_key = f.key
            if text_key is None and key is not None:
                text_key = key.decode("utf-8", "replace")
        else:
            if r.timestamp < self.declared_ms:
                # Published before the group existed. Also what makes a too-low start
                # offset harmless (tansu's end offsets after batched produce).
                return None
            name = tp.topic
            known = self.names.get(name)
            if known is not None:
                topic = known
            elif name.startswith(HASHED):
                topic = f.topic or ""
                if not topic or not topic_matches(self.spec.pattern, topic):
                    return None
            else:
                topic = self.names[name] = unescape(name[len(self.d.prefix):])
            text_key = key.decode("utf-8", "replace") if key is not None else None
        offset = r.offset
        value = r.value
        at = f.published_at
        return Rec(tp, offset, topic, value if value is not None else b"", headers, text_key,
                   f.id or f"{tp.topic}-{tp.partition}-{offset}", f.attempt,
                   at if at is not None else r.timestamp / 1000, f.deliver_at or 0.0, f.hops)

    # -- application side ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise Closed(f"subscription to group {self.spec.name!r} is closed")
        if self.error is not None:
            raise native(self.error, f"consumer of {self.spec.name!r} failed", self.d.url)

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Hand out ready records, after a fenced commit of their partitions' checkpoints.

        The commit (``_fence``) stores the new delivery mark and lease deadline and the
        acks so far, and succeeds only while this consumer is a current member of the
        group: a consumer woken from a freeze longer than its session, or one that lost the
        partitions in a rebalance it has not seen yet, hands out nothing from its buffers
        (they go back, and are dropped when the revocation arrives). Bounded by a quarter
        lease: the portable layer's lease clock started at the call.
        """
        started = time.monotonic()
        deadline = started + timeout
        while True:
            picked: list[tuple[int, Rec]] = []
            with self.cv:
                self._check_open()
                self.waiting += 1
                try:
                    while not self.ready:
                        left = deadline - time.monotonic()
                        if left <= 0 or self.closed or self.error is not None:
                            break
                        self.cv.wait(left)
                    lease_until = time.time() + self.spec.lease
                    epoch = self.epoch
                    while self.ready and len(picked) < max_messages:
                        rec = self.ready.popleft()
                        part = self.parts.get(rec.tp)
                        if part is None:
                            continue
                        token = next(self.tokens)
                        rec.deadline = lease_until
                        self.leased[token] = rec
                        if rec.offset + 1 > part.mark:
                            part.mark = rec.offset + 1
                        if lease_until > part.deadline:
                            part.deadline = lease_until
                        picked.append((token, rec))
                    if picked and self.paused and self._drained():
                        self.cv.notify_all()  # the paused data thread fetches again
                finally:
                    self.waiting -= 1
                    self.last_receive = time.monotonic()
            if not picked:
                return []
            budget = min(max(self.spec.lease / 4, 0.25), self.d.opts["request_timeout_ms"] / 1000)
            try:
                self._fence(budget, force={rec.tp for _, rec in picked})
                with self.lock:
                    if self.epoch != epoch:
                        # Revoked between the pick and the commit: the commit may not have
                        # carried these partitions (no longer ours to commit), so it proves
                        # nothing for them.
                        raise LeaseExpired("a rebalance began during the receive")
                if time.monotonic() - started > self.spec.lease * 3 / 4:
                    # Frozen (or stalled) before or after the fence: the lease, counted by
                    # the portable layer from the call, is (nearly) over and the partition
                    # may have a new owner already. Hand nothing out (the records are
                    # covered by the mark just committed: attempt + 1 when delivered);
                    # the portable layer's next call starts a lease of its own.
                    deadline = 0.0
                    raise LeaseExpired("the receive call outlived 3/4 of the lease")
            except MQError as exc:
                log.info("kafka: %d records of %s not handed out: %s", len(picked),
                         self.spec.name, redact(str(exc))[:300])
                with self.cv:
                    back = []
                    for token, rec in picked:
                        self.leased.pop(token, None)
                        if rec.tp in self.parts:
                            back.append(rec)
                        elif rec.tp in self.suspended:
                            self.suspended[rec.tp][1].append(rec)
                    self.ready.extendleft(reversed(back))
                    left = deadline - time.monotonic()
                    if left > 0:
                        self.cv.wait(min(0.1, left))
                if time.monotonic() >= deadline:
                    return []
                continue
            return [Delivery(rec.id, rec.topic, rec.body, rec.headers, rec.key, 0, rec.n + 1,
                             rec.published_at, token) for token, rec in picked]

    def _fence_for(self, rec: Rec, move: bool = True) -> object:
        """``_fence`` before a settle re-publishes ``rec`` (nack, dead letter: ``move``,
        then ``_end_move`` after the write; returns the group snapshot for the
        transaction, ``_snapshot``) or extends its lease: wait out a rebalance within the
        lease; ``LeaseExpired`` when the partition is not ours any more."""
        end = time.monotonic() + min(max(0.5, rec.deadline - time.time()),
                                     self.d.opts["request_timeout_ms"] / 1000)
        while True:
            with self.lock:
                owned = rec.tp in self.parts
                suspended = rec.tp in self.suspended
                epoch = self.epoch
            if not owned and not suspended:
                raise LeaseExpired(f"message {rec.id}: its partition moved to another "
                                   "consumer of the group")
            left = end - time.monotonic()
            if owned and self.group.stable():  # (kafka-python's lock: not under ours)
                self._fence(max(0.05, left), force={rec.tp})
                if not move:
                    return None
                meta = self._snapshot()
                if self._begin_move(epoch):
                    return meta
                continue  # a revocation began: wait for the assignment
            if left <= 0:
                raise LeaseExpired(f"message {rec.id}: group {self.spec.name!r} is "
                                   "rebalancing")
            with self.cv:
                self.cv.wait(min(0.05, left))

    def _stale(self, token: Any, *more: Any) -> LeaseExpired:
        return LeaseExpired(f"kafka: receipt {token!r} of group {self.spec.name!r} is stale "
                            "(its partition moved to another consumer, which delivers the "
                            "message again)", receipts=(token, *more))

    def _settle(self, token: Any) -> Rec:
        """Take a leased record to settle it; ``LeaseExpired`` when the receipt is stale:
        the portable layer stops settles at its deadline, so here its partition was
        revoked (or the driver's own deadline, just after, passed)."""
        with self.lock:
            rec = self.leased.pop(token, None)
        if rec is None:
            raise self._stale(token)
        return rec

    def _done(self, rec: Rec) -> None:
        with self.lock:
            part = self.parts.get(rec.tp)
            if part is None:
                part = self.suspended.get(rec.tp, (None, None))[0]
            if part is not None:
                part.done.add(rec.offset)

    def ack(self, receipts: Sequence[Any]) -> None:
        stale: list[Any] = []
        with self.lock:
            for token in receipts:
                rec = self.leased.pop(token, None)
                if rec is None:
                    stale.append(token)  # the lease expired or the partition moved
                    continue
                part = self.parts.get(rec.tp) or self.suspended.get(rec.tp, (None, None))[0]
                if part is not None:
                    part.done.add(rec.offset)
        if stale:
            raise self._stale(*stale)

    def _relapse(self, rec: Rec, token: Any, deadline: float) -> None:
        """A re-publish or dead-letter write of a settled record failed (broker away):
        lease it again, so that it is retried when the lease runs out (or by the caller
        with the same receipt) instead of waiting for a rebalance. The failed write may
        have landed all the same, so the next one counts one more delivery: attempts may
        skip a number, never repeat."""
        with self.cv:
            rec.n += 1
            if rec.tp in self.parts or rec.tp in self.suspended:
                rec.deadline = deadline
                self.leased[token if token is not None else next(self.tokens)] = rec

    def _keep(self, rec: Rec, token: Any) -> None:
        """A settle that was refused before anything was written (``_fence_for`` failed):
        the record stays leased under its receipt; when the lease runs out it is
        re-published (if the partition is still ours) or left to the new owner."""
        with self.cv:
            if rec.tp in self.parts or rec.tp in self.suspended:
                self.leased[token] = rec

    def nack(self, receipt: Any, delay: float) -> None:
        rec = self._settle(receipt)
        try:
            # A consumer woken from a freeze (or that lost the partition) must not write a
            # copy: the partition's new owner delivers the original with a higher attempt.
            meta = self._fence_for(rec)
        except MQError:
            self._keep(rec, receipt)
            raise
        try:
            # (a settle made before the deadline takes effect: the transaction may end
            # after it, as the write did before; it is fenced all the same)
            self._transfer([(rec, self._copy(rec, rec.n + 1, delay))], meta,
                           self.d.opts["request_timeout_ms"] / 1000)
        except _Unknown:
            self._relapse(rec, receipt, rec.deadline)
            raise
        except MQError:
            self._keep(rec, receipt)  # nothing was written
            raise
        finally:
            self._end_move()

    def extend(self, receipt: Any, seconds: float) -> None:
        """Renew a lease. A longer deadline than the partition's checkpoint records is
        committed (fenced) first: a new owner of the partition (after a freeze or a
        rebalance) holds the record until then. On failure the lease is not renewed."""
        until = time.time() + seconds
        with self.lock:
            rec = self.leased.get(receipt)
            if rec is None:
                raise self._stale(receipt)  # the lease expired or the partition moved
            part = self.parts.get(rec.tp)
            if part is not None and part.deadline >= until:
                rec.deadline = until
                return
            if part is not None:
                part.deadline = until
        self._fence_for(rec, move=False)
        with self.lock:
            if self.leased.get(receipt) is rec:
                rec.deadline = until

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        rec = self._settle(receipt)
        headers = self._copy_headers(rec, dead_headers(reason, attempts, time.time()))
        topic = self.d.dead_topic(self.spec.name)
        try:
            self._fence_for(rec)  # as in nack: no copy once the partition is not ours
        except MQError:
            self._keep(rec, receipt)
            raise
        try:
            self.d.send_one(Outgoing(topic, rec.body, uuid.uuid4().hex.encode(), headers))
            self._done(rec)
        except MQError:
            self._relapse(rec, receipt, rec.deadline)
            raise
        finally:
            self._end_move()
        self._send_checkpoints(None)

    @staticmethod
    def _copy_headers(rec: Rec, changes: Mapping[str, int | float | str | None] = {},
                      ) -> list[tuple[str, bytes]]:
        """A re-published or dead-lettered copy's headers: the user's, then the wire
        schema's identity of the original (its Kafka key becomes ``mq-key``), then
        ``changes`` (None: left out)."""
        typed: dict[str, int | float | str | None] = {
            wire.ID: rec.id, wire.PUBLISHED_AT: rec.published_at, wire.TOPIC: rec.topic,
            wire.KEY: rec.key, **changes}
        headers = [(k, v.encode()) for k, v in rec.headers.items()]
        headers += [(k, wire.value(v).encode()) for k, v in typed.items() if v is not None]
        return headers

    def _copy(self, rec: Rec, delivered: int, delay: float, avoid_self: bool = False,
              hop: bool = False) -> Outgoing:
        """The record's copy for the group's retry topic, after ``delivered`` deliveries
        (the wire codec's attempt rule: its next delivery is ``delivered + 1``)."""
        due = time.time() + delay if delay > 0 else rec.due
        headers = self._copy_headers(rec, {
            **wire.retry_fields(delivered, due if due > time.time() else None),
            wire.HOPS: rec.hops + 1 if hop else 0})
        partition = None
        if self.spec.ordered and rec.key is not None:
            # Back to this member, on one retry partition per key: the portable layer's
            # gate here holds the key's later records until this one is settled, and
            # another member would hand it out beside them.
            mine = sorted(tp.partition for tp in list(self.parts) if tp.topic == self.retry)
            if mine:
                partition = mine[zlib.crc32(rec.key.encode()) % len(mine)]
        elif avoid_self:
            others = self._other_retry_partitions()
            if others:
                partition = random.choice(others)
        return Outgoing(self.retry, rec.body, rec.key.encode() if rec.key is not None else None,
                        headers, partition)

    def _part(self, tp: TP) -> Part | None:
        """(Under ``lock``.) The partition's state, also while suspended by a revocation."""
        return self.parts.get(tp) or self.suspended.get(tp, (None, None))[0]

    def _transfer(self, moves: Sequence[tuple[Rec, Outgoing]], meta: object,
                  budget: float) -> None:
        """Write the copies and commit the checkpoints that settle their originals in one
        Kafka transaction, its offset commit fenced by the generation in ``meta``.

        The lease rule needs this atomicity: a copy written after its original was handed
        out again by a new owner of the partition (a holder frozen between its fence and
        its write, evicted, then woken) carries a lower attempt than that delivery and is
        delivered after it. Here the zombie's TxnOffsetCommit is refused (its generation
        is over), its transaction aborted and its copy never read (``read_committed``);
        a new owner reads checkpoints with require_stable, so it waits while such a
        transaction is open and then sees the original settled exactly when the copy is
        visible. Held under ``commit_lock``, after every earlier commit of ours landed: a
        plain commit appended after the transaction's offsets would override them with
        a checkpoint in which the originals are not settled.

        Raises ``LeaseExpired`` (fenced: nothing written), ``Timeout`` and the like
        (nothing written), ``_Unknown`` (the outcome could not be read back).
        """
        end = time.monotonic() + budget
        if not self.commit_lock.acquire(timeout=max(0.05, budget)):
            raise Timeout(f"commits of {self.spec.name!r} busy for {budget:.2f}s")
        try:
            last = self.last_sent
            if last is not None:
                err = last.wait(max(0.05, end - time.monotonic()))
                if err is not None and err.kind is Kind.TIMEOUT:
                    raise Timeout(f"commit of {self.spec.name!r} not confirmed in time")
            with self.lock:
                offsets: dict[TP, tuple[int, str]] = {}
                for tp in {rec.tp for rec, _ in moves}:
                    part = self._part(tp)
                    if part is None:
                        raise LeaseExpired(f"partition {tp} of {self.spec.name!r} moved")
                    point, ckpt = part.checkpoint(
                        self.ckpt_limit, settle={rec.offset for rec, _ in moves if rec.tp == tp})
                    if point is None:
                        raise LeaseExpired(f"partition {tp} of {self.spec.name!r} not read")
                    offsets[tp] = (point, ckpt)
            try:
                if self.mover is None:
                    self.mover = self.d.client.mover(self.d.settings, self.txn_id)
                self.mover.move([out for _, out in moves], offsets, meta,
                                max(0.05, end - time.monotonic()))
            except ClientError as exc:
                if exc.kind is Kind.FATAL and not exc.doubt:
                    self._drop_mover()
                if not exc.doubt or not self._landed(offsets, exc):
                    if exc.kind is Kind.FENCED:
                        raise LeaseExpired(f"consumer of {self.spec.name!r} is no longer a "
                                           f"member of the current generation: {exc.native}"
                                           ) from exc
                    raise native(exc, f"re-publish of {self.spec.name!r} failed",
                                 self.d.url) from exc
            with self.lock:
                for rec, _ in moves:
                    part = self._part(rec.tp)
                    if part is not None:
                        part.done.add(rec.offset)
                for tp, sent in offsets.items():
                    part = self._part(tp)
                    if part is not None:
                        part.committed, part.meta = sent
                        part.confirmed, part.sent_meta = sent
        finally:
            self.commit_lock.release()

    def _landed(self, offsets: Mapping[TP, tuple[int, str]], failure: ClientError) -> bool:
        """Whether a transaction whose outcome is unknown committed: its checkpoints are
        the committed ones (the mover was replaced by one with the same transactional.id,
        which completed it; stable offsets are read). ``_Unknown`` when they cannot be
        read."""
        try:
            found = self.d.committed(self.spec.name, offsets)
        except MQError as exc:
            log.warning("kafka: outcome of a re-publish of %s unknown (%s; then %s)",
                        self.spec.name, failure, exc)
            raise _Unknown(f"re-publish of {self.spec.name!r}: outcome unknown") from exc
        return all(found.get(tp) == sent for tp, sent in offsets.items())

    def _drop_mover(self) -> None:
        mover, self.mover = self.mover, None
        if mover is not None:
            mover.close(0.5)

    def close(self) -> None:
        with self.cv:
            if self.closed:
                return
            self.closed = True
            self.cv.notify_all()
        self.stopping = True
        me = threading.current_thread()
        if self.data_thread is not me:
            self.data_thread.join(30)
        with self.lock:
            # Closing gives unsettled messages back: the next owner of our partitions need
            # not wait for their leases (their attempt still counts, through the mark).
            for part in self.parts.values():
                part.deadline = 0.0
        # The group thread last: its final commit covers what the data thread settled.
        self.group_stopping = True
        if self.group_thread is not me:
            self.group_thread.join(30)
        with self.commit_lock:
            self._drop_mover()
