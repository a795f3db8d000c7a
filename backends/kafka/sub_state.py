"""The state a Kafka subscription's three sides share, and the helpers all of them use.

``KafkaSubscription`` is one object on two background threads and the application's:
the group member (``sub_member``: the group thread, commits, fencing, assign/revoke),
the data reader (``sub_reader``: the data thread, fetch, stall check, decode, hand-off)
and the application side (``sub_app``: receive, settles, close). Each is a class over
``SubscriptionState``, which holds every field they share, so that who may touch which
field under which lock is written in one place.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Mapping
from typing import Any

from mqabstract import wire
from mqabstract.model import GroupSpec

from .client import TP, Outgoing, Pending
from .cluster import KafkaCluster
from .state import CKPT_RANGES, Part, Rec

__all__ = ["HELD_FACTOR", "SubscriptionState"]

#: Held (delayed) records a consumer keeps before it stops fetching, in ``max_buffered``s.
HELD_FACTOR = 10


class SubscriptionState:
    """The fields of one subscription, shared by its group member, data reader and
    application side (the classes ``KafkaSubscription`` is made of).

    ``lock`` (``cv`` is its condition) guards the buffers (``ready``, ``held``,
    ``leased``), the partitions (``parts``, ``suspended``), the slots and the flags the
    threads read; ``commit_lock`` orders commits and the re-publish transactions. The
    data thread alone uses ``data`` and its bookkeeping (``data_assigned``,
    ``data_seen``, the topic lists); the group thread alone polls ``group``.
    """

    slot_count: int  # the group's retry partitions (set by ``KafkaSubscription``)
    regex: re.Pattern[str]  # the pattern's Kafka topic names
    group_thread: threading.Thread
    data_thread: threading.Thread

    def __init__(self, driver: KafkaCluster, spec: GroupSpec, declared_ms: int) -> None:
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
        self.mover_lock = threading.Lock()  # making or dropping ``mover``: one at a time
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
        self.slot_gen: int | None = None  # the generation whose assignment gave the slots
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
        # Consecutive rounds whose end-offset query the data consumer failed, and when a
        # new consumer may next be asked in its place (``_replace_if_cut_off``'s back-off).
        self.query_failures = 0
        self.next_fresh_probe = 0.0
        self.fresh_backoff = 0.0
        self.applied_version = -1
        self.topic_version = -1
        self.next_refresh = 0.0
        self.matched: set[str] = set()
        self.partitions: dict[str, set[int]] = {}
        self.names: dict[str, str] = {}  # Kafka topic -> mqabstract topic
        self.group: Any = None
        self.data: Any = None

    # -- buffer bounds (under ``lock``) -------------------------------------------------------
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

    # -- partitions -----------------------------------------------------------------------------
    def _part(self, tp: TP) -> Part | None:
        """(Under ``lock``.) The partition's state, also while suspended by a revocation."""
        return self.parts.get(tp) or self.suspended.get(tp, (None, None))[0]

    def _owned(self, rec: Rec) -> str | None:
        """(Under ``lock``.) Whether the partition state ``rec`` was fetched into is still
        the partition's: "active", "suspended" (revoked, may come back), or None — taken
        over afresh (a new ``Part``: its owner in between may have delivered the record;
        it is read again from the checkpoint) or gone. A record that was out (picked, in
        a failed settle or re-publish) while that happened must not come back: it would
        be handed out beside the new state's own copy, with its old attempt."""
        if rec.part is not None and self.parts.get(rec.tp) is rec.part:
            return "active"
        if rec.part is not None and self.suspended.get(rec.tp, (None, None))[0] is rec.part:
            return "suspended"
        return None

    def _other_retry_partitions(self) -> list[int]:
        parts = self.d.partitions_for(self.retry)
        mine = {tp.partition for tp in self.parts if tp.topic == self.retry}
        return sorted(set(parts) - mine)

    # -- copies for the retry topic (nack, lease expiry, hand-off) ------------------------------
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
