"""The application side of a Kafka subscription: receive, the settles (ack, nack, extend,
dead letter) and close, called from any of the application's threads.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from mqabstract.driver import DriverSubscription
from mqabstract.emulation import dead_headers
from mqabstract.errors import Closed, LeaseExpired, MQError
from mqabstract.model import Delivery
from mqabstract.url import redact

from .client import Outgoing
from .errors import native
from .state import Part, Rec
from .sub_member import GroupMember, _Unknown

log = logging.getLogger("mqabstract.kafka")

__all__ = ["ApplicationSide"]


class ApplicationSide(GroupMember, DriverSubscription):
    """What the portable layer calls: hands out ready records after a fenced commit of
    their partitions, settles them (writes fenced the same way, and retried by the
    caller), and closes the two threads.

    Thread rules: any application thread; shared state only under ``lock``; records are
    handed out and copies written only after the member's fence (``_fence``,
    ``_fence_for``), copies through its transaction (``_transfer``).
    """

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
            picked: list[Rec] = []
            tokens: list[int] = []
            with self.cv:
                self._check_open()
                self.waiting += 1
                try:
                    while not self.ready:
                        left = deadline - time.monotonic()
                        if left <= 0 or self.closed or self.error is not None:
                            break
                        self.cv.wait(left)
                    ready = self.ready  # (after the wait: the data thread may replace it)
                    lease_until = time.time() + self.spec.lease
                    epoch = self.epoch
                    # Each partition's offsets in the order handed out, leased after the
                    # loop. Records come out in runs of one partition: the partition's
                    # state is looked up once per run (``run``: the state the last record
                    # was fetched into and still the partition's; the lock is held).
                    handed: dict[Part, list[int]] = {}
                    run: Part | None = None
                    offsets: list[int] = []
                    parts, leased, count = self.parts.get, self.leased, self.tokens
                    while ready and len(picked) < max_messages:
                        rec = ready.popleft()
                        if rec.part is not run or run is None:
                            part = parts(rec.tp)
                            if part is None or part is not rec.part:
                                continue  # (its partition was taken over afresh: stale)
                            run = part
                            offsets = handed.setdefault(part, [])
                        token = next(count)
                        rec.deadline = lease_until
                        leased[token] = rec
                        offsets.append(rec.offset)
                        picked.append(rec)
                        tokens.append(token)
                    for part, offsets in handed.items():  # (still under the lock)
                        part.lease_many(offsets, lease_until)
                    if picked and self.paused and self._drained():
                        self.cv.notify_all()  # the paused data thread fetches again
                finally:
                    self.waiting -= 1
                    self.last_receive = time.monotonic()
            if not picked:
                return []
            budget = min(max(self.spec.lease / 4, 0.25), self.d.opts["request_timeout_ms"] / 1000)
            try:
                self._fence(budget, force={rec.tp for rec in picked})
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
                    for token, rec in zip(tokens, picked, strict=True):
                        self.leased.pop(token, None)
                        owned = self._owned(rec)
                        if owned == "active":
                            back.append(rec)
                        elif owned == "suspended":
                            self.suspended[rec.tp][1].append(rec)
                    self.ready.extendleft(reversed(back))
                    left = deadline - time.monotonic()
                    if left > 0:
                        self.cv.wait(min(0.1, left))
                if time.monotonic() >= deadline:
                    return []
                continue
            return [Delivery(rec.id, rec.topic, rec.body, rec.headers, rec.key, 0, rec.n + 1,
                             rec.published_at, token)
                    for token, rec in zip(tokens, picked, strict=True)]

    def _fence_for(self, rec: Rec, move: bool = True) -> tuple[object, int | None] | None:
        """``_fence`` before a settle re-publishes ``rec`` (nack, dead letter: ``move``,
        then ``_end_move`` after the write; returns the group snapshot for the
        transaction, ``_snapshot``) or extends its lease: wait out a rebalance within the
        lease; ``LeaseExpired`` when the partition is not ours any more.

        The settle was admitted before its deadline, so it takes effect even when the
        commit lands after it (the record is out of the data thread's expiry meanwhile):
        the commit gets the whole request timeout, not what is left of the lease; only
        waiting for a rebalance to end is bounded by the lease."""
        request = self.d.opts["request_timeout_ms"] / 1000
        end = time.monotonic() + min(max(0.5, rec.deadline - time.time()), request)
        while True:
            with self.lock:
                state = self._owned(rec)
                epoch = self.epoch
            if state is None:
                raise LeaseExpired(f"message {rec.id}: its partition moved to another "
                                   "consumer of the group")
            left = end - time.monotonic()
            if state == "active" and self.group.stable():  # (kafka-python's lock: not ours)
                try:
                    self._fence(request, force={rec.tp})
                except LeaseExpired:
                    with self.lock:
                        revoked = self._owned(rec) == "suspended"
                    if not revoked or end - time.monotonic() <= 0:
                        raise
                    continue  # revoked during the fence: wait for the assignment
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
            if self._owned(rec) is not None:
                assert rec.part is not None
                rec.part.done.add(rec.offset)

    def ack(self, receipts: Sequence[Any]) -> None:
        stale: list[Any] = []
        with self.lock:
            for token in receipts:
                rec = self.leased.pop(token, None)
                if rec is None or self._owned(rec) is None:
                    stale.append(token)  # the lease expired or the partition moved
                    continue
                assert rec.part is not None
                rec.part.done.add(rec.offset)
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
            if self._owned(rec) is not None:
                rec.deadline = deadline
                self.leased[token if token is not None else next(self.tokens)] = rec

    def _keep(self, rec: Rec, token: Any) -> None:
        """A settle that was refused before anything was written (``_fence_for`` failed):
        the record stays leased under its receipt; when the lease runs out it is
        re-published (if the partition is still ours) or left to the new owner."""
        with self.cv:
            if self._owned(rec) is not None:
                self.leased[token] = rec

    def nack(self, receipt: Any, delay: float) -> None:
        rec = self._settle(receipt)
        try:
            # A consumer woken from a freeze (or that lost the partition) must not write a
            # copy: the partition's new owner delivers the original with a higher attempt.
            meta = self._fence_for(rec)
            assert meta is not None  # (a move: the snapshot)
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
        rebalance) holds the record until then. While the fence is in flight the data
        thread does not expire the record (the extend was admitted before its deadline
        and takes effect when the commit lands after it). On failure the lease is not
        renewed."""
        until = time.time() + seconds
        with self.lock:
            rec = self.leased.get(receipt)
            if rec is None:
                raise self._stale(receipt)  # the lease expired or the partition moved
            # (suspended by a revocation too: if the partition comes back, the fence
            # commits this deadline, else it fails)
            part = rec.part
            if part is None or self._owned(rec) is None:
                raise self._stale(receipt)  # taken over afresh meanwhile
            if part.lease_of(rec.offset) >= until:
                rec.deadline = until
                return
            # Not taken back if the fence fails: the commit may have landed, and an
            # extend that found this deadline recorded returned on it (above).
            part.lease(rec.offset, until)
            rec.fencing += 1
        fenced = False
        try:
            self._fence_for(rec, move=False)
            fenced = True
        finally:
            with self.lock:  # one critical section: the data thread sees the old
                rec.fencing -= 1  # deadline with the fence in flight or the new one
                renewed = fenced and self.leased.get(receipt) is rec
                if renewed:
                    rec.deadline = until
        if not renewed:
            # Its partition moved (the record left the leases) while the fence was in
            # flight: not renewed, and the caller must know.
            raise self._stale(receipt)

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
                part.release()
        # The group thread last: its final commit covers what the data thread settled.
        self.group_stopping = True
        if self.group_thread is not me:
            self.group_thread.join(30)
        with self.commit_lock:
            self._drop_mover()
