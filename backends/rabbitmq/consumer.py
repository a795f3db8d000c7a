"""A RabbitMQ subscription's consumer link: the part of a subscription that runs on the
driver's I/O thread (``io._Link``), apart from the caller-thread side in ``subscription``,
because pika's connections are single-threaded and all of this touches them."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pika
import pika.exceptions as pex

from mqabstract import wire
from mqabstract.errors import NotFound
from mqabstract.model import GroupSpec
from mqabstract.url import redact

from .holdings import _Holdings
from .io import _CONN_ERRORS, _Confirms, _describe, _Item, _Link, _Pending
from .wire import H_COPY, _copy_token, _Raw

log = logging.getLogger("mqabstract.rabbitmq")

_CHANNEL_GEN = itertools.count(1)

#: How many copies' originals a consumer remembers (``_Superseded``), and for how long
#: after its channel ended (a cut) and while it lives: an original comes back, if at all,
#: when the channel that held it ends, and is delivered again within moments.
_SUPERSEDED_MAX = 10_000
_SUPERSEDED_CUT_S = 120.0
_SUPERSEDED_LIVE_S = 60.0
#: how often a copy waits out the watchdog's possible cut (``copy_then_ack``) before it
#: goes anyway (a report the watchdog never took); each wait is under a second
_RISK_WAITS = 20
#: a tick this late after the one before means the process was frozen or starved: that
#: time was not idleness, and a consumer woken from it is not paused at once
_STALL = 0.25


class _Superseded:
    """The deliveries a consumer drops (acks unseen) because a copy stands for them.

    A message goes back to its queue as a copy (a pause's unread buffer, a delayed nack, a
    dead letter), and its original is acked only once the copy is confirmed: a
    copy and an ack cannot be made one step (RabbitMQ 3.10 quorum queues may apply a
    transaction's ack and drop its publish when the connection ends: loss, measured in
    docs/backends/rabbitmq.md). So a cut after the confirm can leave both: the original
    comes back (redelivered, counted) beside its copy. Then whichever of the two is known
    superfluous is dropped: the original once its copy is confirmed (it comes back only as
    a redelivery), the copy while its confirm is in doubt (its original was never acked,
    so it surely comes back).

    A message in a queue is named by its id, its copy token (``H_COPY``: None until
    copied; replays get one too) and its ``mq-published-at``, so a later publish or a
    replay of the same id is never taken for it. Only this consumer knows: another process
    that gets such a pair sees a duplicate (docs/backends/rabbitmq.md, Known gaps). I/O
    thread only."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        # (id, token, published) -> (channel generation it waits on, when added,
        # only as a redelivery), oldest first
        self._keys: dict[tuple[str, Any, Any], tuple[int, float, bool]] = {}

    def __bool__(self) -> bool:
        return bool(self._keys)

    @staticmethod
    def key(mid: str, headers: Any) -> tuple[str, Any, Any]:
        headers = headers or {}
        return (mid, headers.get(H_COPY), headers.get(wire.PUBLISHED_AT))

    def add(self, key: tuple[str, Any, Any], redelivery: bool, gen: int, now: float) -> None:
        self._keys.pop(key, None)
        self._keys[key] = (gen, now, redelivery)
        self.prune(gen, now)

    def prune(self, live_gen: int, now: float) -> None:
        """Forget the oldest: over the size bound, from a channel that ended more than
        ``_SUPERSEDED_CUT_S`` ago, or from the live one after ``_SUPERSEDED_LIVE_S``
        (its acks were applied long since)."""
        keys = self._keys
        while keys:
            key, (gen, at, _) = next(iter(keys.items()))
            limit = _SUPERSEDED_LIVE_S if gen == live_gen else _SUPERSEDED_CUT_S
            if len(keys) <= _SUPERSEDED_MAX and now - at <= limit:
                return
            del keys[key]

    def take(self, mid: str | None, headers: Any, redelivered: bool) -> bool:
        """True (and forgotten) if this delivery is one to drop."""
        if mid is None:
            return False
        key = self.key(mid, headers)
        got = self._keys.get(key)
        if got is None or (got[2] and not redelivered):
            return False
        del self._keys[key]
        return True


