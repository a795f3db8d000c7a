"""The data reader of a Kafka subscription: the data thread, which fetches the matching
partitions of the member's slots, watches them for stalls, decodes records into the
buffers, expires leases, releases delayed records and hands idle ones to other members.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mqabstract import wire
from mqabstract.errors import LeaseExpired, MQError
from mqabstract.names import topic_matches
from mqabstract.url import redact

from .client import TP, Fetched, Reader
from .errors import Patience, transient
from .names import HASHED, INTERNAL, slot, unescape
from .state import Rec
from .sub_member import GroupMember, _Unknown, readable

log = logging.getLogger("mqabstract.kafka")

__all__ = ["DataReader"]

#: Most copies one transaction of ``_move`` writes.
_MOVE_CHUNK = 500
#: A data partition that fetched nothing for this long while the broker holds records
#: beyond its position is read again by a new data consumer (``_check_stalled``).
_STALL_AFTER = 10.0
#: Longest the end-offset query of that check may hold the data thread, and the most
#: partitions it asks about per round (the longest idle first).
_STALL_PROBE = 2.0
_STALL_PROBE_MAX = 32


class DataReader(GroupMember):
    """The group-less *data* consumer (``data``) and its thread: assigned by hand the
    partitions of the topics matching the pattern whose slot this member owns (new
    topics are read without a rebalance), replaced when it stops fetching.

    Thread rules: every method here runs on the data thread, except ``_ingest`` and
    ``_decode``, which the group thread calls too (records of the retry topic).
    """

    # -- data thread --------------------------------------------------------------------------
    def _run_data(self) -> None:
        pause = 0.0  # back-off while the broker does not answer
        patience = Patience()
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
                        patience.ok()
                        continue
                    recs = self.data.poll(self._poll_ms() / 1000, 1000)
                    if recs:
                        now = time.monotonic()
                        for tp in recs:
                            self.data_seen[tp] = now
                        self._ingest(recs)
                    pause = 0.0
                    patience.ok()
                    self._check_stalled()
                except Exception as exc:
                    # A broker restart or outage: retry; the subscription recovers with
                    # the broker (the same object, as the contract requires).
                    if not patience.retry(exc):
                        raise
                    if not transient(exc) and not pause:
                        log.warning("kafka: consumer of %s retries after an unknown broker "
                                    "error (stops after %.0f s of them): %s", self.spec.name,
                                    patience.limit, redact(str(exc))[:300])
                    elif not pause:
                        log.info("kafka: consumer of %s waits for the broker: %s",
                                 self.spec.name, redact(str(exc))[:300])
                    pause = min(max(pause * 2, 0.1), 2.0)
        except Exception as exc:
            log.warning("kafka: consumer of %s stopped: %s", self.spec.name, redact(str(exc)))
            self.error = exc
            # The member leaves too: its slots go to members that can read them (else
            # their records waited, undelivered, until the application closed this one).
            self.group_stopping = True
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
            version, slots, gen = self.slot_version, set(self.slots), self.slot_gen
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
                readable(committed)
                fresh, positions = (self._adopt(new, committed, version=version, gen=gen)
                                    or ([], {}))
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
        probe_end = now + _STALL_PROBE  # one bound for the whole round
        asking = idle[0]
        try:
            ends: dict[TP, int] = {}
            for asking in idle:
                left = probe_end - time.monotonic()
                if left <= 0:
                    break
                ends.update(self.data.end_offsets([asking], timeout=left))
            self.query_failures = 0
            self.fresh_backoff = 0.0
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
            self.query_failures += 1
            if self.query_failures >= 2 and time.monotonic() >= self.next_fresh_probe:
                self._replace_if_cut_off(asking, probe_end)
            return
        if not behind:
            return
        log.warning("kafka: consumer of %s fetched nothing for %.0fs from partitions with "
                    "records to read (position, end): %s; a new consumer takes over",
                    self.spec.name, _STALL_AFTER,
                    {f"{t}[{p}]": v for (t, p), v in sorted(behind.items())})
        try:
            self._renew_reader(self.d.client.reader(self.d.settings))
        except Exception as exc:
            log.warning("kafka: new consumer of %s not started (tried again in %.0fs): %s",
                        self.spec.name, _STALL_AFTER, redact(str(exc))[:300])
            return
        for tp, (_, end) in behind.items():
            self.stall_ends[tp] = end
        # A renewal that did not help (a producer's open transaction keeps the end ahead
        # of what read_committed returns) is not repeated every round.
        self.next_stall_check = time.monotonic() + _STALL_AFTER * 6

    def _replace_if_cut_off(self, tp: TP, probe_end: float) -> None:
        """After the data consumer failed to read ``tp``'s end offset two rounds in a row:
        ask a new consumer about ``tp``, and if that one can, the data consumer is cut off
        from brokers that are up, and the new one takes over.

        Seen in a whole-cluster restart (fault sitting of 27 Nov): every other client of
        the process reconnected, while librdkafka's data consumer failed every request with
        ``_ALL_BROKERS_DOWN`` for over a minute and fetched nothing, so the stall check,
        which asked that same consumer, could never act (28 confirmed ids undelivered).
        Two failed rounds (``_STALL_AFTER / 2`` apart), so a partition whose leader is just
        moving does not cost librdkafka's read-ahead. While the brokers are really away the
        new consumer fails too and is dropped, and the next one is asked only after a
        back-off doubling to a minute. The new consumer's query is bounded by what is left
        of the round, but given at least ``_STALL_PROBE / 4``: a round holds the data
        thread (lease expiry, delayed records) for at most 1.25 ``_STALL_PROBE``.
        """
        self.fresh_backoff = min(max(2 * self.fresh_backoff, _STALL_AFTER), 60.0)
        self.next_fresh_probe = time.monotonic() + self.fresh_backoff
        try:
            fresh = self.d.client.reader(self.d.settings)
        except Exception as exc:
            log.debug("kafka: stall check of %s: no new consumer: %s", self.spec.name,
                      redact(str(exc))[:300])
            return
        try:
            left = max(probe_end - time.monotonic(), _STALL_PROBE / 4)
            fresh.end_offsets([tp], timeout=left)
        except Exception as exc:  # the brokers are away for everyone: wait for them
            log.debug("kafka: stall check of %s: a new consumer cannot read either: %s",
                      self.spec.name, redact(str(exc))[:300])
            self._close_later(fresh)
            return
        log.warning("kafka: consumer of %s cannot reach the brokers while a new consumer "
                    "can; the new one takes over", self.spec.name)
        try:
            self._renew_reader(fresh)
        except Exception as exc:
            log.warning("kafka: new consumer of %s not started (tried again in %.0fs): %s",
                        self.spec.name, self.fresh_backoff, redact(str(exc))[:300])
            return
        self.query_failures = 0
        self.fresh_backoff = 0.0
        self.next_stall_check = time.monotonic() + _STALL_AFTER

    def _close_later(self, reader: Reader) -> None:
        """Close a consumer off the data thread: a wedged one's close may hang."""
        threading.Thread(target=reader.close, name=f"mqa-kafka-close-{self.spec.name}",
                         daemon=True).start()

    def _renew_reader(self, new: Reader) -> None:
        """Replace the data consumer by ``new`` (a fresh reader, which this takes over and
        closes on failure) at the same assignment and positions: the partitions we own at
        their positions; the others (taken back or adopted later) are positioned by
        ``_refresh_data`` as before. Positions are what the old consumer knows locally: a
        partition it has no record position for starts from the beginning in the new one
        too, as it would have in the old."""
        with self.lock:
            owned = [tp for tp in self.data_assigned if tp in self.parts]
        old = self.data
        try:
            positions = {tp: old.known_position(tp) for tp in owned}
            new.assign(self.data_assigned)
            new.seek(positions)
        except Exception:
            self._close_later(new)
            raise
        self.data = new
        now = time.monotonic()
        for tp in positions:
            self.data_seen[tp] = now
        self._close_later(old)  # it may be wedged

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
            # The first lease end, but not sooner than in 50 ms (an expired lease on a
            # suspended partition waits for the assignment); one whose extend is in flight
            # waits for the extend. One pass: the loop runs with every lease held.
            ends = [rec.deadline for rec in self.leased.values() if not rec.fencing]
            if ends:
                wake = min(wake, max(min(ends), now + 0.05))
            if self.ready and not self.waiting:
                wake = min(wake, now + self.d.opts["handoff_ms"] / 2000)
        return int(max(0.005, wake - now) * 1000)

    # -- leases, delayed records, hand-off ------------------------------------------------------
    def _tick(self) -> None:
        now = time.time()
        expired: list[Rec] = []
        handoff: list[Rec] = []
        with self.cv:
            ended = [(token, rec) for token, rec in self.leased.items()
                     if rec.deadline <= now and not rec.fencing]  # (an extend in flight: kept)
            for token, rec in ended:
                owned = self._owned(rec)
                if owned == "active":
                    del self.leased[token]
                    expired.append(rec)
                elif owned is None:
                    del self.leased[token]  # the partition moved: its owner redelivers
                # else: revoked for a rebalance; decided when the assignment settles
            released = False
            while self.held and self.held[0][0] <= now:
                _, _, rec = heapq.heappop(self.held)
                if self._owned(rec) == "active":
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

    def _fence_tick(self, expired: list[Rec], handoff: list[Rec], epoch: int
                    ) -> tuple[object, int | None] | None:
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

    def _put_back(self, expired: Collection[Rec], handoff: Sequence[Rec]) -> None:
        """Records whose copy was not written: the leases are kept (tried again shortly,
        or dropped when the partition turns out to have moved), the hand-offs are ready
        again (with their partition's stash while it is suspended)."""
        with self.cv:
            retry_at = time.time() + 0.5
            for rec in expired:
                if self._owned(rec) is not None:
                    rec.deadline = retry_at
                    self.leased[next(self.tokens)] = rec
            mono = time.monotonic()
            for rec in reversed(handoff):
                owned = self._owned(rec)
                if owned == "active":
                    rec.since = mono
                    self.ready.appendleft(rec)
                elif owned == "suspended":
                    self.suspended[rec.tp][1].insert(0, rec)
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

    # -- fetched records into the buffers (both threads) ----------------------------------------
    def _ingest(self, batches: Mapping[TP, list[Fetched]]) -> None:
        # Decoded before taking the lock: receive, ack and commits wait on it.
        mono = time.monotonic()
        decoded = [(tp, [r.offset for r in records], self._decode(tp, records, mono))
                   for tp, records in batches.items() if records]
        now = time.time()
        with self.cv:
            ready = self.ready  # (replaced only under the lock)
            before = len(ready)
            for tp, offsets, recs in decoded:
                part = self.parts.get(tp)
                if part is None:
                    continue  # not (or no longer) ours: its owner reads it
                part.fetched_many(offsets)
                inherited = part.inherited
                done = part.done
                for offset, rec in zip(offsets, recs, strict=True):
                    if offset < inherited:
                        if offset in done:
                            continue  # settled by an earlier owner (its checkpoint says so)
                        if rec is None:
                            done.add(offset)
                            continue
                        # Handed to an application by owners that died, froze or lost the
                        # partition before settling it: one attempt more than any of them
                        # gave, and not before the last lease on its step ends.
                        rec.n += part.extra_attempts(offset)
                        hold = min(part.hold_for(offset), now + self.d.capabilities.max_lease)
                        rec.due = max(rec.due, hold)
                    elif rec is None:
                        done.add(offset)
                        continue
                    rec.part = part
                    if rec.due > now:
                        heapq.heappush(self.held, (rec.due, next(self.seq), rec))
                    else:
                        ready.append(rec)
            if len(ready) > before:
                self.cv.notify_all()

    def _decode(self, tp: TP, records: Sequence[Any], since: float = 0.0
                ) -> list[Rec | None]:
        """Fetched records of one partition as ``Rec``s (ready since ``since``); None for
        records this group must skip. The wire-schema headers go to their fields (defaults
        for records of plain clients). One loop per partition, what is per partition
        resolved once: every record passes here."""
        received = wire.received
        out: list[Rec | None] = []
        add = out.append
        name = tp.topic
        retry = name == self.retry
        topic = ""
        hashed = False
        declared = self.declared_ms
        if not retry:
            known = self.names.get(name)
            hashed = known is None and name.startswith(HASHED)
            if known is not None:
                topic = known
            elif not hashed:
                topic = self.names[name] = unescape(name[len(self.d.prefix):])
        for r in records:
            if not retry and r.timestamp < declared:
                # Published before the group existed. Also what makes a too-low start
                # offset harmless (tansu's end offsets after batched produce).
                add(None)
                continue
            headers, (mid, n, at, due, text_key, mq_topic, hops) = received(r.headers or [])
            key = r.key
            if retry:
                topic = mq_topic or ""
                if text_key is None and key is not None:
                    text_key = key.decode("utf-8", "replace")
            else:
                if hashed:
                    topic = mq_topic or ""
                    if not topic or not topic_matches(self.spec.pattern, topic):
                        add(None)
                        continue
                text_key = key.decode("utf-8", "replace") if key is not None else None
            offset = r.offset
            value = r.value
            add(Rec(tp, offset, topic, value if value is not None else b"", headers, text_key,
                    mid or f"{name}-{tp.partition}-{offset}", n,
                    at if at is not None else r.timestamp / 1000, due or 0.0, hops, since))
        return out
