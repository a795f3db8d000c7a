"""``Subscription``: one consumer attached to a group, and everything it keeps.

``receive`` applies the portable rules to what the driver returns (the lease rule, the
dead-letter decision after ``max_attempts``, TTL, others' replies skipped) and passes an
ordered group's messages through its ``Gatekeeper`` (``gatekeeper.py``: the ordered-key
gate and the keeper thread renewing held leases) on brokers that would hand out a key's
later messages early; the settles ``Message`` asks for run here, with middleware told how
they went (``_Settling``); ``consume`` runs the loop of ``consuming`` on threads.
Separate from ``broker.py``: the consumer side keeps its own state (unsettled messages,
the gatekeeper) and needs nothing of the publish path; it names its broker by what it
uses of it (``_Broker``, a ``host.Host``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

from . import wire
from .batch import Batch, receive_batch
from .capabilities import Feature
from .checks import check_count as _check_count
from .checks import check_seconds as _check_seconds
from .consuming import (
    Backoff,
    ConsumeLoop,
    ConsumeStats,
    ThreadedConsume,
    check_handler,
    replying,
    stop_on_signals,
)
from .dedupe import DedupeStore
from .driver import DriverSubscription
from .errors import AlreadySettled, Closed, InvalidArgument, LeaseExpired, MQError
from .gatekeeper import Gatekeeper
from .guard import _Guard, _translate
from .hooks import Hooks
from .host import Host
from .message import Message, _ran_out
from .model import Delivery, GroupSpec
from .typed import Model
from .url import redact

log = logging.getLogger("mqabstract")

_EXPIRES_AT = wire.EXPIRES_AT
_CORRELATION_ID = wire.CORRELATION_ID
_REPLY_PREFIX = wire.REPLY_PREFIX
#: Longest driver wait inside ``receive`` while the ordered-key gate holds messages.
_HELD_POLL = 0.05


class _Broker(Host, Protocol):
    """The ``Broker`` as a subscription uses it: the consumer side's ``Host``, the
    middleware it tells of receives and settles, and the call that takes a closed
    subscription off its broker."""

    @property
    def _chain(self) -> Hooks: ...

    def _forget(self, sub: Subscription) -> None: ...


def _ttl_ended(text: str, now: float) -> bool:
    """Whether an ``mq-expires-at`` value is past (an unreadable one never expires)."""
    try:
        return float(text) <= now
    except ValueError:
        return False


class _Settling:
    """``Broker._guard`` around a driver settle call that also tells the middleware's
    ``settled`` notices how it went (a class: it sits on the ack path)."""

    __slots__ = ("guard", "messages", "op", "started", "sub")

    def __init__(self, sub: Subscription, op: str,
                 messages: Callable[[], Sequence[Message]]) -> None:
        self.sub, self.op, self.messages = sub, op, messages
        self.guard = sub._broker._guard
        self.started = sub._broker._chain.now()

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any
                 ) -> Literal[False]:
        error: MQError | None = None
        try:
            self.guard.__exit__(tp, exc, tb)
        except MQError as translated:
            error = translated
            raise
        finally:
            chain = self.sub._broker._chain
            # (LeaseExpired: told as "expired" by the caller; KeyboardInterrupt & co.: the
            # outcome is unknown, the caller puts the messages back)
            if chain.settlers and (exc is None or (isinstance(exc, Exception)
                                                   and not isinstance(exc, LeaseExpired))):
                if error is None and isinstance(exc, MQError):
                    error = exc
                chain.settled(self.sub, self.op, self.messages(), self.started, error)
        return False


class Subscription:
    """A consumer attached to a group; messages of the group are shared among its consumers."""

    def __init__(self, broker: _Broker, spec: GroupSpec, inner: DriverSubscription,
                 model: Model | None = None) -> None:
        self._broker = broker
        self._inner = inner
        self.spec = spec
        self.model = model  #: what ``Message.value`` is built into (``subscribe(model=)``)
        self._lock = threading.Lock()
        self._unsettled: set[Message] = set()
        #: extends in flight (``_extend``), which a settle judged late waits for
        self._extending: dict[Message, threading.Event] = {}
        self._closed = False
        self._stop = threading.Event()
        # A pattern starting with a wildcard also matches the reply routes' topics; their
        # replies (a correlation id on a mq-reply. topic) are for one requester, so this
        # group acks its copies away unseen.
        self._skips_replies = spec.pattern.split(".", 1)[0] in ("#", "*")
        # Ordered groups on a broker that would hand out a key's next message while an
        # earlier one is out: the gatekeeper's gate holds the later ones back (one rule).
        gated = spec.ordered and broker.capabilities.key_gate != "broker"
        self._gatekeeper = Gatekeeper(self) if gated else None

    @property
    def group(self) -> str:
        return self.spec.name

    @property
    def pattern(self) -> str:
        return self.spec.pattern

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise Closed(f"subscription to group {self.spec.name!r} is closed")
        self._broker._check_open()

    # -- receiving ---------------------------------------------------------------------
    def receive(self, max_messages: int = 1, wait: float = 0.0) -> list[Message]:
        """Return up to ``max_messages`` messages, waiting up to ``wait`` seconds for the first.

        Returns an empty list when nothing arrived in time. Messages that have already been
        delivered ``max_attempts`` times are moved to the dead-letter store, not returned.
        """
        started = self._noticed()
        out = self._take(max_messages, wait)
        if out:
            self._received(out, started)
        return out

    def _noticed(self) -> int:
        """The start time to give ``_received`` (0 when no middleware listens)."""
        return self._broker._chain.now()

    def _received(self, messages: list[Message], started: int) -> None:
        """Tell middleware of messages a receive (or a whole ``receive_batch``) handed out."""
        chain = self._broker._chain
        if chain.receivers:
            chain.received(self, messages, started)

    def _take(self, max_messages: int, wait: float) -> list[Message]:
        """``receive`` without the middleware's notice."""
        self._check_open()
        _check_count(max_messages, "max_messages")
        wait = _check_seconds(wait, "wait", math.inf)
        caps = self._broker.capabilities
        chain = self._broker._chain
        deadline = time.monotonic() + wait
        out: list[Message] = []
        spec = self.spec
        dead_letters = caps.supports(Feature.DEAD_LETTER)
        # The lease rule: a message is ours until the start of the driver receive call that
        # returned it + lease. The driver leases it later than that, so the broker's own
        # deadline is never earlier than ours. Each driver call waits at most a quarter of
        # the lease, so a message is handed over with at least 3/4 of its lease left — and
        # never more than half of it where the backend's minimum lease is coarser (a call
        # as long as the lease returned every message late: an SQS group with a 1 s lease
        # never dead-lettered an exhausted message while it idled).
        step = max(spec.lease / 4, min(caps.min_lease, spec.lease / 2))
        keeper = self._gatekeeper
        while True:
            span = step
            if keeper is not None and len(keeper.gate):
                out += keeper.unhold(max_messages - len(out))
                if len(out) >= max_messages:
                    break
                # Another thread's settle frees a held key: short driver waits see it soon.
                span = min(step, _HELD_POLL)
            remaining = max(0.0, deadline - time.monotonic())
            want = min(max_messages - len(out), caps.max_receive)
            lease_deadline = self._broker._monotonic() + spec.lease
            with self._broker._guard:
                batch = self._inner.receive(want, 0.0 if out else min(remaining, span))
            late = bool(batch) and self._broker._monotonic() >= lease_deadline
            if late:
                # The driver call outlasted the lease (a stalled broker call, a frozen
                # process): nobody sees these and nothing settles them — not even the
                # portable layer's own dead-lettering of an exhausted or expired one, a
                # settle after the deadline that used to reach the broker (SQS then moved
                # a message twice). The backend delivers them again once its lease ends.
                log.warning("receive from group %r returned %d messages after their lease "
                            "ended; they are delivered again", spec.name, len(batch))
                if chain.settlers:  # counted deliveries nobody saw: middleware may count them
                    self._gone([Message(d, self, 0.0) for d in batch])
                if out or self._closed or time.monotonic() >= deadline:
                    break
                continue
            now = None
            fresh: list[Message] = []
            ended: list[Delivery] = []
            replies: list[Delivery] = []
            missed: list[Delivery] = []  # counted deliveries the lease ran out on here
            unseen = keeper.unseen if keeper is not None else None
            skips = self._skips_replies
            # (no limit without dead letters: an exhausted message is delivered again)
            most = spec.max_attempts if dead_letters else math.inf
            for delivery in batch:
                if unseen and delivery.id in unseen:
                    delivery.attempt = max(1, delivery.attempt - unseen.pop(delivery.id))
                headers = delivery.headers
                if (skips and delivery.topic.startswith(_REPLY_PREFIX)
                        and headers and _CORRELATION_ID in headers):
                    replies.append(delivery)
                    continue
                if delivery.attempt > most:
                    if self._broker._monotonic() < lease_deadline:
                        self._expire(delivery)
                        if keeper is not None:
                            keeper.forget(delivery)
                    else:  # it comes again
                        missed.append(delivery)
                    continue
                if headers and _EXPIRES_AT in headers:
                    now = now or self._broker._now()
                    if _ttl_ended(headers[_EXPIRES_AT], now):
                        ended.append(delivery)
                        if keeper is not None:
                            keeper.forget(delivery)
                        continue
                fresh.append(Message(delivery, self, lease_deadline))
            if (replies or ended) and self._broker._monotonic() >= lease_deadline:
                missed += replies + ended  # too late to settle them: they come again
                replies, ended = [], []
            if replies:
                try:
                    self._ack_away(replies)
                except MQError as exc:  # they come again and are skipped again
                    log.debug("receive from group %r: acking %d replies away: %s",
                              spec.name, len(replies), exc)
            if ended:
                self._ttl_ended(ended, dead_letters)
            if fresh and self._broker._monotonic() >= lease_deadline:
                # Settling the others took the rest of the lease (a backlog of expired
                # messages on a slow broker): as for a late receive.
                log.warning("receive from group %r: %d messages outlived their lease "
                            "while others were settled; they are delivered again",
                            spec.name, len(fresh))
                gone, fresh = fresh, []
            else:
                gone = []
            if (missed or gone) and chain.settlers:  # as for a late batch: seen by nobody
                self._gone([*gone, *(Message(d, self, 0.0) for d in missed)])
            if keeper is not None and fresh:
                fresh = keeper.admit(fresh)
            out += fresh
            if out or self._closed or time.monotonic() >= deadline:
                break
        if out:
            with self._lock:
                self._unsettled.update(out)
        return out

    def receive_batch(self, max_messages: int = 100, wait: float = 0.0) -> Batch:
        """Up to ``max_messages`` messages as one ``Batch`` (columns, one lease, whole-batch
        settles), waiting up to ``wait`` seconds for the first; empty when none arrived.

        ``receive`` called until the batch is full or nothing more is ready, so every rule
        of ``receive`` holds for each message; the same typed errors for bad arguments.
        """
        return receive_batch(self, max_messages, wait)

    def _ttl_ended(self, deliveries: Sequence[Delivery], dead_letters: bool) -> None:
        """Their TTL ended before this group received them: never delivered; dead-lettered
        with reason ``expired`` (or acked away in one call, for ``expired="drop"``)."""
        if dead_letters and self.spec.expired == "dead_letter":
            for delivery in deliveries:
                self._dead_letter_expired(delivery)
        else:
            self._ack_away(deliveries)

    def _ack_away(self, deliveries: Sequence[Delivery]) -> None:
        """Settle deliveries nobody is shown (dropped expired ones, others' replies)."""
        with self._settling("ack", lambda: [Message(d, self, 0.0) for d in deliveries]):
            self._inner.ack([d.receipt for d in deliveries])

    def _dead_letter_expired(self, delivery: Delivery) -> None:
        with self._settling("dead_letter", lambda: (Message(delivery, self, 0.0),)):
            self._inner.dead_letter(delivery.receipt, "expired", delivery.attempt - 1)

    def _expire(self, delivery: Delivery) -> None:
        reason = f"max attempts ({self.spec.max_attempts}) exceeded"
        with self._settling("dead_letter", lambda: (Message(delivery, self, 0.0),)):
            self._inner.dead_letter(delivery.receipt, reason, delivery.attempt - 1)

    def _settling(self, op: str, messages: Callable[[], Sequence[Message]]
                  ) -> _Settling | _Guard:
        """The guard around a driver settle call, telling middleware how it ended (the
        plain guard when no middleware listens)."""
        if self._broker._chain.settlers:
            return _Settling(self, op, messages)
        return self._broker._guard

    def _gone(self, messages: Sequence[Message]) -> None:
        """Tell middleware these messages' leases ran out before they were settled."""
        chain = self._broker._chain
        if chain.settlers and messages:
            chain.settled(self, "expired", messages, chain.now())

    # -- settlement (called by Message) ---------------------------------------------------
    def _ungate(self, messages: Iterable[Message], back: float | None) -> None:
        """Tell an ordered group's gatekeeper of settled messages (``Gatekeeper.ungate``)."""
        if self._gatekeeper is not None:
            self._gatekeeper.ungate(messages, back)

    def _forget(self, msg: Message) -> None:
        with self._lock:
            self._unsettled.discard(msg)

    def _ack(self, msg: Message) -> None:
        """``Message.ack``: ``ack_many((msg,))``, its common case (unsettled and in time,
        nothing to wait for, no middleware listening, no ordered-key gate) without the
        batch's bookkeeping; any other case goes to ``ack_many``."""
        if (msg._state is not None or self._extending or self._gatekeeper is not None
                or self._broker._chain.settlers):
            self.ack_many((msg,))
            return
        self._check_open()
        now = self._broker._monotonic()
        with self._lock:  # atomic with a hand-back from another thread (see _begin)
            taken = msg._state is None and now < msg._deadline
            if taken:
                msg._state = "acked"
                self._unsettled.discard(msg)
        if not taken:  # late, or settled meanwhile by another thread
            self.ack_many((msg,))
            return
        try:
            self._inner.ack((msg._receipt,))
        except LeaseExpired as exc:
            if not exc.receipts or msg._receipt in exc.receipts:
                msg._state = "expired"
                self._gone((msg,))
            raise
        except BaseException as exc:
            self._not_acked((msg,))
            if isinstance(exc, Exception) and not isinstance(exc, MQError):
                # (the broker's guard, written out: this is the per-message path)
                raise _translate(exc, self._broker._guard.backend) from exc
            raise

    def _not_acked(self, messages: Sequence[Message]) -> None:
        """An ack the driver failed (as far as anyone knows, not done): the messages are
        unsettled again; the caller may retry or let the lease run out."""
        with self._lock:
            for msg in messages:
                msg._state = None
                self._unsettled.add(msg)

    def ack_many(self, messages: Iterable[Message]) -> None:
        """Ack messages of this subscription with one driver call: what ``Message.ack`` does
        for each, at a fraction of the cost per message.

        All are checked first: one from another subscription (``InvalidArgument``) or one
        already nacked or dead-lettered (``AlreadySettled``) raises before any is acked.
        Already acked ones are skipped. Those whose lease ran out (or that the backend
        reports as lost with their connection or partition) are not acked — they come
        again — and ``LeaseExpired`` says so after the others are.
        """
        self._check_open()
        batch = messages if isinstance(messages, (list, tuple)) else list(messages)
        for msg in batch:
            if not isinstance(msg, Message) or msg._sub is not self:
                raise InvalidArgument("ack_many takes messages received from this subscription")
            state = msg._state
            if state is not None and state != "acked" and state != "expired":
                raise AlreadySettled(f"message {msg.id} was already {state}")
        if self._extending:
            for msg in batch:
                self._await_extend(msg)
        now = self._broker._monotonic()
        todo: list[Message] = []
        late: list[Message] = []
        newly_late: list[Message] = []  # (middleware hears of an expiry once)
        with self._lock:  # atomic with a hand-back from another thread (see _begin)
            discard = self._unsettled.discard
            for msg in batch:
                state = msg._state
                if state is None and now < msg._deadline:
                    msg._state = "acked"
                    todo.append(msg)
                    discard(msg)
                elif state == "acked":
                    continue
                elif state is None or state == "expired":
                    if state is None:
                        newly_late.append(msg)
                    msg._state = "expired"
                    late.append(msg)
                    discard(msg)
                # else: handed back meanwhile by a stopping consume loop: it comes again
        if todo:
            try:
                with self._settling("ack", lambda: [m for m in todo if m._state == "acked"]):
                    self._inner.ack([msg._receipt for msg in todo])
            except LeaseExpired as exc:
                stale = set(exc.receipts)
                for msg in todo:
                    if not stale or msg._receipt in stale:
                        msg._state = "expired"
                self._gone([*newly_late, *(m for m in todo if m._state == "expired")])
                chain = self._broker._chain
                if chain.settlers and (done := [m for m in todo if m._state == "acked"]):
                    chain.settled(self, "ack", done, chain.now())
                raise
            except BaseException:
                self._not_acked(todo)
                raise
            if self._gatekeeper is not None:
                self._ungate(todo, None)
        if late:
            self._gone(newly_late)
            raise _ran_out(late)

    def _check_nack(self, delay: object) -> None:
        self._check_open()
        caps = self._broker.capabilities
        seconds = _check_seconds(delay, "nack delay", caps.max_delay)
        if seconds > 0:
            self._broker._require(Feature.NACK_DELAY)

    def _settle_nack(self, msg: Message, delay: float) -> None:
        self._forget(msg)
        if msg.attempt >= self.spec.max_attempts and self._broker.capabilities.supports(
            Feature.DEAD_LETTER
        ):
            reason = f"nacked on final attempt ({msg.attempt} of {self.spec.max_attempts})"
            with self._settling("dead_letter", lambda: (msg,)):
                self._inner.dead_letter(msg._receipt, reason, msg.attempt)
            self._ungate((msg,), None)
        else:
            with self._settling("nack", lambda: (msg,)):
                self._inner.nack(msg._receipt, delay)
            self._ungate((msg,), delay)

    def _settle_dead(self, msg: Message, reason: str, attempts: int) -> None:
        self._forget(msg)
        with self._settling("dead_letter", lambda: (msg,)):
            self._inner.dead_letter(msg._receipt, reason[:1000], attempts)
        self._ungate((msg,), None)

    def _check_extend(self, seconds: object) -> float:
        """An extend's checks (open, supported, a valid lease): the seconds to renew by."""
        self._check_open()
        self._broker._require(Feature.LEASE_EXTEND)
        return self._broker._check_lease(seconds, "extend")

    def _extend(self, msg: Message, seconds: object) -> None:
        value = self._check_extend(seconds)
        renewed = self._broker._monotonic() + value  # read before the driver renews
        done = threading.Event()
        with self._lock:
            self._extending[msg] = done
        try:
            with self._broker._guard:
                self._inner.extend(msg._receipt, value)
            msg._deadline = renewed
        finally:
            with self._lock:
                if self._extending.get(msg) is done:
                    del self._extending[msg]
            done.set()

    def _await_extend(self, msg: Message) -> None:
        """A settle of ``msg`` at or after its deadline first waits for an extend in
        flight on another thread: admitted before the deadline, it takes effect (the
        driver may renew the lease after it), and the settle is judged on its outcome —
        not refused while the broker holds the message for the new lease."""
        done = self._extending.get(msg)
        if done is not None and self._broker._monotonic() >= msg._deadline:
            done.wait()

    # -- push-style loop ------------------------------------------------------------------
    def consume(
        self,
        handler: Callable[[Message], object],
        *,
        max_messages: int | None = None,
        idle_timeout: float | None = None,
        batch: int = 10,
        wait: float = 1.0,
        backoff: Backoff | None = None,
        stop: threading.Event | None = None,
        concurrency: int = 1,
        auto_extend: bool | None = None,
        grace: float = 30.0,
        signals: bool = False,
        dedupe: DedupeStore | None = None,
        reply: bool = False,
    ) -> ConsumeStats:
        """Call ``handler`` for each message until stopped; return what happened.

        A handler that returns acks the message (unless it settled it itself); one that
        raises gets the message nacked with exponential ``backoff``, and dead-lettered with
        the exception as reason once ``max_attempts`` deliveries are used up. A payload that
        fails the subscription's ``model`` is dead-lettered at once, never handled.

        ``concurrency`` handlers run at once (a pool of threads; 1 runs them on this
        thread), with at most ``max(concurrency, batch)`` messages leased; in an ordered
        group two messages of one key never run at the same time. ``auto_extend`` (on by
        default where leases can be extended) renews the lease of every held message with
        less than half of it left, so a slow handler keeps its message.

        The loop ends after ``max_messages`` messages (once their handlers finish), after
        ``idle_timeout`` seconds without any, or on a stop: ``stop`` set,
        ``Subscription.stop()``, or SIGTERM/SIGINT with ``signals=True``. A stop takes no
        more messages, hands back those not started at once, gives running handlers
        ``grace`` seconds and then hands theirs back too: nothing is lost, only the
        unfinished come again. Retryable broker errors (a dropped connection) are retried
        with backoff; others propagate.

        With ``dedupe`` (a ``mqabstract.dedupe`` store) the loop is an idempotent consumer:
        a message whose id the store has recorded for this group is acked without calling
        the handler (``ConsumeStats.duplicates``); after a handler succeeds the store records
        the id, then the message is acked. With ``reply=True`` a handler's non-None return
        value answers a request (``Message.reply``) before the ack.
        """
        check_handler(handler, coroutine=False)
        handler = replying(handler, reply)
        loop = ConsumeLoop(self, max_messages=max_messages, idle_timeout=idle_timeout,
                           batch=batch, wait=wait, backoff=backoff, concurrency=concurrency,
                           auto_extend=auto_extend, grace=grace, dedupe=dedupe)
        if not isinstance(signals, bool):
            raise InvalidArgument(f"signals must be a bool, got {signals!r}")
        self._check_open()
        self._stop.clear()
        with stop_on_signals(signals, self._stop.set):
            return ThreadedConsume(self, self._broker._chain.wrap(handler), loop, stop).run()

    def stop(self) -> None:
        """Stop a running ``consume`` (from any thread or a signal handler): it takes no more
        messages and returns once running handlers finish (within its ``grace``)."""
        self._stop.set()

    def close(self) -> None:
        """Detach. Unsettled messages are handed back for redelivery at once (idempotent)."""
        if self._closed:
            return
        self._stop.set()
        keeper = self._gatekeeper
        if keeper is not None:
            keeper.stop()
        with self._lock:
            pending = list(self._unsettled)
            self._unsettled.clear()
            # Held ones go back after their key's head, in their order.
            pending += keeper.gate.drain() if keeper is not None else ()
        self._release(pending)
        self._closed = True
        self._broker._forget(self)
        with self._broker._guard:
            self._inner.close()

    def _release(self, messages: Iterable[Message]) -> None:
        """Hand unsettled messages back for redelivery at once (close; a cancelled asyncio
        receive). Never dead-letters; a message whose lease is gone is left to expire."""
        now = self._broker._monotonic()
        for msg in messages:
            with self._lock:  # atomic with a settle from another thread (see Message._begin)
                if msg._state is not None or now >= msg._deadline:
                    continue  # settled meanwhile, or stale: a stale release never goes out
                msg._state = "released"
                self._unsettled.discard(msg)
            try:
                with self._settling("release", lambda m=msg: (m,)):  # type: ignore[misc]
                    self._inner.nack(msg._receipt, 0.0)
            except Exception as exc:  # the connection may be gone; leases expire anyway
                # A warning: the message now waits out its lease before anyone gets it.
                log.warning("release of %s failed (delivered again after its lease): %s",
                            msg.id, redact(str(exc)))
                continue
            self._ungate((msg,), 0.0)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Subscription(group={self.spec.name!r}, pattern={self.spec.pattern!r}, {state})"