#: the driver's copy of a delivered message for a queue (``RabbitMQDriver._retry_item``):
#: (message, queue, deliveries so far, due or None) -> its publish
_RetryItem = Callable[[_Raw, str, int, float | None], _Item]


class _Consumer:
    """One subscription's consumer on the I/O thread: a ``SelectConnection`` of its own
    (closing it hands back exactly this subscription's messages; it reconnects after a
    loss), the consumer channel in AMQP transaction mode, a confirm channel for copies,
    the lease tick, and pausing when nobody receives. Its messages, leases and watchdog
    reports are the ``_Holdings`` it shares with the caller side.

    Concurrency: every method runs on the ``_Link`` I/O thread (other threads hand them to
    it with ``link.call``), except ``close``, which any other thread calls. Settles go out
    in the consumer channel's transactions (``_pump``); a copy is confirmed on the copy
    channel first and its original acked in the next transaction (``copy_then_ack``), so
    a cut leaves a duplicate, never a loss, and ``_Superseded`` drops the duplicate.
    """

    def __init__(self, link: _Link, held: _Holdings, spec: GroupSpec, queue: str,
                 prefetch: int, publish_timeout: float, retry_item: _RetryItem) -> None:
        self._link = link
        self._held = held
        self.spec = spec
        self.queue = queue
        self._prefetch = prefetch
        self._publish_timeout = publish_timeout
        self._retry_item = retry_item
        self.conn: Any = None  # this subscription's SelectConnection, when there is one
        self._failures = 0
        self._retry: Any = None  # reconnect timer
        self._close_done: threading.Event | None = None
        self.ch: Any = None
        self._ctag: str | None = None
        self._cancelling = False
        self._idle = min(1.0, max(0.2, spec.lease / 2))
        # The consumer channel's transactions (``_pump``): what the next one acks and
        # requeues, what to run when it is committed (True) or its channel goes first
        # (False); the channel whose tx.commit is unanswered and what that one runs then.
        self._tx_acks: list[int] = []
        self._tx_requeues: list[int] = []
        self._tx_then: list[Callable[[bool], None]] = []
        self._tx_busy: Any = None
        self._tx_busy_then: list[Callable[[bool], None]] = []
        self._pub_ch: Any = None  # confirm channel for copies
        self._confirms = _Confirms()
        self._superseded = _Superseded()
        self._last_tick = time.monotonic()
        link.subs.add(self)

    # -- the watchdog ----------------------------------------------------------------------
    def _watch(self) -> None:
        """Give the watchdog this connection's socket (again after a restart)."""
        conn = self.conn
        sock = getattr(getattr(conn, "_transport", None), "_sock", None)
        if conn is None or not conn.is_open or sock is None:
            return
        self._held.watch(sock)

    # -- connection and channels -----------------------------------------------------------
    def start(self) -> None:
        if self._held.closed:
            return
        self._held.want = True
        if self._cancelling:
            return  # restarted when the cancel completes
        conn = self.conn
        if conn is None:
            if self._retry is None:
                self._connect()
            return
        if not conn.is_open:
            return  # _conn_open continues
        if self.ch is None:
            self.ch = "opening"
            conn.channel(on_open_callback=self._channel_open)
        elif self.ch != "opening" and self._ctag is None:
            self._consume()

    def _connect(self) -> None:
        self._retry = None
        if self._held.closed or self._link.closing or self.conn is not None:
            return
        params = self._link.params[self._failures % len(self._link.params)]
        try:
            self.conn = pika.SelectConnection(
                params,
                on_open_callback=self._conn_open,
                on_open_error_callback=self._conn_failed,
                on_close_callback=self._conn_closed,
                custom_ioloop=self._link.ioloop,
            )
        except Exception as exc:
            self._held.lost_why = redact(_describe(exc))
            self._reconnect_later()

    def _reconnect_later(self) -> None:
        if self._held.closed or self._link.closing:
            return
        self._failures += 1
        pause = min(5.0, 0.1 * 2 ** min(self._failures, 6))
        self._retry = self._link.ioloop.call_later(pause, self._reconnect)

    def _reconnect(self) -> None:
        self._retry = None
        if self._held.want and not self._held.closed:
            self._connect()

    def _conn_open(self, conn: Any) -> None:
        if conn is not self.conn:
            return
        self._failures = 0
        if self._held.closed:
            with contextlib.suppress(Exception):
                conn.close()
            return
        self._watch()
        # Copies go out on this connection, so a copy whose original cannot be acked (the
        # connection died) was not sent either, or is in doubt (``_Superseded``).
        conn.channel(on_open_callback=self._pub_open)
        if self._held.want:
            self.start()

    def _pub_open(self, ch: Any) -> None:
        if self._held.closed or self.conn is None or not self.conn.is_open:
            with contextlib.suppress(Exception):
                ch.close()
            return
        ch.add_on_close_callback(self._pub_closed)
        self._confirms.reset()
        ch.add_on_return_callback(self._confirms.on_return)
        ch.confirm_delivery(self._confirms.on_confirm,
                            callback=lambda _frame: setattr(self, "_pub_ch", ch))

    def _pub_closed(self, ch: Any, reason: BaseException) -> None:
        if self._pub_ch is ch or self._pub_ch is None:
            self._pub_ch = None
            self._confirms.reset()
        conn = self.conn
        if not self._held.closed and conn is not None and conn.is_open:
            log.warning("rabbitmq copy channel closed (%s); reopening",
                        redact(_describe(reason)))
            conn.channel(on_open_callback=self._pub_open)

    def _send(self, items: Sequence[_Item], pend: _Pending) -> None:
        """Publish ``items`` on our confirm channel; ``pend`` learns each one's fate."""
        ch = self._pub_ch
        self._confirms.send(
            ch.basic_publish if ch is not None else None, items, pend,
            lambda: self._pub_ch is ch and ch is not None and ch.is_open,
        )

    def _conn_failed(self, conn: Any, err: BaseException) -> None:
        if conn is not self.conn:
            return
        self.conn = None
        self._held.lost_why = redact(_describe(err))
        log.warning("rabbitmq consumer of group %r cannot connect to %s (%s); retrying",
                    self.spec.name, self._link.where, self._held.lost_why)
        self._reconnect_later()

    def _conn_closed(self, conn: Any, reason: BaseException) -> None:
        if conn is not self.conn:
            return
        self.conn = None
        self._held.lost_why = redact(_describe(reason))
        self._lost()
        self._held.unwatch()
        if self._held.closed:
            if self._close_done is not None:
                self._close_done.set()
            return
        log.warning("rabbitmq consumer connection of group %r to %s lost (%s); reconnecting",
                    self.spec.name, self._link.where, self._held.lost_why)
        self._reconnect_later()

    def _channel_open(self, ch: Any) -> None:
        if self._held.closed:
            ch.close()
            return
        self.ch = ch
        self._held.ch_gen = next(_CHANNEL_GEN)
        ch.add_on_close_callback(self._channel_closed)
        ch.add_on_return_callback(self._returned)
        ch.basic_qos(prefetch_count=self._prefetch)
        # Transaction mode: acks take effect at the next tx.commit (``_pump``), which
        # batches them under load. pika sends the consume after select-ok.
        ch.tx_select()
        if self._held.want:
            self._consume()

    def _consume(self) -> None:
        ch = self.ch
        held = self._held
        gen = held.ch_gen

        superseded = self._superseded

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            if superseded and superseded.take(props.message_id, props.headers,
                                              method.redelivered):
                self._drop(gen, method.delivery_tag, props)
                return
            raw = _Raw(gen, method.delivery_tag, method.redelivered, method.routing_key,
                       props, body)
            with held.cond:
                if gen <= held.cut_gen:
                    return  # read after the watchdog cut the socket: the broker has it
                heapq.heappush(held.buf, (-(props.priority or 0), next(held.seq), raw))
                held.cond.notify()

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

    def _drop(self, gen: int, tag: int, props: Any) -> None:
        """Ack, unseen, a delivery a copy stands for (``_Superseded``)."""
        log.info("rabbitmq: message %s came back to group %r beside the copy that replaced "
                 "it (a cut connection); the duplicate is dropped", props.message_id,
                 self.spec.name)
        if gen == self._held.ch_gen:
            self._tx_acks.append(tag)
            self._pump()

    def _channel_closed(self, ch: Any, reason: BaseException) -> None:
        if ch is not self.ch:
            return
        self.ch = None
        self._ctag = None
        self._cancelling = False
        self._held.lost_why = redact(_describe(reason))
        self._fail_commits()
        self._forget()
        if self._held.closed:
            return
        code = getattr(reason, "reply_code", 0)
        if code == 404:
            self._held.set_error(NotFound(f"group {self.spec.name!r} does not exist (its "
                                          "queue was deleted)"))
        elif code not in (0, 200, 320) and self._held.want:
            log.warning("rabbitmq consumer channel closed: %s", self._held.lost_why)
            self._link.ioloop.call_later(0.5, self.start)

    def _lost(self) -> None:
        self.ch = None
        self._ctag = None
        self._cancelling = False
        self._pub_ch = None
        self._confirms.reset()
        self._fail_commits()
        self._forget()

    def _forget(self) -> None:
        with self._held.cond:
            self._held.forget_locked()

    def _usable_ch(self) -> Any:
        ch = self.ch
        conn = self.conn
        if (ch is None or ch == "opening" or not ch.is_open or conn is None
                or not conn.is_open):
            return None
        return ch

    # -- the consumer channel's transactions -----------------------------------------------
    def flush_acks(self) -> None:
        held = self._held
        with held.lock:
            acks, held.acks = held.acks, []
        if self._usable_ch() is None:
            return
        gen = held.ch_gen
        self._tx_acks += [tag for g, tag in acks if g == gen]
        self._pump()

    def _pump(self) -> None:
        """Send what waits for the consumer channel's next transaction (acks, requeues) and
        its tx.commit, unless a commit is unanswered: RabbitMQ closes the connection on an
        ack that arrives while it commits (504, "unexpected command while processing
        'tx.commit'"); those wait, and go together, in the next one."""
        ch = self._usable_ch()
        if ch is None:
            self._fail_commits()
            return
        if self._tx_busy is not None or not (self._tx_acks or self._tx_requeues):
            return
        then, self._tx_then = self._tx_then, []
        acks, self._tx_acks = self._tx_acks, []
        requeues, self._tx_requeues = self._tx_requeues, []
        try:
            for tag in sorted(acks):
                ch.basic_ack(tag)
            for tag in requeues:
                ch.basic_nack(tag, requeue=True)
            ch.tx_commit(callback=lambda _frame: self._committed(ch))
        except (*_CONN_ERRORS, pex.AMQPError) as exc:  # closing under us: nothing committed
            log.debug("rabbitmq: transaction not sent: %s", exc)
            for fn in then:
                fn(False)
            return
        self._tx_busy, self._tx_busy_then = ch, then

    def _committed(self, ch: Any) -> None:
        if self._tx_busy is not ch:
            return
        then, self._tx_busy, self._tx_busy_then = self._tx_busy_then, None, []
        for fn in then:
            fn(True)
        self._pump()

    def _fail_commits(self) -> None:
        """The consumer channel is gone: its transactions did not take effect (unless the
        broker committed the last one just before and its answer was lost); what waited
        for the next one goes with it (the broker delivers those originals again)."""
        then = self._tx_busy_then + self._tx_then
        self._tx_busy, self._tx_busy_then, self._tx_then = None, [], []
        self._tx_acks, self._tx_requeues = [], []
        for fn in then:
            fn(False)

    def _returned(self, _ch: Any, method: Any, props: Any, _body: bytes) -> None:
        log.warning("rabbitmq: a copy of message %s for %r was unroutable and is dropped "
                    "(its queue is gone)", props.message_id, method.routing_key)

    def _live_locked(self, raw: _Raw) -> bool:
        """Whether ``raw`` can still be settled: its channel is the open one and was not
        cut (else the broker has it back already). After ``sync_locked``."""
        held = self._held
        return (raw.gen == held.ch_gen and raw.gen > held.cut_gen
                and self._usable_ch() is not None)

    def requeue(self, raws: list[_Raw], then: Callable[[bool], None]) -> None:
        """Give ``raws`` back to the broker (``basic.nack`` with requeue, in the next
        transaction): it counts the delivery (quorum ``x-delivery-count`` + 1; a classic
        queue's ``redelivered`` flag, which ``receive`` writes down by copy before anyone
        gets it), so the next attempt is exactly the next one. One step, unlike a copy: a
        cut or kill before the commit hands them back all the same, never twice. For a
        nack without delay and an expired lease. ``then(True)`` once committed."""
        with self._held.lock:
            self._held.sync_locked()
            tags = [raw.tag for raw in raws if self._live_locked(raw)]
        if not tags:
            then(False)
            return
        self._tx_requeues += tags
        self._tx_then.append(then)
        self._pump()

    def copy_then_ack(self, copies: list[tuple[_Raw, _Item]],
                      then: Callable[[bool | None], None],
                      returned_ok: bool = True, waited: int = 0) -> None:
        """Publish each copy, and once it is confirmed ack its original (requeue it if the
        copy was refused) in the next transaction; ``then(True)`` once every original's
        ack is committed, ``then(False)`` if not (the channel went: the broker delivers
        those again), ``then(None)`` when a copy came back unroutable and ``returned_ok``
        is false (its original is requeued). Originals of an earlier channel are gone with
        it: no copy. Nor while the watchdog may cut the socket (this process was frozen past
        a release time): a copy the broker got just before the cut would stand beside its
        original, which the cut hands back too, for any consumer to get. Then it reports a
        copy in flight (the watchdog holds off), waits until the cut can no longer come,
        and goes on only if the socket is whole.

        Confirmed before acked, because RabbitMQ 3.10's quorum queues do not keep a
        transaction's publish and ack together across a cut (``_Superseded``): a cut in
        between leaves a duplicate, which ``_Superseded`` drops, never a loss."""
        held = self._held
        with held.lock:
            held.sync_locked()
            wait = (held.risk - time.monotonic() + 0.01
                    if held.at_risk_locked() and waited < _RISK_WAITS else None)
            if wait is not None:
                held.report_locked(time.monotonic())
            gen = held.ch_gen
            live = [(raw, item) for raw, item in copies if self._live_locked(raw)]
        if not live:
            then(False)
            return
        if wait is not None:
            self._link.ioloop.call_later(max(0.0, wait), lambda: self.copy_then_ack(
                copies, then, returned_ok, waited + 1))
            return
        # (one without an id of its own cannot be told apart from its copy: see Known gaps)
        originals = [None if raw.props.message_id is None or raw.pinned
                     else _Superseded.key(raw.props.message_id, raw.props.headers)
                     for raw, _ in live]
        for _, item in live:
            item.props.headers[H_COPY] = _copy_token()

        def done(pend: _Pending) -> None:
            good = set(pend.acked) | (set(pend.returned) if returned_ok else set())
            now = time.monotonic()
            for j, (_raw, item) in enumerate(live):
                original = originals[j]
                if j in good and original is not None:
                    # in place (or unroutable, and that is fine): its original must not
                    # come back too
                    self._superseded.add(original, True, gen, now)
                elif j in pend.doubt:
                    # maybe in place, and its original surely comes back (never acked)
                    self._superseded.add(
                        _Superseded.key(item.props.message_id, item.props.headers), False,
                        gen, now)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("rabbitmq: copies for group %r settled: confirmed %s, in doubt %s "
                          "(of %s; id@attempts so far)", self.spec.name, sorted(good),
                          sorted(pend.doubt), [f"{item.props.message_id}@"
                                               f"{item.props.headers.get(wire.ATTEMPT)}"
                                               for _, item in live])
            if self._usable_ch() is None or gen != self._held.ch_gen:
                then(False)  # the originals are gone with their channel
                return
            self._tx_acks += [live[j][0].tag for j in sorted(good)]
            self._tx_requeues += [live[j][0].tag for j in range(len(live)) if j not in good]
            returned = bool(pend.returned) and not returned_ok
            self._tx_then.append(lambda ok: then(
                None if ok and returned else ok and len(good) == len(live)))
            self._pump()

        self._send([item for _, item in live], _Pending(len(live), done))

    def _when_committed(self, fn: Callable[[], None], tries: int = 0) -> None:
        """``fn()`` once no transaction of the consumer channel is unanswered (at most
        ``publish_timeout``): closing the channel before would drop its acks."""
        if self._tx_busy is not None and tries * 0.01 < self._publish_timeout:
            self._link.ioloop.call_later(0.01, lambda: self._when_committed(fn, tries + 1))
            return
        fn()

    # -- the lease tick, pausing and closing -----------------------------------------------
    def tick(self, now: float) -> None:
        held = self._held
        stalled = now - self._last_tick > _STALL
        self._last_tick = now
        with held.lock:
            if stalled:  # frozen or starved, not idle: no pause (by copy) right on waking
                held.last_receive = max(held.last_receive, now)
            expired = held.leases.expired()
            if expired and self.spec.ordered:
                held.expect_locked([raw.props.message_id for raw, _ in expired], 0.0)
            idle = (self._ctag is not None and not self._cancelling and held.receiving == 0
                    and now - held.last_receive > self._idle
                    and not (self.spec.ordered and held.keeps_turn_locked(now)))
            held.inflight += len(expired)
            held.report_locked(now)
            watch = held.dog is None or not held.dog.alive
        if watch and self.conn is not None and self.conn.is_open:
            self._watch()
        if expired:
            # One without a message id goes by copy, which pins one (its id would change).
            back = [raw for raw, _ in expired if not raw.pinned]
            pinned = [(raw, self._retry_item(raw, self.queue, attempt, 0.0))
                      for raw, attempt in expired if raw.pinned]
            if back:
                self.requeue(back, lambda _ok: held.release_done(len(back)))
            if pinned:
                self.copy_then_ack(pinned, lambda _ok: held.release_done(len(pinned)))
        if idle:
            self.pause()

    def pause(self, then: Callable[[], None] | None = None) -> None:
        """Stop consuming and hand the unread buffer back to the queue."""
        ch, ctag = self.ch, self._ctag
        held = self._held
        held.want = False
        if ch is None or ch == "opening" or ctag is None or not ch.is_open:
            if then is not None:
                then()
            return
        self._cancelling = True

        def cancelled(_frame: Any) -> None:
            self._ctag = None
            self._cancelling = False
            with held.lock:
                buf, held.buf = held.buf, []
            raws = [raw for _, _, raw in sorted(buf) if raw.gen == held.ch_gen]

            def after(_committed: bool | None) -> None:
                if held.want and not held.closed:
                    self.start()
                if then is not None:
                    then()

            self.copy_then_ack(
                [(raw, self._retry_item(raw, self.queue, raw.so_far(), None))
                 for raw in raws],
                after,
            )

        ch.basic_cancel(ctag, callback=cancelled)

    def _shut(self, done: threading.Event) -> None:
        """Pause (the unread buffer handed back), send the acks, and once committed close
        the connection; ``done`` is set when it closed."""
        def flush() -> None:
            self.flush_acks()
            self._when_committed(finish)

        def finish() -> None:
            self._held.want = False
            self._link.subs.discard(self)
            self._held.unwatch()
            if self._retry is not None:
                with contextlib.suppress(Exception):
                    self._link.ioloop.remove_timeout(self._retry)
                self._retry = None
            conn = self.conn
            if conn is not None and (conn.is_open or conn.is_opening):
                self._close_done = done
                try:
                    conn.close()  # _conn_closed sets done
                    return
                except Exception as exc:
                    log.debug("rabbitmq: closing a consumer connection: %s", exc)
            done.set()

        if self._cancelling:
            self._link.ioloop.call_later(0.05, lambda: self._shut(done))
            return
        self.pause(flush)

    def close(self) -> None:
        """(any thread but the I/O thread) Close the subscription: wake its receivers, and
        have the I/O thread shut this consumer down, waiting up to ``publish_timeout``."""
        held = self._held
        if held.closed:
            return
        held.closed = True
        with held.cond:
            held.cond.notify_all()
        done = threading.Event()
        if self._link._thread.is_alive() and not self._link.closing:
            self._link.call(lambda: self._shut(done))
            done.wait(self._publish_timeout)
        self._link.subs.discard(self)
