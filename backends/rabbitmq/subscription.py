"""A RabbitMQ group's consumer side: receipts and the subscription."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions as pex

from mqabstract.driver import DriverSubscription
from mqabstract.emulation import LeaseTable, dead_headers
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    LeaseExpired,
    MQError,
    NotFound,
)
from mqabstract.model import Delivery, GroupSpec
from mqabstract.url import redact

from .io import _CONN_ERRORS, _Confirms, _describe, _Item, _Pending
from .watchdog import _WATCH_GRACE, _WATCH_LIVE, _WATCH_SLACK, _WATCH_STEP, _socket_cut, _Watchdog
from .wire import H_DUE, H_TOPIC, _copy_props, _Raw

if TYPE_CHECKING:
    from .driver import RabbitMQDriver


log = logging.getLogger("mqabstract.rabbitmq")

_CHANNEL_GEN = itertools.count(1)


class RabbitMQSubscription(DriverSubscription):
    """One consumer on a group queue: a connection and channel of its own (closing it
    hands back exactly this subscription's messages), a local buffer ordered by priority,
    driver-kept leases (the toolkit's ``LeaseTable``; a receipt is its token) that the lease
    watchdog backs up when this process freezes. Started lazily on the first ``receive``
    and stopped (its unread buffer handed back) when nobody has called ``receive`` for a
    while, so an idle consumer never sits on messages that another one could take.

    Concurrency: ``receive``, ``ack``, ``nack``, ``extend``, ``dead_letter`` and ``close``
    run on application threads and share state with the I/O thread under ``_lock`` (the
    ``_locked`` methods expect it held); the ``_io_*`` methods and ``_io_tick`` run on the
    ``_Link`` I/O thread only, and application threads reach the pika objects through
    ``_link.call``. Watchdog reports go out under ``_lock``. Never retried: a settle of a
    stale receipt (expired, or its channel gone) raises ``LeaseExpired`` (the broker
    delivers the message again), and a nack or dead-letter whose transaction was not
    committed raises instead of being sent again (the broker delivers the message again).

    Messages go back to the queue by copy (a nack, an expired lease, the unread buffer, a
    classic redelivery with its attempt written down). The consumer channel runs in AMQP
    transaction mode: a copy into the group's own queue is published and its original acked
    in one ``tx.commit``, so both take effect or neither (confirmed-then-acked instead, a
    cut between the two left both alive: the original came back counted, attempt + 1,
    after or before a copy with the same or a lower attempt). A copy into another queue (a
    wait tier, the dead-letter queue) is confirmed first on the copy channel and its
    original acked in the next transaction: RabbitMQ applies a commit's acks without
    waiting for another queue to store its publishes, so a broker crash mid-commit could
    lose it; a cut between its confirm and that commit still leaves both.
    """

    def __init__(self, driver: RabbitMQDriver, spec: GroupSpec) -> None:
        self._driver = driver
        self._link = driver._link
        self.spec = spec
        self.queue = driver._group_queue(spec.name)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._buf: list[tuple[int, int, _Raw]] = []  # (-priority, seq, raw)
        self._seq = itertools.count()
        # (message, its attempt) by receipt token, on the driver's clock
        self._leases: LeaseTable[tuple[_Raw, int]] = LeaseTable(driver.clock)
        self._acks: list[tuple[int, int]] = []
        self._want = False  # a consumer should be running
        self._conn: Any = None  # this subscription's SelectConnection, when there is one
        self._failures = 0
        self._retry: Any = None  # reconnect timer
        self._close_done: threading.Event | None = None
        self._lost_why = ""
        self._ch: Any = None
        self._ch_gen = 0
        self._ctag: str | None = None
        self._cancelling = False
        self._closed = False
        self._receiving = 0
        self._last_receive = time.monotonic()
        self._idle = min(1.0, max(0.2, spec.lease / 2))
        # Ordered groups (single active consumer): ids of messages this consumer sent back
        # to the queue (nack, an expired lease) -> until when it waits for them (monotonic).
        # While it holds a lease or waits for one of these it stays the active consumer,
        # so no other consumer gets the key's later messages before them.
        self._returning: dict[str, float] = {}
        self._patience = max(2 * spec.lease, 30.0)
        self._error: MQError | None = None
        # Copies of delivered messages whose transaction is not committed yet (the
        # watchdog waits for them, and receive hands nothing out meanwhile), and their ids.
        self._inflight = 0
        self._copying: dict[str | None, int] = {}
        self._dog: _Watchdog | None = None
        self._dog_key: str | None = None
        self._dog_sent = math.nan  # the last release time reported to the watchdog
        self._sock: Any = None  # the watched socket
        self._cut_sock: Any = None  # a socket found cut, until its connection is replaced
        self._cut_gen = 0  # deliveries of channels up to this one are gone
        self._risk = math.nan  # until when the watchdog may (have) cut our socket
        # The consumer channel's transactions (``_io_pump``): what the next one publishes
        # and acks, what to run when it is committed (True) or its channel goes first
        # (False); the channel whose tx.commit is unanswered and what that one runs then.
        self._tx_copies: list[tuple[_Raw, _Item]] = []
        self._tx_acks: list[int] = []
        self._tx_requeues: list[int] = []
        self._tx_then: list[Callable[[bool], None]] = []
        self._tx_busy: Any = None
        self._tx_busy_then: list[Callable[[bool], None]] = []
        self._pub_ch: Any = None  # confirm channel for copies into other queues
        self._confirms = _Confirms()
        self._link.subs.add(self)

    # -- the watchdog (any thread; the ``_locked`` ones with self._lock held) --------------
    def _due_locked(self, now: float) -> tuple[float, bool]:
        """When this subscription would release something by itself if it were running, and
        whether that is a lease deadline: its earliest lease deadline; while it consumes (or
        buffers) holding no lease, now + _WATCH_LIVE; never while a copy of a delivered
        message is in flight."""
        if self._inflight > 0:
            return math.inf, False
        due = self._leases.next_deadline()
        if due is not None:
            return due, True
        if self._want or self._buf or self._receiving:
            return now + _WATCH_LIVE, False
        return math.inf, False

    def _note_risk_locked(self, now: float) -> None:
        """Remember it when the reported release time + grace is (nearly) reached: the
        watchdog may cut the socket then, whatever we report next."""
        if self._dog_key is not None and now >= self._dog_sent + _WATCH_GRACE - _WATCH_STEP:
            until = self._dog_sent + _WATCH_GRACE + _WATCH_SLACK
            if not until <= self._risk:  # (also when _risk is nan)
                self._risk = until

    def _report_locked(self, now: float) -> None:
        dog, key = self._dog, self._dog_key
        if dog is None or key is None:
            return
        due, lease = self._due_locked(now)
        sent = self._dog_sent
        if due == sent or sent < due < sent + _WATCH_STEP:
            return  # a little later than reported: still after every deadline it guards
        if due < sent < math.inf and not lease:
            # Earlier, but not a lease deadline: the buffer of a consumer that holds no lease
            # may wait for the reported time (no later than a lease it just held). Saves two
            # reports per receive batch (a context switch each).
            return
        self._note_risk_locked(now)
        if dog.send(f"D {key} {due!r}"):
            self._dog_sent = due

    def _sync_locked(self) -> None:
        """Before handing out or settling anything: if the watchdog may have cut our socket
        (this process was frozen past a reported release time + grace), check the socket;
        if it was cut, drop what came on it now (pika may run other callbacks before it
        reads the closed socket), so nothing the broker took back is handed out again."""
        now = time.monotonic()
        self._note_risk_locked(now)
        if self._risk != self._risk:  # nan: no risk
            return
        if self._sock is not None and _socket_cut(self._sock):
            log.warning("rabbitmq consumer of group %r was frozen past its lease deadline: "
                        "the watchdog handed its messages back to the broker", self.spec.name)
            self._lost_why = "frozen past the lease deadline; the watchdog closed it"
            self._cut_sock = self._sock
            self._cut_gen = self._ch_gen
            self._dog = self._dog_key = None
            self._dog_sent = self._risk = math.nan
            self._forget_locked()
        elif now > self._risk:
            self._risk = math.nan

    def _io_watch(self) -> None:
        """(I/O thread) give the watchdog this connection's socket (again after a restart)."""
        conn = self._conn
        sock = getattr(getattr(conn, "_transport", None), "_sock", None)
        if conn is None or not conn.is_open or sock is None:
            return
        dog = _Watchdog.get()
        if dog is None:
            return
        key = str(next(_Watchdog.keys))
        with self._lock:
            if sock is self._cut_sock:
                return
            due = self._due_locked(time.monotonic())[0]
            if dog.send(f"W {key} {due!r}", sock.fileno()):
                self._dog, self._dog_key, self._dog_sent = dog, key, due
                self._sock, self._risk = sock, math.nan

    def _io_unwatch(self) -> None:
        with self._lock:
            dog, key = self._dog, self._dog_key
            self._dog = self._dog_key = None
            self._sock = self._cut_sock = None
            self._dog_sent = self._risk = math.nan
        if dog is not None and key is not None:
            dog.send(f"X {key}")

    def _release_done(self, count: int, ids: Sequence[str | None] = ()) -> None:
        with self._cond:
            self._inflight -= count
            for mid in ids:
                left = self._copying.get(mid, 0) - 1
                if left > 0:
                    self._copying[mid] = left
                else:
                    self._copying.pop(mid, None)
            self._report_locked(time.monotonic())
            self._cond.notify_all()

    # -- I/O thread ------------------------------------------------------------------------
    def _io_start(self) -> None:
        if self._closed:
            return
        self._want = True
        if self._cancelling:
            return  # restarted when the cancel completes
        conn = self._conn
        if conn is None:
            if self._retry is None:
                self._io_connect()
            return
        if not conn.is_open:
            return  # _io_conn_open continues
        if self._ch is None:
            self._ch = "opening"
            conn.channel(on_open_callback=self._io_channel_open)
        elif self._ch != "opening" and self._ctag is None:
            self._io_consume()

    def _io_connect(self) -> None:
        self._retry = None
        if self._closed or self._link.closing or self._conn is not None:
            return
        params = self._link.params[self._failures % len(self._link.params)]
        try:
            self._conn = pika.SelectConnection(
                params,
                on_open_callback=self._io_conn_open,
                on_open_error_callback=self._io_conn_failed,
                on_close_callback=self._io_conn_closed,
                custom_ioloop=self._link.ioloop,
            )
        except Exception as exc:
            self._lost_why = redact(_describe(exc))
            self._io_reconnect_later()

    def _io_reconnect_later(self) -> None:
        if self._closed or self._link.closing:
            return
        self._failures += 1
        pause = min(5.0, 0.1 * 2 ** min(self._failures, 6))
        self._retry = self._link.ioloop.call_later(pause, self._io_reconnect)

    def _io_reconnect(self) -> None:
        self._retry = None
        if self._want and not self._closed:
            self._io_connect()

    def _io_conn_open(self, conn: Any) -> None:
        if conn is not self._conn:
            return
        self._failures = 0
        if self._closed:
            with contextlib.suppress(Exception):
                conn.close()
            return
        self._io_watch()
        # Copies into other queues go out on this connection, so a copy whose original
        # cannot be acked (the connection died) was not sent either.
        conn.channel(on_open_callback=self._io_pub_open)
        if self._want:
            self._io_start()

    def _io_pub_open(self, ch: Any) -> None:
        if self._closed or self._conn is None or not self._conn.is_open:
            with contextlib.suppress(Exception):
                ch.close()
            return
        ch.add_on_close_callback(self._io_pub_closed)
        self._confirms.reset()
        ch.add_on_return_callback(self._confirms.on_return)
        ch.confirm_delivery(self._confirms.on_confirm,
                            callback=lambda _frame: setattr(self, "_pub_ch", ch))

    def _io_pub_closed(self, ch: Any, reason: BaseException) -> None:
        if self._pub_ch is ch or self._pub_ch is None:
            self._pub_ch = None
            self._confirms.reset()
        conn = self._conn
        if not self._closed and conn is not None and conn.is_open:
            log.warning("rabbitmq copy channel closed (%s); reopening",
                        redact(_describe(reason)))
            conn.channel(on_open_callback=self._io_pub_open)

    def _io_send(self, items: Sequence[_Item], pend: _Pending) -> None:
        """Publish ``items`` on our confirm channel; ``pend`` learns each one's fate."""
        ch = self._pub_ch
        self._confirms.send(
            ch.basic_publish if ch is not None else None, items, pend,
            lambda: self._pub_ch is ch and ch is not None and ch.is_open,
        )

    def _io_conn_failed(self, conn: Any, err: BaseException) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._lost_why = redact(_describe(err))
        log.warning("rabbitmq consumer of group %r cannot connect to %s (%s); retrying",
                    self.spec.name, self._link.where, self._lost_why)
        self._io_reconnect_later()

    def _io_conn_closed(self, conn: Any, reason: BaseException) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._lost_why = redact(_describe(reason))
        self._io_lost()
        self._io_unwatch()
        if self._closed:
            if self._close_done is not None:
                self._close_done.set()
            return
        log.warning("rabbitmq consumer connection of group %r to %s lost (%s); reconnecting",
                    self.spec.name, self._link.where, self._lost_why)
        self._io_reconnect_later()

    def _io_channel_open(self, ch: Any) -> None:
        if self._closed:
            ch.close()
            return
        self._ch = ch
        self._ch_gen = next(_CHANNEL_GEN)
        ch.add_on_close_callback(self._io_channel_closed)
        ch.add_on_return_callback(self._io_returned)
        ch.basic_qos(prefetch_count=self._driver._prefetch)
        # Transaction mode: a copy and its original's ack (and any ack) take effect at the
        # next tx.commit (``_io_pump``). pika sends the consume after select-ok.
        ch.tx_select()
        if self._want:
            self._io_consume()

    def _io_consume(self) -> None:
        ch = self._ch
        gen = self._ch_gen

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            raw = _Raw(gen, method.delivery_tag, method.redelivered, method.routing_key,
                       props, body)
            with self._cond:
                if gen <= self._cut_gen:
                    return  # read after the watchdog cut the socket: the broker has it
                heapq.heappush(self._buf, (-(props.priority or 0), next(self._seq), raw))
                self._cond.notify()

        self._ctag = ch.basic_consume(self.queue, on_message)
        # Every delivery on this channel is for our consumer, also one that arrives between
        # our basic.cancel (a pause or close) and its cancel-ok: the buffer takes it and the
        # pause hands it back by copy, its attempt unchanged. pika would reject it itself
        # (requeue), and the broker counts that as a delivery (quorum: x-delivery-count + 1;
        # classic: flagged redelivered): its next delivery would skip an attempt that nobody
        # saw. pika 1.x hands each assembled delivery to the channel's ``_on_deliver``;
        # replaced on this channel object only (again by the next consume, not stacked).
        ch._on_deliver = lambda frame, header, content: on_message(
            ch, frame.method, header.properties, content)

    def _io_channel_closed(self, ch: Any, reason: BaseException) -> None:
        if ch is not self._ch:
            return
        self._ch = None
        self._ctag = None
        self._cancelling = False
        self._lost_why = redact(_describe(reason))
        self._io_fail_commits()
        self._io_forget()
        if self._closed:
            return
        code = getattr(reason, "reply_code", 0)
        if code == 404:
            self._set_error(NotFound(f"group {self.spec.name!r} does not exist (its queue "
                                     "was deleted)"))
        elif code not in (0, 200, 320) and self._want:
            log.warning("rabbitmq consumer channel closed: %s", self._lost_why)
            self._link.ioloop.call_later(0.5, self._io_start)

    def _io_lost(self) -> None:
        self._ch = None
        self._ctag = None
        self._cancelling = False
        self._pub_ch = None
        self._confirms.reset()
        self._io_fail_commits()
        self._io_forget()

    def _io_forget(self) -> None:
        with self._cond:
            self._forget_locked()

    def _forget_locked(self) -> None:
        """The channel is gone: the broker redelivers everything it had given us, so the
        receipts are stale (settling one raises ``LeaseExpired``, as after a lease expiry)."""
        self._buf.clear()
        self._leases.clear()
        self._acks.clear()
        self._report_locked(time.monotonic())
        self._cond.notify_all()

    def _set_error(self, err: MQError) -> None:
        with self._cond:
            self._error = err
            self._cond.notify_all()

    def _usable_ch(self) -> Any:
        ch = self._ch
        conn = self._conn
        if (ch is None or ch == "opening" or not ch.is_open or conn is None
                or not conn.is_open):
            return None
        return ch

    def _io_flush_acks(self) -> None:
        with self._lock:
            acks, self._acks = self._acks, []
        if self._usable_ch() is None:
            return
        gen = self._ch_gen
        self._tx_acks += [tag for g, tag in acks if g == gen]
        self._io_pump()

    def _io_pump(self) -> None:
        """Send what waits for the consumer channel's next transaction (copies with their
        originals' acks, then acks) and its tx.commit, unless a commit is unanswered:
        RabbitMQ closes the connection on a publish or ack that arrives while it commits
        (504, "unexpected command while processing 'tx.commit'"); those wait, and go
        together, in the next one. So a copy and its original's ack take effect together
        or not at all, whatever is cut when."""
        ch = self._usable_ch()
        if ch is None:
            self._io_fail_commits()
            return
        if self._tx_busy is not None or not (self._tx_copies or self._tx_acks
                                             or self._tx_requeues):
            return
        copies, self._tx_copies = self._tx_copies, []
        acks, self._tx_acks = self._tx_acks, []
        requeues, self._tx_requeues = self._tx_requeues, []
        then, self._tx_then = self._tx_then, []
        try:
            for raw, item in copies:
                ch.basic_publish(item.exchange, item.routing_key, item.body, item.props,
                                 mandatory=item.must_route)
                ch.basic_ack(raw.tag)
            for tag in sorted(acks):
                ch.basic_ack(tag)
            for tag in requeues:
                ch.basic_nack(tag, requeue=True)
            ch.tx_commit(callback=lambda _frame: self._io_committed(ch))
        except (*_CONN_ERRORS, pex.AMQPError) as exc:  # closing under us: nothing committed
            log.debug("rabbitmq: transaction not sent: %s", exc)
            for fn in then:
                fn(False)
            return
        self._tx_busy, self._tx_busy_then = ch, then

    def _io_committed(self, ch: Any) -> None:
        if self._tx_busy is not ch:
            return
        then, self._tx_busy, self._tx_busy_then = self._tx_busy_then, None, []
        for fn in then:
            fn(True)
        self._io_pump()

    def _io_fail_commits(self) -> None:
        """The consumer channel is gone: its transactions did not take effect (unless the
        broker committed the last one just before and its answer was lost); what waited
        for the next one goes with it (the broker delivers those originals again)."""
        then = self._tx_busy_then + self._tx_then
        self._tx_busy, self._tx_busy_then, self._tx_then = None, [], []
        self._tx_copies, self._tx_acks, self._tx_requeues = [], [], []
        for fn in then:
            fn(False)

    def _io_returned(self, _ch: Any, method: Any, props: Any, _body: bytes) -> None:
        log.warning("rabbitmq: a copy of message %s for %r was unroutable and is dropped "
                    "(its queue is gone)", props.message_id, method.routing_key)

    def _io_copy_then_ack(self, copies: list[tuple[_Raw, _Item]],
                          then: Callable[[bool | None], None] | None = None,
                          returned_ok: bool = True) -> None:
        """Publish each copy and ack its original; ``then(True)`` once every original's ack
        is committed, ``then(False)`` if not (the channel went: the broker delivers those
        again), ``then(None)`` when a copy came back unroutable and ``returned_ok`` is
        false (its original is requeued). Copies into the group's own queue commit with
        their originals' acks; copies into another queue are confirmed first
        (``_io_copy_away``). Originals of an earlier channel are gone with it: no copy."""
        gen = self._ch_gen
        live = ([(raw, item) for raw, item in copies if raw.gen == gen]
                if self._usable_ch() is not None else [])
        if not live:
            if then is not None:
                then(False)
            return
        here = [c for c in live if c[1].exchange == "" and c[1].routing_key == self.queue]
        away = [c for c in live if not (c[1].exchange == "" and c[1].routing_key == self.queue)]
        results: list[bool | None] = []
        parts = (1 if here else 0) + (1 if away else 0)

        def part(ok: bool | None) -> None:
            results.append(ok)
            if len(results) == parts and then is not None:
                then(None if None in results else all(results))

        if here:
            self._tx_copies += here
            self._tx_then.append(part)
            self._io_pump()
        if away:
            self._io_copy_away(away, part, returned_ok)

    def _io_copy_away(self, copies: list[tuple[_Raw, _Item]],
                      then: Callable[[bool | None], None], returned_ok: bool) -> None:
        """Copies into another queue: confirmed on the copy channel, then their originals
        acked (requeued if not confirmed) in the next transaction."""
        gen = self._ch_gen

        def done(pend: _Pending) -> None:
            good = set(pend.acked) | (set(pend.returned) if returned_ok else set())
            if self._usable_ch() is None or gen != self._ch_gen:
                then(False)  # the originals are gone with their channel
                return
            self._tx_acks += [copies[j][0].tag for j in sorted(good)]
            self._tx_requeues += [copies[j][0].tag for j in range(len(copies))
                                  if j not in good]
            returned = bool(pend.returned) and not returned_ok
            self._tx_then.append(lambda ok: then(
                None if ok and returned else ok and len(good) == len(copies)))
            self._io_pump()

        self._io_send([c[1] for c in copies], _Pending(len(copies), done))

    def _io_when_committed(self, fn: Callable[[], None], tries: int = 0) -> None:
        """``fn()`` once no transaction of the consumer channel is unanswered (at most
        ``publish_timeout``): closing the channel before would drop its acks."""
        if self._tx_busy is not None and tries * 0.01 < self._driver._publish_timeout:
            self._link.ioloop.call_later(0.01, lambda: self._io_when_committed(fn, tries + 1))
            return
        fn()

    def _io_tick(self, now: float) -> None:
        with self._lock:
            expired = self._leases.expired()
            if expired and self.spec.ordered:
                self._expect_locked([raw.props.message_id for raw, _ in expired], 0.0)
            idle = (self._ctag is not None and not self._cancelling and self._receiving == 0
                    and now - self._last_receive > self._idle
                    and not (self.spec.ordered and self._keeps_turn_locked(now)))
            self._inflight += len(expired)
            self._report_locked(now)
            watch = self._dog is None or not self._dog.alive
        if watch and self._conn is not None and self._conn.is_open:
            self._io_watch()
        if expired:
            self._io_copy_then_ack(
                [(raw, self._driver._retry_item(raw, self.queue, attempt, 0.0))
                 for raw, attempt in expired],
                lambda _ok: self._release_done(len(expired)),
            )
        if idle:
            self._io_pause()

    def _expect_locked(self, ids: Sequence[str | None], delay: float) -> None:
        """Ordered groups: these messages went back to the queue and come again."""
        until = time.monotonic() + delay + self._patience
        for mid in ids:
            if mid is not None:
                self._returning[mid] = until

    def _keeps_turn_locked(self, now: float) -> bool:
        """Ordered groups: whether this consumer must stay the queue's active one (it holds
        a lease, or a message it sent back has not come again yet): another consumer would
        get the key's later messages first."""
        if self._returning:
            for mid in [m for m, until in self._returning.items() if until <= now]:
                del self._returning[mid]
        return bool(len(self._leases) or self._returning)

    def _io_pause(self, then: Callable[[], None] | None = None) -> None:
        """Stop consuming and hand the unread buffer back to the queue."""
        ch, ctag = self._ch, self._ctag
        self._want = False
        if ch is None or ch == "opening" or ctag is None or not ch.is_open:
            if then is not None:
                then()
            return
        self._cancelling = True

        def cancelled(_frame: Any) -> None:
            self._ctag = None
            self._cancelling = False
            with self._lock:
                buf, self._buf = self._buf, []
            raws = [raw for _, _, raw in sorted(buf) if raw.gen == self._ch_gen]

            def after(_committed: bool | None) -> None:
                if self._want and not self._closed:
                    self._io_start()
                if then is not None:
                    then()

            self._io_copy_then_ack(
                [(raw, self._driver._retry_item(raw, self.queue, raw.so_far(), None))
                 for raw in raws],
                after,
            )

        ch.basic_cancel(ctag, callback=cancelled)

    def _io_close(self, done: threading.Event) -> None:
        def flush() -> None:
            self._io_flush_acks()
            self._io_when_committed(finish)

        def finish() -> None:
            self._want = False
            self._link.subs.discard(self)
            self._io_unwatch()
            if self._retry is not None:
                with contextlib.suppress(Exception):
                    self._link.ioloop.remove_timeout(self._retry)
                self._retry = None
            conn = self._conn
            if conn is not None and (conn.is_open or conn.is_opening):
                self._close_done = done
                try:
                    conn.close()  # _io_conn_closed sets done
                    return
                except Exception as exc:
                    log.debug("rabbitmq: closing a consumer connection: %s", exc)
            done.set()

        if self._cancelling:
            self._link.ioloop.call_later(0.05, lambda: self._io_close(done))
            return
        self._io_pause(flush)

    # -- caller threads --------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise Closed(f"subscription to group {self.spec.name!r} is closed")
        if self._error is not None:
            raise self._error
        self._driver._check()

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        self._check()
        # The lease starts with this call (the portable layer's deadline is no later).
        started = time.monotonic()
        # Not idle from here on: the I/O thread's tick may run before this thread counts
        # itself in ``_receiving`` below, and must not pause the consumer this call is
        # about to use (or restart) right away.
        self._last_receive = started
        if not self._want or self._ch is None:
            self._want = True
            self._link.call(self._io_start)
        deadline = started + timeout
        out: list[Delivery] = []
        while True:
            again: list[tuple[_Raw, float | None]] = []
            with self._cond:
                self._receiving += 1
                try:
                    self._sync_locked()
                    while not self._buf and self._error is None and not self._closed:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if self._error is not None:
                        raise self._error
                    if self._buf:
                        self._sync_locked()
                        # Hand nothing out while a copy is in flight (the watchdog is
                        # held off then): a holder frozen right after this receive must
                        # be cut at its lease deadline. One round trip, rarely.
                        settled = time.monotonic() + 1.0
                        while self._inflight > 0 and not self._closed:
                            left = settled - time.monotonic()
                            if left <= 0:
                                break
                            self._cond.wait(left)
                    now = time.time()
                    later: list[tuple[int, int, _Raw]] = []
                    while self._buf and len(out) < max_messages:
                        entry = heapq.heappop(self._buf)
                        raw = entry[2]
                        if raw.gen != self._ch_gen or raw.gen <= self._cut_gen:
                            continue  # from a channel that is gone: it comes back anyway
                        if self._copying and raw.props.message_id in self._copying:
                            later.append(entry)  # its original's ack is on its way
                            continue
                        due = raw.due()
                        if due is not None and due > now:
                            again.append((raw, due))
                            continue
                        headers = raw.props.headers or {}
                        if raw.redelivered and "x-delivery-count" not in headers:
                            # A classic queue redelivered it (its consumer's channel died)
                            # and only says "at least once more": re-send it with that
                            # attempt written down first, so the next redelivery counts
                            # on from there instead of repeating this attempt.
                            again.append((raw, None))
                            continue
                        attempt = raw.attempt()
                        if self._returning:
                            self._returning.pop(raw.props.message_id, None)
                        token = self._leases.grant((raw, attempt), self.spec.lease,
                                                   start=started)
                        out.append(self._driver._delivery(raw, attempt, token))
                    for entry in later:
                        heapq.heappush(self._buf, entry)
                    for raw, _ in again:
                        mid = raw.props.message_id
                        self._copying[mid] = self._copying.get(mid, 0) + 1
                    self._inflight += len(again)
                    if out or again:
                        self._report_locked(time.monotonic())
                finally:
                    self._receiving -= 1
                    self._last_receive = time.monotonic()
            if again:
                self._recopy(again)
            if out or self._closed or deadline - time.monotonic() <= 0:
                return out
            if later:  # only copies waiting for their original's ack: not a busy loop
                with self._cond:
                    self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    def _recopy(self, items: list[tuple[_Raw, float | None]]) -> None:
        """Send messages back to the queue instead of delivering them: early ones (out of
        their wait tier too soon) to the next tier, classic redeliveries with their
        attempt written down."""
        copies = []
        try:
            for raw, due in items:
                copies.append((raw, self._driver._retry_item(raw, self.queue, raw.so_far(),
                                                             due)))
        finally:
            count = len(items)
            ids = [raw.props.message_id for raw, _ in items]
            self._link.call(lambda: self._io_copy_then_ack(
                copies, lambda _ok: self._release_done(count, ids)))

    def _stale(self, receipt: Any, *more: Any) -> LeaseExpired:
        why = self._lost_why or "its channel closed"
        return LeaseExpired(f"rabbitmq: receipt {receipt!r} of group {self.spec.name!r} is "
                            f"stale ({why}): the broker delivers the message again",
                            receipts=(receipt, *more))

    def _take(self, receipt: Any) -> tuple[_Raw, int]:
        """Settle a receipt: its (message, attempt). ``LeaseExpired`` when it is stale: the
        portable layer stops settles at its deadline, so here that means the channel that
        carried the message is gone (or the driver's own deadline, just after, passed)."""
        if not isinstance(receipt, int):
            raise InvalidArgument("not a receipt of this backend")
        with self._lock:
            self._sync_locked()
            held = self._leases.take(receipt)
            if held is None:
                raise self._stale(receipt)
            self._inflight += 1
            self._report_locked(time.monotonic())
            return held

    def ack(self, receipts: Sequence[Any]) -> None:
        self._check()
        stale: list[Any] = []
        with self._lock:
            self._sync_locked()
            first = not self._acks
            for receipt in receipts:
                held = self._leases.take(receipt) if isinstance(receipt, int) else None
                if held is None:
                    stale.append(receipt)
                else:
                    self._acks.append((held[0].gen, held[0].tag))
            schedule = first and bool(self._acks)
            self._report_locked(time.monotonic())
        if schedule:
            self._link.call(self._io_flush_acks)
        if stale:
            raise self._stale(*stale)

    def _settle_by_copy(self, raw: _Raw, item: _Item, returned_ok: bool) -> bool | None:
        """Copy ``item`` and ack ``raw`` (``_io_copy_then_ack``): True once done within the
        publish timeout, None if the copy came back unroutable (``raw`` requeued, unless
        ``returned_ok``). Ends the in-flight count ``_take`` started."""
        done = threading.Event()
        committed: list[bool | None] = []

        def finish(ok: bool | None) -> None:
            committed.append(ok)
            self._release_done(1)
            done.set()

        self._link.call(lambda: self._io_copy_then_ack([(raw, item)], finish, returned_ok))
        return committed[0] if done.wait(self._driver._publish_timeout) else False

    def nack(self, receipt: Any, delay: float) -> None:
        self._check()
        taken = self._take(receipt)
        if self.spec.ordered:
            with self._lock:
                self._expect_locked([taken[0].props.message_id], delay)
        due = time.time() + delay if delay > 0 else None
        try:
            item = self._driver._retry_item(taken[0], self.queue, taken[1], due)
        except BaseException:
            self._release_done(1)
            raise
        if not self._settle_by_copy(taken[0], item, returned_ok=True):
            raise ConnectionFailed(f"rabbitmq at {self._driver._where}: nack not committed "
                                   f"({self._lost_why or 'connection lost'}); the message "
                                   "comes again")

    def extend(self, receipt: Any, seconds: float) -> None:
        self._check()
        if not isinstance(receipt, int):
            raise InvalidArgument("not a receipt of this backend")
        with self._lock:
            self._sync_locked()
            if not self._leases.extend(receipt, seconds):
                raise self._stale(receipt)
            self._report_locked(time.monotonic())

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        self._check()
        taken = self._take(receipt)
        raw = taken[0]
        try:
            props = _copy_props(
                raw.props,
                **{H_TOPIC: self._driver._topic_of(raw),
                   **dead_headers(reason, attempts, time.time()), H_DUE: None},
            )
            item = _Item("", self._driver._dead_queue(self.spec.name), raw.body, props, True)
        except BaseException:
            self._release_done(1)
            raise
        done = self._settle_by_copy(raw, item, returned_ok=False)
        if done is None:
            raise NotFound(f"dead-letter queue of group {self.spec.name!r} is missing")
        if not done:
            raise ConnectionFailed(f"rabbitmq at {self._driver._where}: dead letter not "
                                   f"committed ({self._lost_why or 'connection lost'}); the "
                                   "message comes again")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        done = threading.Event()
        if self._link._thread.is_alive() and not self._link.closing:
            self._link.call(lambda: self._io_close(done))
            done.wait(self._driver._publish_timeout)
        self._link.subs.discard(self)


