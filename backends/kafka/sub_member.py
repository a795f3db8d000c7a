"""The group member of a Kafka subscription: the group thread, offset commits, fencing,
assignments and revocations, and the transactions that re-publish records.

Every record is handed out or re-published only after a commit of this member succeeded
(``_fence``): the coordinator checks it against the member's generation, so a member that
lost its partitions (a freeze, a rebalance it has not seen yet) writes nothing. The data
reader and the application side both build on that, hence on this class.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from mqabstract.errors import Closed, LeaseExpired, MQError, Timeout
from mqabstract.url import redact

from .client import TP, ClientError, Fetched, Kind, Mover, Outgoing, Pending
from .errors import Patience, native
from .names import slot
from .state import Checkpoint, Part, Rec
from .sub_state import SubscriptionState

log = logging.getLogger("mqabstract.kafka")

__all__ = ["GroupMember"]

#: Longest a revocation waits for re-publishes in flight (it may run on the client's I/O
#: thread, so heartbeats wait as long).
_MOVING_WAIT = 3.0
#: A member without an assignment for this many rebalance timeouts (plus 10 s) while the
#: cluster answers is replaced (``_watch_membership``).
STUCK_REBALANCES = 2.0


def readable(committed: Mapping[TP, tuple[int, str] | None]) -> None:
    """Decode every checkpoint of an assignment before any state changes: one of a later
    format raises ``Unsupported`` here, not halfway through ``_adopt``."""
    for found in committed.values():
        if found is not None:
            Checkpoint.decode(found[1])


class _Unknown(Timeout):
    """A re-publish transaction whose outcome could not be found out (the broker away
    after its commit began): the copy may or may not be there."""


class GroupMember(SubscriptionState):
    """The Kafka consumer-group member (``group``) and its thread: keeps the membership,
    takes assignments, commits the checkpoints of every partition (data ones too: a
    commit is checked against the generation, not the assignment) and writes the
    re-publish transactions fenced by that generation.

    Thread rules: ``_run_group`` (and ``_commit``, ``_take_assignment``) run on the group
    thread; the rebalance listeners (``revoked``, ``assigned``) are called by the group
    consumer, inside its poll or on its client's I/O thread; commits (``_fence``,
    ``_send_checkpoints``), ``_transfer`` and the move counter (``_begin_move`` /
    ``_end_move``) are called from any thread.
    """

    if TYPE_CHECKING:
        def _ingest(self, batches: Mapping[TP, list[Fetched]]) -> None:
            """Fetched records into the buffers (``DataReader._ingest``)."""

    # -- group thread ------------------------------------------------------------------------
    def _run_group(self) -> None:
        retry_at = 0.0  # when to position a new assignment again after a failure
        polls, takes = Patience(), Patience()
        unassigned_since = time.monotonic()
        try:
            while not self.group_stopping:
                unassigned_since = self._watch_membership(unassigned_since)
                try:
                    recs = self.group.poll(0.2, 1000)
                    polls.ok()
                except Exception as exc:
                    # A poll can raise the connection error of a coordinator lookup made
                    # while the broker is down; the same consumer works again once the
                    # broker is back.
                    if not polls.retry(exc):
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
                        takes.ok()
                    except Exception as exc:
                        if not takes.retry(exc):
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

    def _watch_membership(self, since: float) -> float:
        """(Group thread.) Replace a member that has had no assignment for
        ``STUCK_REBALANCES`` rebalance timeouts (+10 s) while the cluster answers; returns
        when the current stretch without one began (now while assigned).

        A rebalance ends within the rebalance timeout (``max_poll_interval_ms``) of its
        members, or drops those that do not rejoin. After a whole-cluster restart
        librdkafka's member once never rejoined: revoked, then no assignment for minutes
        while the brokers answered everyone else, so the group stopped in silence (session
        22's sitting; the same client's data consumer was once cut off the same way, see
        ``_check_stalled``). A new member joins as any new consumer does and takes the
        partitions over from their checkpoints."""
        now = time.monotonic()
        if self.group.stable():
            return now
        opts = self.d.opts
        limit = float(STUCK_REBALANCES * max(opts["max_poll_interval_ms"],
                                             opts["session_timeout_ms"]) / 1000 + 10.0)
        if now - since < limit:
            return since
        try:
            self.d.cluster_size()  # (the cluster answers: else wait for it, as before)
            fresh = self.d.client.member(self.d.settings, self.spec.name, self.retry,
                                         self.revoked, self.assigned)
        except Exception as exc:
            log.info("kafka: member of %s without an assignment for %.0f s, not replaced: %s",
                     self.spec.name, now - since, redact(str(exc))[:300])
            return now - limit + 5.0  # asked again in 5 s
        log.warning("kafka: member of %s had no assignment for %.0f s while the cluster "
                    "answers: replaced by a new member", self.spec.name, now - since)
        old, self.group = self.group, fresh
        # Off this thread: a wedged consumer's close may hang.
        threading.Thread(target=old.close, name=f"mqa-kafka-close-{self.spec.name}",
                         daemon=True).start()
        return time.monotonic()

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

    def _checkpoints(self, force: Collection[TP], gen: int | None
                     ) -> tuple[dict[TP, tuple[int, str]], set[TP]]:
        """The checkpoints that changed since last sent, plus those of ``force``; and the
        partitions left out because they were not assigned to us in generation ``gen``,
        the member's current one (a commit in ``gen`` would land, and overwrite what
        their owner in ``gen`` committed)."""
        offsets: dict[TP, tuple[int, str]] = {}
        foreign: set[TP] = set()
        with self.lock:
            for tp, part in self.parts.items():
                if gen is not None and part.gen is not None and part.gen != gen:
                    foreign.add(tp)
                    continue
                point, meta = part.checkpoint(self.ckpt_limit)
                if point is None:
                    continue
                if point != part.committed or meta != part.meta or tp in force:
                    offsets[tp] = (point, meta)
                    part.committed, part.meta = point, meta
        return offsets, foreign

    def _schedule(self, force: Collection[TP], patience: float = -1
                  ) -> tuple[Pending | None, int | None, set[TP], set[TP]]:
        """Send the changed checkpoints (plus those of ``force``) as one commit. Returns
        its Pending (None when there was nothing to send, or ``commit_lock`` was not free
        within ``patience``), the generation it was built in, the partitions left out
        as not ours in that generation (``_checkpoints``) and those the commit carries.

        Built and sent under ``commit_lock``: commits go out in the order their contents
        were read, so a later commit never carries an older mark. A client may commit
        synchronously under it (confluent-kafka), so a rebalance listener, which can run
        inside the poll such a commit waits for, passes a ``patience``. The commit is
        tied to the membership it was built in: the client does not send it once that
        changed (``Member.commit``'s ``expect``).
        """
        if not self.commit_lock.acquire(timeout=patience):
            return None, None, set(), set()
        try:
            membership, gen = self.group.group_meta()
            offsets, foreign = self._checkpoints(force, gen)
            if not offsets:
                return None, gen, foreign, set()
            sent: Pending = self.group.commit(
                offsets, lambda err: self._committed(offsets, err), expect=membership)
            self.last_sent = sent
            return sent, gen, foreign, set(offsets)
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

        A partition of ``force`` that the commit does not carry (revoked meanwhile, or
        never read here) is not proven ours: ``LeaseExpired``. A revocation raises the
        epoch before it sets its partitions aside, so a receive that picked in between
        and fenced after it saw its own epoch unchanged, and an empty commit proved
        nothing: that receive handed out records the partition's next owner delivered
        again with the same attempt (the chaos run's ``[1, 1]``, session 23).

        Raises ``LeaseExpired`` when membership is lost or a rebalance is under way,
        ``Timeout`` / ``ConnectionFailed`` when the coordinator does not answer in time.
        """
        if not self.group.stable():
            raise LeaseExpired(f"group {self.spec.name!r} is rebalancing")
        try:
            sent, gen, foreign, carried = self._schedule(force)
        except ClientError as exc:
            if exc.kind is Kind.FENCED:
                raise LeaseExpired(f"consumer of {self.spec.name!r}: {exc}") from exc
            raise native(exc, f"commit of {self.spec.name!r} failed", self.d.url) from exc
        if foreign & set(force):
            # Kept from an earlier generation that the client moved on from without
            # revoking them here: a commit in this one proves nothing for them.
            raise LeaseExpired(f"partitions {sorted(foreign & set(force))} of "
                               f"{self.spec.name!r} are not ours in generation {gen}")
        missing = set(force) - carried
        if missing:
            raise LeaseExpired(f"partitions {sorted(missing)} of {self.spec.name!r} were "
                               "revoked (or not read here): a commit proves nothing for them")
        if sent is None:
            return
        err = sent.wait(max(0.05, budget))
        if err is None:
            if gen is not None and self._generation() != gen:
                # Sent (and accepted) in a later generation than it was built in: it
                # proves nothing for the partitions we had in ``gen``.
                raise LeaseExpired(f"consumer of {self.spec.name!r} changed generation "
                                   "during its commit")
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

    def _generation(self) -> int | None:
        """The member's current generation (None: the client does not tell; -1: not a
        member)."""
        try:
            snapshot: tuple[object, int | None] = self.group.group_meta()
        except ClientError:
            return -1
        return snapshot[1]

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
            self._suspend(gone)
            self.slots -= slots
            self.slot_version += 1

    def _suspend(self, gone: Collection[TP]) -> None:
        """(``cv`` held.) Set revoked partitions aside with their ready and held records
        until the next assignment tells whether they come back (``_adopt``)."""
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
        # The generation of this assignment: read after it arrived and before the epoch
        # check in _adopt (a later generation comes with a revocation, which that sees).
        gen = self._generation()
        try:
            committed = self.d.committed(self.spec.name, assigned) if assigned else {}
            readable(committed)
        except Exception:
            with self.lock:  # retried by the group thread unless a newer one came
                if self.new_assignment is None:
                    self.new_assignment = assigned
            raise
        adopted = self._adopt(assigned, committed, epoch=epoch, gen=gen)
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
            self.slot_gen = gen
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
               epoch: int | None = None, version: int | None = None,
               gen: int | None = None) -> tuple[list[TP], dict[TP, int | None]] | None:
        """Take partitions over: keep our in-flight state where nobody committed since we
        had them (the stored checkpoint is still the one we sent: another owner that handed
        anything out would have committed its own first). Returns the partitions that need
        a start position (a fresh partition starts from its checkpoint, ``Part``) and the
        positions of those taken back.

        None, adopting nothing, when the assignment is stale: revoked again (``epoch``) or
        the slots changed (``version``) since it was read. Adopting it would make this
        member hand out records of partitions another member owns: the coordinator checks
        commits against the generation, not the assignment.

        ``gen``: the generation of the assignment; the partitions adopted are ours in it
        (``Part.gen``). A new assignment (``epoch`` given) also sets aside, as if revoked,
        any partition still held from an earlier generation: an eager rebalance revokes
        everything before it reassigns, so such a partition was lost without a revocation
        reaching us, and its buffers and leases are stale unless it comes back with the
        checkpoint we left."""
        fresh: list[TP] = []
        back: dict[TP, int | None] = {}
        with self.cv:
            if ((epoch is not None and epoch != self.epoch)
                    or (version is not None and version != self.slot_version)):
                return None
            if epoch is not None and gen is not None:
                stale = [tp for tp, part in self.parts.items()
                         if part.gen is not None and part.gen != gen]
                if stale:
                    log.warning("kafka: %s held %s from generation(s) %s into generation %s "
                                "without a revocation: set aside", self.spec.name,
                                sorted(stale), {self.parts[tp].gen for tp in stale},
                                gen)
                    self._suspend(stale)
                    self.epoch += 1  # receives and re-publishes that picked them fail
                    self.slot_version += 1
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
                    part.gen = gen
                    self.parts[tp] = part
                    back[tp] = part.next_fetch
                    for rec in stash:
                        if rec.due > now:
                            heapq.heappush(self.held, (rec.due, next(self.seq), rec))
                        else:
                            self.ready.append(rec)
                    continue
                self.parts[tp] = Part(found)
                self.parts[tp].gen = gen
                log.debug("kafka: %s takes %s over (checkpoint %s)", self.spec.name, tp,
                          stored)
                fresh.append(tp)
            # Leases on partitions that are not ours any more are stale now.
            for token, rec in list(self.leased.items()):
                if rec.tp in fresh:
                    del self.leased[token]
            self.cv.notify_all()
        return fresh, back

    # -- re-publishing (any thread) -----------------------------------------------------------
    def _snapshot(self) -> tuple[object, int | None]:
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
        return meta, generation

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

    def _transfer(self, moves: Sequence[tuple[Rec, Outgoing]],
                  snapshot: tuple[object, int | None], budget: float) -> None:
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

        The transaction is fenced by the generation of ``snapshot`` (``_snapshot``): only
        partitions assigned to us in that generation (``Part.gen``) are written for.

        Raises ``LeaseExpired`` (fenced: nothing written), ``Timeout`` and the like
        (nothing written), ``_Unknown`` (the outcome could not be read back).
        """
        meta, gen = snapshot
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
                    if part is None or any(rec.part is not part for rec, _ in moves
                                           if rec.tp == tp):
                        raise LeaseExpired(f"partition {tp} of {self.spec.name!r} moved")
                    if gen is not None and part.gen is not None and part.gen != gen:
                        raise LeaseExpired(f"partition {tp} of {self.spec.name!r} is not ours "
                                           f"in generation {gen}")
                    point, ckpt = part.checkpoint(
                        self.ckpt_limit, settle={rec.offset for rec, _ in moves if rec.tp == tp})
                    if point is None:
                        raise LeaseExpired(f"partition {tp} of {self.spec.name!r} not read")
                    offsets[tp] = (point, ckpt)
            try:
                self._mover(end).move([out for _, out in moves], offsets, meta,
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

    def _mover(self, end: float) -> Mover:
        """This consumer's transactional producer, made on first use (or by ``warm_mover``;
        two with one transactional.id would fence each other: made under ``mover_lock``).
        Waits for a making in flight until ``end`` (monotonic), then ``Timeout``: nothing
        was written."""
        if not self.mover_lock.acquire(timeout=max(0.05, end - time.monotonic())):
            raise Timeout(f"the transactional producer of {self.spec.name!r} is being made")
        try:
            if self.closed:
                raise Closed(f"the subscription to {self.spec.name!r} is closed")
            if self.mover is None:
                self.mover = self.d.client.mover(self.d.settings, self.txn_id)
            mover: Mover = self.mover
            return mover
        finally:
            self.mover_lock.release()

    def warm_mover(self) -> None:
        """Make the transactional producer ahead of the first re-publish (a thread started
        at subscribe, beside the join): its ``init_transactions`` took 0.06-0.5 s on an idle
        broker, which the first nack, or the first expired lease, paid inside its lease.
        On failure it is made at first use, which reports the error to its caller."""
        try:
            self._mover(time.monotonic() + self.d.opts["request_timeout_ms"] / 1000)
        except Closed:
            pass
        except Exception as exc:  # (a thread's end: logged, never raised)
            transient = isinstance(exc, Timeout) or (
                isinstance(exc, ClientError) and exc.kind in (Kind.TRANSIENT, Kind.TIMEOUT))
            log.log(logging.DEBUG if transient else logging.WARNING,
                    "kafka: the transactional producer of %s could not be made ahead "
                    "(made again at the first re-publish): %s", self.spec.name, exc)

    def _drop_mover(self) -> None:
        with self.mover_lock:
            mover, self.mover = self.mover, None
        if mover is not None:
            mover.close(0.5)
