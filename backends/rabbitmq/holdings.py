"""What one RabbitMQ subscription holds, shared by the I/O thread and the caller threads.

Its own module so that both sides of a subscription (``consumer._Consumer`` on the I/O
thread, ``subscription.RabbitMQSubscription`` on the callers' threads) use one home for
this state and its lock, and neither has to reach into the other's."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

from mqabstract.clock import Clock
from mqabstract.emulation import LeaseTable
from mqabstract.errors import MQError
from mqabstract.model import GroupSpec

from .watchdog import _WATCH_GRACE, _WATCH_LIVE, _WATCH_SLACK, _WATCH_STEP, _socket_cut, _Watchdog
from .wire import _Raw

log = logging.getLogger("mqabstract.rabbitmq")


class _Holdings:
    """One subscription's messages and what the lease watchdog was told of them: the unread
    buffer (ordered by priority), the leases of what it handed out (the toolkit's
    ``LeaseTable``; a receipt is its token), acks not sent yet, copies of delivered messages
    on their way back to a queue, and the socket the watchdog guards.

    Concurrency: any thread, under ``lock`` (``cond`` is its condition); the ``_locked``
    methods expect it held, the others take it. ``want``, ``closed``, ``receiving`` and
    ``last_receive`` are also read without it, as flags. Watchdog reports go out under
    ``lock``."""

    def __init__(self, spec: GroupSpec, clock: Clock) -> None:
        self.spec = spec
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.buf: list[tuple[int, int, _Raw]] = []  # (-priority, seq, raw)
        self.seq = itertools.count()
        # (message, its attempt) by receipt token, on the driver's clock
        self.leases: LeaseTable[tuple[_Raw, int]] = LeaseTable(clock)
        self.acks: list[tuple[int, int]] = []
        self.want = False  # a consumer should be running
        self.closed = False
        self.receiving = 0
        self.last_receive = time.monotonic()
        self.lost_why = ""
        # Ordered groups (single active consumer): ids of messages this consumer sent back
        # to the queue (nack, an expired lease) -> until when it waits for them (monotonic).
        # While it holds a lease or waits for one of these it stays the active consumer,
        # so no other consumer gets the key's later messages before them.
        self.returning: dict[str, float] = {}
        self.patience = max(2 * spec.lease, 30.0)
        self.error: MQError | None = None
        # Copies of delivered messages whose original's ack is not committed yet (the
        # watchdog waits for them, and receive hands nothing out meanwhile), and their ids.
        self.inflight = 0
        self.copying: dict[str | None, int] = {}
        self.ch_gen = 0  # the consumer channel's generation (``_Raw.gen``)
        self.dog: _Watchdog | None = None
        self.dog_key: str | None = None
        self.dog_sent = math.nan  # the last release time reported to the watchdog
        self.sock: Any = None  # the watched socket
        self.cut_sock: Any = None  # a socket found cut, until its connection is replaced
        self.cut_gen = 0  # deliveries of channels up to this one are gone
        self.risk = math.nan  # until when the watchdog may (have) cut our socket

    # -- the watchdog (any thread; the ``_locked`` ones with self.lock held) ---------------
    def due_locked(self, now: float) -> tuple[float, bool]:
        """When this subscription would release something by itself if it were running, and
        whether that is a lease deadline: its earliest lease deadline; while it consumes (or
        buffers) holding no lease, now + _WATCH_LIVE; never while a copy of a delivered
        message is in flight."""
        if self.inflight > 0:
            return math.inf, False
        due = self.leases.next_deadline()
        if due is not None:
            return due, True
        if self.want or self.buf or self.receiving:
            return now + _WATCH_LIVE, False
        return math.inf, False

    def note_risk_locked(self, now: float) -> None:
        """Remember it when the reported release time + grace is (nearly) reached: the
        watchdog may cut the socket then, whatever we report next."""
        if self.dog_key is not None and now >= self.dog_sent + _WATCH_GRACE - _WATCH_STEP:
            until = self.dog_sent + _WATCH_GRACE + _WATCH_SLACK
            if not until <= self.risk:  # (also when risk is nan)
                self.risk = until

    def report_locked(self, now: float) -> None:
        dog, key = self.dog, self.dog_key
        if dog is None or key is None:
            return
        due, lease = self.due_locked(now)
        sent = self.dog_sent
        if due == sent or sent < due < sent + _WATCH_STEP:
            return  # a little later than reported: still after every deadline it guards
        if due < sent < math.inf and not lease:
            # Earlier, but not a lease deadline: the buffer of a consumer that holds no lease
            # may wait for the reported time (no later than a lease it just held). Saves two
            # reports per receive batch (a context switch each).
            return
        self.note_risk_locked(now)
        if dog.send(f"D {key} {due!r}"):
            self.dog_sent = due

    def sync_locked(self) -> None:
        """Before handing out or settling anything: if the watchdog may have cut our socket
        (this process was frozen past a reported release time + grace), check the socket;
        if it was cut, drop what came on it now (pika may run other callbacks before it
        reads the closed socket), so nothing the broker took back is handed out again."""
        now = time.monotonic()
        self.note_risk_locked(now)
        if self.risk != self.risk:  # nan: no risk
            return
        if self.sock is not None and _socket_cut(self.sock):
            log.warning("rabbitmq consumer of group %r was frozen past its lease deadline: "
                        "the watchdog handed its messages back to the broker", self.spec.name)
            self._cut_locked("frozen past the lease deadline; the watchdog closed it")
        elif now > self.risk:
            self.risk = math.nan

    def at_risk_locked(self) -> bool:
        """After ``sync_locked``: whether the watchdog may cut our socket any moment (we
        were frozen past a reported release time). Nothing goes back by copy then: a copy
        the broker got just before the cut would stand beside its original, which the cut
        hands back too (``consumer._Superseded``), for any consumer to get."""
        return self.risk == self.risk and self.sock is not None

    def _cut_locked(self, why: str) -> None:
        self.lost_why = why
        self.cut_sock = self.sock
        self.cut_gen = self.ch_gen
        self.dog = self.dog_key = None
        self.dog_sent = self.risk = math.nan
        self.forget_locked()

    def watch(self, sock: Any) -> None:
        """(I/O thread) give the watchdog this connection's socket (again after a restart)."""
        dog = _Watchdog.get()
        if dog is None:
            return
        key = str(next(_Watchdog.keys))
        with self.lock:
            if sock is self.cut_sock:
                return
            due = self.due_locked(time.monotonic())[0]
            if dog.send(f"W {key} {due!r}", sock.fileno()):
                self.dog, self.dog_key, self.dog_sent = dog, key, due
                self.sock, self.risk = sock, math.nan

    def unwatch(self) -> None:
        with self.lock:
            dog, key = self.dog, self.dog_key
            self.dog = self.dog_key = None
            self.sock = self.cut_sock = None
            self.dog_sent = self.risk = math.nan
        if dog is not None and key is not None:
            dog.send(f"X {key}")

    def release_done(self, count: int, ids: Sequence[str | None] = ()) -> None:
        with self.cond:
            self.inflight -= count
            for mid in ids:
                left = self.copying.get(mid, 0) - 1
                if left > 0:
                    self.copying[mid] = left
                else:
                    self.copying.pop(mid, None)
            self.report_locked(time.monotonic())
            self.cond.notify_all()

    # -- the buffer and the leases ---------------------------------------------------------
    def forget_locked(self) -> None:
        """The channel is gone: the broker redelivers everything it had given us, so the
        receipts are stale (settling one raises ``LeaseExpired``, as after a lease expiry)."""
        self.buf.clear()
        self.leases.clear()
        self.acks.clear()
        self.report_locked(time.monotonic())
        self.cond.notify_all()

    def set_error(self, err: MQError) -> None:
        with self.cond:
            self.error = err
            self.cond.notify_all()

    def expect_locked(self, ids: Sequence[str | None], delay: float) -> None:
        """Ordered groups: these messages went back to the queue and come again."""
        until = time.monotonic() + delay + self.patience
        for mid in ids:
            if mid is not None:
                self.returning[mid] = until

    def keeps_turn_locked(self, now: float) -> bool:
        """Ordered groups: whether this consumer must stay the queue's active one (it holds
        a lease, or a message it sent back has not come again yet): another consumer would
        get the key's later messages first."""
        if self.returning:
            for mid in [m for m, until in self.returning.items() if until <= now]:
                del self.returning[mid]
        return bool(len(self.leases) or self.returning)
