"""Receivers: claims with ``FOR UPDATE SKIP LOCKED``, settles by (seq, token), and the idle
wait: on the store's ``Waker`` and never longer than ``poll_interval``, so lost NOTIFYs
only cost latency."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from psycopg.errors import SerializationFailure

from mqabstract.clock import SystemClock
from mqabstract.driver import DriverSubscription
from mqabstract.errors import Closed, LeaseExpired, MQError
from mqabstract.model import Delivery, GroupSpec

from .schema import DELAYED, READY, Settle, decode_headers
from .store import Store

__all__ = ["PostgreSQLSubscription"]

Receipt = tuple[int, int, int]  # seq, lease token, partition


class PostgreSQLSubscription(DriverSubscription):
    """One consumer of one group; receipts are ``(seq, lease token, partition)``."""

    def __init__(self, store: Store, spec: GroupSpec, gid: int) -> None:
        self._d = store
        self._gid = gid
        self._lease = spec.lease
        self._ordered = spec.ordered
        self._held: dict[int, Receipt] = {}  # seq -> the leases this consumer holds
        self._lock = threading.Lock()
        self._closed = False
        self._next_due: float | None = None

    def _try_claim(self, max_messages: int) -> list[Delivery]:
        now = self._d.now()
        token = random.getrandbits(62) or 1
        for attempt in (1, 2, 3):
            try:
                rows = self._claim(now, token, max_messages)
                break
            except MQError as exc:  # the rotation moved a row the claim had seen to
                # another partition (rotation.py: stragglers): look again
                if attempt == 3 or not isinstance(exc.__cause__, SerializationFailure):
                    raise
        rows.sort(key=lambda r: (-r[6], r[0]))
        out = []
        with self._lock:
            for seq, mid, topic, body, headers, key, prio, attempts, published, part in rows:
                self._held[seq] = receipt = (seq, token, part)
                out.append(Delivery(mid, topic, bytes(body), decode_headers(headers), key, prio,
                                    attempts, published, receipt))
        return out

    def _claim(self, now: float, token: int, max_messages: int) -> list[tuple[Any, ...]]:
        d, gid = self._d, self._gid
        hot = d.sql.hot(d.drained)
        with d.conn("receive") as conn:
            # One round trip: due rows become ready (skipping rows other claimers hold:
            # none waits on another) and the claim; when it got fewer than asked, another
            # for when the group's next row falls due (the idle wait's bound).
            with conn.pipeline():
                conn.execute(hot.promote, (gid, now))
                claimed = conn.execute(hot.claim_ordered if self._ordered else hot.claim,
                                       (now + self._lease, token, gid, max_messages),
                                       binary=True)
            rows = claimed.fetchall()
            row = conn.execute(hot.next_due, (gid,)).fetchone() \
                if len(rows) < max_messages else None
        self._next_due = None if row is None or row[0] is None else float(row[0])
        return rows

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        self._check_open()
        d = self._d
        deadline = time.monotonic() + timeout
        while True:
            seen = d.waker.stamp(self._gid)  # before looking: a wake meanwhile is not lost
            out = self._try_claim(max_messages)
            remaining = deadline - time.monotonic()
            if out or remaining <= 0 or self._closed or d.closed:
                return out
            wait = min(d.poll_interval, remaining)
            if self._next_due is not None and isinstance(d.clock, SystemClock):
                wait = min(wait, max(0.0, self._next_due - d.now()) + 0.001)
            d.waker.wait(self._gid, seen, wait)

    def _forget(self, receipts: Sequence[Receipt]) -> tuple[list[int], list[int], Settle]:
        """Seqs, tokens, and the settle statements for the receipts' partitions."""
        with self._lock:
            for seq, _, _ in receipts:
                self._held.pop(seq, None)
        return ([r[0] for r in receipts], [r[1] for r in receipts],
                self._d.sql.settle(tuple(sorted({r[2] for r in receipts}))))

    def ack(self, receipts: Sequence[Any]) -> None:
        self._check_open()
        if not receipts:
            return
        seqs, tokens, sql = self._forget(receipts)
        now = self._d.now()
        with self._d.conn("ack") as conn:
            if tokens.count(tokens[0]) == len(tokens):  # the usual: one array, not three
                conn.execute(sql.ack_one_claim, (seqs, now, tokens[0]))
            else:
                conn.execute(sql.ack, (seqs, now, tokens, seqs))
            if self._ordered:  # the key's next message may go now, to any process
                self._d.notify(conn, self._gid)

    def nack(self, receipt: Any, delay: float) -> None:
        self._check_open()
        self._release([receipt], delay)

    def _release(self, receipts: Sequence[Receipt], delay: float) -> None:
        seqs, tokens, sql = self._forget(receipts)
        now = self._d.now()
        state, due = (DELAYED, now + delay) if delay > 0 else (READY, 0.0)
        with self._d.conn("nack") as conn:
            if conn.execute(sql.release,
                            (state, due, seqs, now, tokens, seqs)).rowcount:
                self._d.notify(conn, self._gid)

    def extend(self, receipt: Any, seconds: float) -> None:
        self._check_open()
        now = self._d.now()
        with self._d.conn("extend") as conn:
            seq, token, part = receipt
            if not conn.execute(self._d.sql.settle((part,)).extend,
                                (now + seconds, seq, token, now)).rowcount:
                raise LeaseExpired("the lease ended or another consumer holds the message")

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        self._check_open()
        (seq,), (token,), sql = self._forget([receipt])
        now = self._d.now()
        with self._d.conn("dead_letter") as conn:
            if conn.execute(sql.dead_letter,
                            (seq, token, now, attempts, reason, now)).rowcount and self._ordered:
                self._d.notify(conn, self._gid)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("subscription is closed")
        self._d.check_open()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held, self._held = list(self._held.values()), {}
        if held and not self._d.closed:
            self._release(held, 0.0)
        self._d.waker.wake()
