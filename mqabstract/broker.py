"""The portable layer: ``Broker``, ``Subscription`` and ``Message``.

Everything that must behave the same on every backend happens here, once: validation and
encoding before anything is sent, limit checks against the declared capabilities, batch
chunking, the consume loop with retry/backoff, the dead-letter decision after
``max_attempts``, settlement bookkeeping, and translation of stray driver exceptions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from . import codec, names, wire
from .capabilities import Capabilities, Feature
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
from .driver import Driver, DriverSubscription
from .emulation.ordering import RETURN_PATIENCE, KeyGate
from .errors import (
    AlreadySettled,
    Closed,
    DecodeError,
    InvalidArgument,
    LeaseExpired,
    MessageTooLarge,
    MQError,
    NotSent,
    PublishError,
    Unsupported,
    ValidationError,
)
from .guard import _Guard, _translate
from .message import Message, _ran_out
from .middleware import NO_MIDDLEWARE, Chain, Publishing
from .model import (
    Columns,
    DeadLetter,
    Delivery,
    Envelope,
    GroupSpec,
    GroupStats,
    OutgoingMessage,
)
from .options import check_options
from .requests import REPLY_PREFIX, ReplyRoute
from .typed import Model
from .url import BrokerURL, redact

__all__ = ["Backoff", "Broker", "ConsumeStats", "Message", "Subscription"]

log = logging.getLogger("mqabstract")

_CARRIED = wire.CARRIED
_EXPIRES_AT = wire.EXPIRES_AT
_CORRELATION_ID = wire.CORRELATION_ID
#: What a group does with a message whose TTL ended before delivery (``declare(expired=)``).
EXPIRED_CHOICES = ("dead_letter", "drop")
#: Longest driver wait inside ``receive`` while the ordered-key gate holds messages.
_HELD_POLL = 0.05


def _ttl_ended(text: str, now: float) -> bool:
    """Whether an ``mq-expires-at`` value is past (an unreadable one never expires)."""
    try:
        return float(text) <= now
    except ValueError:
        return False


#: The keywords ``declare`` / ``subscribe`` take themselves (named in an unknown-option
#: error beside the driver's ``GROUP_OPTIONS``).
_GROUP_KEYWORDS = ("expired", "lease", "max_attempts", "model", "ordered", "priority")

class _IdSource:
    """Unique message ids: 80 random bits per process + a 48-bit counter, as 32 hex chars.

    As unique as a UUID4 in practice, but one syscall per process instead of per message;
    reseeded in a forked child so parent and child never share a prefix.
    """

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = os.urandom(10).hex()
        self.counter = itertools.count(int.from_bytes(os.urandom(3), "big"))

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter) & 0xFFFFFFFFFFFF:012x}"

    def take(self, n: int) -> list[str]:
        """``n`` fresh ids at once."""
        prefix = self.prefix
        return [f"{prefix}{c & 0xFFFFFFFFFFFF:012x}" for c in itertools.islice(self.counter, n)]


_ids_source = _IdSource()


_FIELDS = frozenset(("topic", "body", "headers", "key", "priority", "delay", "deliver_at", "id",
                     "ttl"))


def _as_columns(items: list[Any]) -> tuple[str, list[Any], list[str] | None,
                                           list[Any] | None, list[Any] | None] | None:
    """A ``publish_batch`` list as columns (topic, bodies, ids, keys, row headers) when
    every item goes to one topic without delay or priority; None otherwise (then the
    envelope path validates, and reports, item by item)."""
    topic: object = None
    bodies: list[Any] = []
    ids: list[Any] = []
    keys: list[Any] = []
    rows: list[Any] = []
    t: Any
    for item in items:
        if type(item) is OutgoingMessage:
            if item.priority is not None or item.delay is not None or item.deliver_at \
                    or item.ttl is not None:
                return None
            t, body, hdrs, key, mid = item.topic, item.body, item.headers, item.key, item.id
        elif type(item) is tuple and len(item) == 2:
            t, body = item
            hdrs = key = mid = None
        elif isinstance(item, Mapping):
            if not item.keys() <= _FIELDS or "body" not in item or any(
                    item.get(f) is not None for f in ("priority", "delay", "deliver_at", "ttl")):
                return None
            t, body = item.get("topic"), item["body"]
            hdrs, key, mid = item.get("headers"), item.get("key"), item.get("id")
        else:
            return None
        if topic is None:
            topic = t
        elif t != topic:
            return None
        bodies.append(body)
        ids.append(mid)
        keys.append(key)
        rows.append(hdrs)
    if not isinstance(topic, str):
        return None
    if any(m is not None for m in ids):
        fresh = iter(_ids_source.take(sum(m is None for m in ids)))
        ids = [next(fresh) if m is None else m for m in ids]
        id_col: list[str] | None = ids
    else:
        id_col = None
    return (topic, bodies, id_col, keys if any(k is not None for k in keys) else None,
            rows if any(rows) else None)


def _check_column(values: list[Any], check: Callable[[Any], object], max_len: int, *,
                  spaces: bool, nullable: bool) -> None:
    """``check`` (a ``names`` checker) for a column of str (None rows pass when
    ``nullable``): tested in C on the joined text, row by row only to find and name the bad
    row (``error.index``)."""
    present = [v for v in values if v is not None] if nullable else values
    try:
        joined = "".join(present)
        ok = (joined.isascii() and joined.isprintable() and (spaces or " " not in joined)
              and (not present or (min(map(len, present)) > 0
                                   and max(map(len, present)) <= max_len)))
    except TypeError:  # a row that is not a str
        ok = False
    if not ok:
        for i, v in enumerate(values):
            try:
                if v is not None or not nullable:
                    check(v)
            except ValidationError as exc:
                raise type(exc)(str(exc), index=i) from exc


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

    def __init__(self, broker: Broker, spec: GroupSpec, inner: DriverSubscription,
                 model: Model | None = None) -> None:
        self._broker = broker
        self._inner = inner
        self.spec = spec
        self.model = model  #: what ``Message.value`` is built into (``subscribe(model=)``)
        self._lock = threading.Lock()
        self._unsettled: set[Message] = set()
        self._closed = False
        self._stop = threading.Event()
        # A pattern starting with a wildcard also matches the reply routes' topics; their
        # replies (a correlation id on a mq-reply. topic) are for one requester, so this
        # group acks its copies away unseen.
        self._skips_replies = spec.pattern.split(".", 1)[0] in ("#", "*")
        # Ordered groups on a broker that would hand out a key's next message while an
        # earlier one is out: the gate holds the later ones back (one rule, kept here).
        caps = broker.capabilities
        self._gate: KeyGate[Message] | None = (
            KeyGate(max(2 * spec.lease, RETURN_PATIENCE), hand_back=caps.key_gate == "hand_back")
            if spec.ordered and caps.key_gate != "broker" else None)
        self._can_extend = caps.supports(Feature.LEASE_EXTEND)
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()
        # Held messages handed back unseen (key_gate="hand_back") -> how many times: the
        # broker counted those receives as deliveries; the application never saw them.
        self._unseen: dict[str, int] = {}

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
        self._check_open()
        _check_count(max_messages, "max_messages")
        wait = _check_seconds(wait, "wait", math.inf)
        caps = self._broker.capabilities
        chain = self._broker._chain
        started = chain.now()
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
        gate = self._gate
        while True:
            span = step
            if gate is not None and len(gate):
                out += self._unhold(max_messages - len(out))
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
                if out or self._closed or time.monotonic() >= deadline:
                    break
                continue
            now = None
            fresh: list[Message] = []
            ended: list[Delivery] = []
            replies: list[Delivery] = []
            unseen = self._unseen
            for delivery in batch:
                if unseen and delivery.id in unseen:
                    delivery.attempt = max(1, delivery.attempt - unseen.pop(delivery.id))
                if (self._skips_replies and delivery.topic.startswith(REPLY_PREFIX)
                        and delivery.headers and _CORRELATION_ID in delivery.headers):
                    replies.append(delivery)
                    continue
                if dead_letters and delivery.attempt > spec.max_attempts:
                    if self._broker._monotonic() < lease_deadline:  # else: it comes again
                        self._expire(delivery)
                        if gate is not None:
                            self._gate_forget(delivery)
                    continue
                if delivery.headers and _EXPIRES_AT in delivery.headers:
                    now = now or self._broker._now()
                    if _ttl_ended(delivery.headers[_EXPIRES_AT], now):
                        ended.append(delivery)
                        if gate is not None:
                            self._gate_forget(delivery)
                        continue
                fresh.append(Message(delivery, self, lease_deadline))
            if (replies or ended) and self._broker._monotonic() >= lease_deadline:
                replies, ended = [], []  # too late to settle them: they come again
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
                fresh = []
            if gate is not None and fresh:
                fresh = self._admit(fresh)
            out += fresh
            if out or self._closed or time.monotonic() >= deadline:
                break
        if out:
            with self._lock:
                self._unsettled.update(out)
            if chain.receivers:
                chain.received(self, out, started)
        return out

    # -- the ordered-key gate (groups declared ordered=True on brokers that would hand out
    # a key's next message while an earlier one is out: Capabilities.key_gate) -----------
    def _admit(self, fresh: list[Message]) -> list[Message]:
        """Received messages through the gate: those that go out now (the rest are held,
        their leases renewed by the keeper thread until their key is free)."""
        gate = self._gate
        assert gate is not None
        now = self._broker._monotonic()
        with self._lock:
            out = [m for m in fresh if gate.admit(m, now)]
            if len(gate) and (self._keeper is None or not self._keeper.is_alive()):
                self._keeper = threading.Thread(
                    target=self._keep, name=f"mqabstract-held-{self.spec.name}", daemon=True)
                self._keeper.start()
            back = self._outgoing_locked()
        if back:
            self._hand_back(back)
        return out

    def _hand_back(self, messages: list[Message]) -> None:
        """Give held messages back to the broker unseen; their next delivery here does not
        count this one (the broker did: SQS's receive count)."""
        unseen = self._unseen
        if len(unseen) > 10_000:  # ids that came back to other consumers: forget them
            unseen.clear()
        for msg in messages:
            unseen[msg.id] = unseen.get(msg.id, 0) + 1
        self._release(messages)

    def _outgoing_locked(self) -> list[Message]:
        """Held messages the gate gives back to the broker (``key_gate="hand_back"``)."""
        gate = self._gate
        if gate is None or not gate.outgoing:
            return []
        out, gate.outgoing = gate.outgoing, []
        return out

    def _unhold(self, limit: int) -> list[Message]:
        """Held messages whose key became free, each with a fresh lease from now (one
        whose lease is gone is never handed out: it comes again, first of its key)."""
        gate = self._gate
        assert gate is not None
        now = self._broker._monotonic()
        with self._lock:
            ready = gate.ready(now, limit)
            back = self._outgoing_locked()
        if back:
            self._hand_back(back)
        out: list[Message] = []
        for i, msg in enumerate(ready):
            try:
                renewed = self._renew(msg)
            except BaseException:
                with self._lock:
                    for rest in reversed(ready[i:]):
                        gate.put_back(rest)
                if out:
                    with self._lock:
                        self._unsettled.update(out)
                raise
            if renewed:
                out.append(msg)
            else:
                with self._lock:
                    gate.returned(msg, now + gate.patience)
        return out

    def _renew(self, msg: Message) -> bool:
        """Renew a held message's lease for a whole lease from now; False when it is gone
        (without lease extend: whether its first lease still runs)."""
        broker = self._broker
        now = broker._monotonic()
        if now >= msg._deadline or not self._can_extend:  # the lease rule: ours ended
            return now < msg._deadline
        renewed = now + self.spec.lease  # read before the driver renews
        try:
            with broker._guard:
                self._inner.extend(msg._receipt, self.spec.lease)
        except LeaseExpired:
            return False
        msg._deadline = renewed
        return True

    def _renew_held(self) -> int:
        """Renew the leases of held messages with less than half a lease left, so their
        broker lease never runs out while they wait; returns how many are held."""
        gate = self._gate
        assert gate is not None
        now = self._broker._monotonic()
        with self._lock:
            due = gate.renewals(now, self.spec.lease / 2)
        for msg in due:
            try:
                kept = self._renew(msg)
            except MQError as exc:  # the broker away for a moment: the next tick retries
                log.debug("renewing a held message of group %r: %s", self.spec.name, exc)
                continue
            if not kept:
                with self._lock:
                    gate.lost(msg, now + gate.patience)
        with self._lock:
            back = self._outgoing_locked()
        if back:
            self._hand_back(back)
        with self._lock:
            return len(gate)

    def _keep(self) -> None:
        """The keeper thread: renews held leases every quarter lease while any are held."""
        tick = min(max(self.spec.lease / 4, 0.01), 5.0)
        while not self._keeper_stop.wait(tick):
            try:
                if not self._renew_held():
                    with self._lock:
                        if self._gate is None or not len(self._gate):
                            self._keeper = None
                            return
            except Exception as exc:  # e.g. Closed while closing
                log.debug("keeper of group %r: %s", self.spec.name, exc)

    def _ungate(self, messages: Iterable[Message], back: float | None) -> None:
        """Settled: ``back`` None, done (acked, dead-lettered): the key is free; else the
        message comes again after ``back`` seconds and its key waits for it."""
        gate = self._gate
        if gate is None:
            return
        with self._lock:
            if back is None:
                for msg in messages:
                    gate.done(msg)
            else:
                until = self._broker._monotonic() + back + gate.patience
                for msg in messages:
                    gate.returned(msg, until)
            out = self._outgoing_locked()
        if out:
            self._hand_back(out)

    def _gate_forget(self, delivery: Delivery) -> None:
        """A delivery nobody is shown (dead-lettered or expired on receipt) will not come
        again: its key stops waiting for it."""
        assert self._gate is not None
        with self._lock:
            self._gate.gone(delivery.key, delivery.id)

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
    def _forget(self, msg: Message) -> None:
        with self._lock:
            self._unsettled.discard(msg)

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
                # Not acked (as far as anyone knows): unsettled again, the caller may retry
                # or let the lease run out.
                with self._lock:
                    for msg in todo:
                        msg._state = None
                        self._unsettled.add(msg)
                raise
            if self._gate is not None:
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

    def _extend(self, msg: Message, seconds: object) -> None:
        self._check_open()
        self._broker._require(Feature.LEASE_EXTEND)
        value = self._broker._check_lease(seconds, "extend")
        renewed = self._broker._monotonic() + value  # read before the driver renews
        with self._broker._guard:
            self._inner.extend(msg._receipt, value)
        msg._deadline = renewed

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

    def _invalid(self, msg: Message) -> str | None:
        """Why ``msg``'s payload fails the subscription's model (None: it fits, or there is
        no model). Decodes it once; the handler then reads ``msg.value`` for free."""
        if self.model is None:
            return None
        try:
            msg.value  # noqa: B018 - decodes and caches
        except DecodeError as exc:
            return str(exc)
        return None

    def _reject(self, msg: Message, reason: str) -> tuple[str, ...]:
        """Dead-letter a message whose payload is invalid: retrying cannot fix it."""
        log.warning("consume: %s dead-lettered: invalid payload: %s", msg.id, reason)
        try:
            msg.dead_letter(f"invalid payload: {reason}")
        except LeaseExpired as late:
            self._count_expired(msg, late)
            return ("expired",)
        return ("invalid", "dead_lettered")

    def _outcome(self, msg: Message, exc: Exception | None, backoff: Backoff
                 ) -> tuple[str, ...]:
        """Settle ``msg`` after its handler returned (``exc`` None: ack unless it settled
        the message itself) or raised ``exc`` (nack with backoff; dead-letter on the final
        attempt; a ``LeaseExpired`` is counted, not retried). Returns the ``ConsumeStats``
        counters to add. Shared by the sync and the asyncio ``consume``."""
        if isinstance(exc, LeaseExpired):  # the handler settled too late: counted, logged
            self._count_expired(msg, exc)
            return ("expired",)
        counts: tuple[str, ...] = () if exc is None else ("failed",)
        if msg.settled:
            return counts
        caps = self._broker.capabilities
        try:
            if exc is None:
                msg.ack()
                return ("acked",)
            if caps.supports(Feature.DEAD_LETTER) and msg.attempt >= self.spec.max_attempts:
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("consume: %s dead-lettered after %d attempts: %s",
                            msg.id, msg.attempt, reason)
                msg.dead_letter(reason)
                return (*counts, "dead_lettered")
            msg.nack(backoff.delay(msg.attempt) if caps.supports(Feature.NACK_DELAY) else 0.0)
            return (*counts, "retried")
        except LeaseExpired as late:
            self._count_expired(msg, late)
            return (*counts, "expired")

    @staticmethod
    def _count_expired(msg: Message, exc: LeaseExpired) -> None:
        log.warning("consume: handler outlived the lease of %s (attempt %d): %s",
                    msg.id, msg.attempt, exc)

    def stop(self) -> None:
        """Stop a running ``consume`` (from any thread or a signal handler): it takes no more
        messages and returns once running handlers finish (within its ``grace``)."""
        self._stop.set()

    def close(self) -> None:
        """Detach. Unsettled messages are handed back for redelivery at once (idempotent)."""
        if self._closed:
            return
        self._stop.set()
        self._keeper_stop.set()
        with self._lock:
            pending = list(self._unsettled)
            self._unsettled.clear()
            # Held ones go back after their key's head, in their order.
            pending += self._gate.drain() if self._gate is not None else ()
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


class Broker:
    """A connection to one backend, chosen by URL. Use ``mqabstract.connect()`` to get one."""

    def __init__(self, driver: Driver, url: BrokerURL, middleware: Chain = NO_MIDDLEWARE
                 ) -> None:
        self._driver = driver
        self._chain = middleware
        self._url = url
        self._caps: Capabilities = driver.capabilities
        self._guard = _Guard(driver.name)
        self._clock = getattr(driver, "clock", None)
        # Lease deadlines: the injected clock (a FakeClock moves only when advanced), else
        # the process's monotonic clock. A clock without monotonic() is read by time().
        self._monotonic: Callable[[], float] = (
            time.monotonic if self._clock is None
            else getattr(self._clock, "monotonic", None) or self._clock.time
        )
        self._closed = False
        self._lock = threading.Lock()
        self._subs: set[Subscription] = set()
        self._route: ReplyRoute | None = None
        self._closing = False
        try:
            middleware.bind(self)
        except BaseException:
            with contextlib.suppress(Exception):
                driver.close()
            raise

    # -- introspection --------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The broker URL with secrets redacted."""
        return self._url.redacted()

    @property
    def backend(self) -> str:
        return self._driver.name

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def closed(self) -> bool:
        return self._closed

    def _now(self) -> float:
        return self._clock.time() if self._clock is not None else time.time()

    def _check_lease(self, value: object, what: str) -> float:
        """A lease or extend in seconds within this backend's [min_lease, max_lease]."""
        seconds = _check_seconds(value, what, self._caps.max_lease, allow_zero=False)
        if seconds < self._caps.min_lease:
            raise InvalidArgument(
                f"{what}={seconds:g}s is below this backend's minimum lease of "
                f"{self._caps.min_lease:g}s"
            )
        return seconds

    def _check_open(self) -> None:
        if self._closed:
            raise Closed(f"broker {self.url} is closed")

    def _require(self, feature: Feature) -> None:
        self._caps.require(feature, self._driver.name)

    def _translate(self, exc: Exception) -> MQError:
        return _translate(exc, self._driver.name)

    # -- publishing -----------------------------------------------------------------------
    def _envelope(
        self,
        topic: str,
        body: object,
        headers: Mapping[str, str] | None,
        key: str | None,
        priority: int | None,
        delay: float | None,
        deliver_at: datetime | None,
        message_id: str | None,
        now: float,
        ttl: float | None = None,
        wire_headers: Mapping[str, str] | None = None,
    ) -> Envelope:
        caps = self._caps
        names.check_topic(topic)
        data, content_type = codec.encode(body)
        if len(data) > caps.max_body_bytes:
            raise MessageTooLarge(
                f"body is {len(data)} bytes; {self._driver.name} allows {caps.max_body_bytes}"
            )
        out_headers = self._headers(headers, content_type)
        if key is not None:
            names.check_key(key)
        if priority is None:
            prio = 0
        else:
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise InvalidArgument(f"priority must be an int, not {type(priority).__name__}")
            if not 0 <= priority <= 9:
                raise InvalidArgument(f"priority must be 0-9, got {priority}")
            if priority:
                self._require(Feature.PRIORITY)
                if priority > caps.max_priority:
                    raise InvalidArgument(
                        f"priority {priority} exceeds {self._driver.name}'s maximum "
                        f"{caps.max_priority}"
                    )
            prio = priority
        due: float | None = None
        if delay is not None and deliver_at is not None:
            raise InvalidArgument("give either delay or deliver_at, not both")
        if delay is not None:
            seconds = _check_seconds(delay, "delay", caps.max_delay)
            if seconds > 0:
                self._require(Feature.DELAY)
                due = now + seconds
        elif deliver_at is not None:
            if not isinstance(deliver_at, datetime):
                raise InvalidArgument("deliver_at must be a datetime")
            if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
                raise InvalidArgument("deliver_at must be timezone-aware (e.g. tz=timezone.utc)")
            ts = deliver_at.timestamp()
            if ts > now:
                self._require(Feature.DELAY)
                if ts - now > caps.max_delay:
                    raise InvalidArgument(
                        f"deliver_at is {ts - now:g}s away; {self._driver.name} allows "
                        f"{caps.max_delay:g}s"
                    )
                due = ts
        if ttl is not None:
            seconds = _check_seconds(ttl, "ttl", caps.max_ttl, allow_zero=False)
            self._require(Feature.TTL)
            if due is not None and due >= now + seconds:
                raise InvalidArgument(f"the message would expire (ttl={seconds:g}s) before "
                                      "its delay ends")
            out_headers[wire.EXPIRES_AT] = repr(now + seconds)
        if wire_headers:
            out_headers.update(wire_headers)
        if message_id is None:
            message_id = _ids_source.next()
        else:
            names.check_id(message_id)
        return Envelope(message_id, topic, data, out_headers, key, prio, due, now)

    def _headers(self, headers: Mapping[str, str] | None, content_type: str | None
                 ) -> dict[str, str]:
        """Validated user headers plus the codec's content-type."""
        caps = self._caps
        out_headers: dict[str, str] = {}
        if headers:
            if not isinstance(headers, Mapping):
                raise InvalidArgument(f"headers must be a mapping, not {type(headers).__name__}")
            if len(headers) > caps.max_headers:
                raise MessageTooLarge(
                    f"{len(headers)} headers; {self._driver.name} allows {caps.max_headers}"
                )
            size = 0
            for name, value in headers.items():
                if name == codec.CONTENT_TYPE:
                    if content_type is not None:
                        raise InvalidArgument(
                            "content-type is set by the codec for str and JSON bodies; "
                            "set it yourself only on bytes bodies"
                        )
                else:
                    names.check_header_name(name)
                names.check_text_value(value, f"header {name!r}")
                # Names are ASCII by the naming rules; ASCII values need no encoding to measure.
                size += len(name) + (len(value) if value.isascii() else len(value.encode()))
                out_headers[name] = value
            if size > caps.max_header_bytes:
                raise MessageTooLarge(
                    f"headers take {size} bytes; {self._driver.name} allows "
                    f"{caps.max_header_bytes}"
                )
        if content_type is not None:
            out_headers[codec.CONTENT_TYPE] = content_type
        return out_headers

    def publish(
        self,
        topic: str,
        body: object,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        deliver_at: datetime | None = None,
        id: str | None = None,
        ttl: float | None = None,
    ) -> str:
        """Publish one message and wait for the broker's confirmation; return its id.

        ``body``: bytes pass through, str is UTF-8, dict/list/numbers are JSON. ``key`` keeps
        same-key messages in order (groups declared ``ordered=True``); ``priority`` 0-9,
        higher first; ``delay`` seconds or ``deliver_at`` (aware datetime) hold it back.
        ``id`` defaults to a random UUID; set it to let consumers drop duplicates. ``ttl``
        seconds after publishing, a group that has not received it yet never will: it goes
        to the group's dead letters with reason ``expired`` (or is dropped, for groups
        declared ``expired="drop"``).
        """
        self._check_open()
        return self._publish_via_chain(topic, body, headers, key, priority, delay, deliver_at,
                                       id, ttl, None)

    def _publish_one(self, topic: str, body: object, headers: Mapping[str, str] | None,
                     key: str | None, priority: int | None, delay: float | None,
                     deliver_at: datetime | None, id: str | None, ttl: float | None = None,
                     wire_headers: Mapping[str, str] | None = None) -> list[str]:
        env = self._envelope(topic, body, headers, key, priority, delay, deliver_at, id,
                             self._now(), ttl, wire_headers)
        with self._guard:
            self._driver.publish((env,))
        return [env.id]

    def publish_batch(
        self, messages: Iterable[OutgoingMessage | Mapping[str, Any] | tuple[str, Any]]
    ) -> list[str]:
        """Publish many messages with few broker round trips; return their ids in order.

        Every message is validated first: one bad message rejects the whole batch with its
        index (``error.index``) and nothing is sent. If the broker then fails part way,
        ``PublishError`` lists what was confirmed and what was not. A batch for one topic
        without delays or priorities takes the column path (``publish_columns``).
        """
        self._check_open()
        items = messages if isinstance(messages, list) else list(messages)
        chain = self._chain
        if chain.publishers:
            pub = _batch_publishing(self.backend, items)
            return chain.publish(pub, lambda: self._publish_batch(items, pub.headers))
        return self._publish_batch(items, None)

    def _publish_batch(self, items: list[Any], extra: Mapping[str, str] | None) -> list[str]:
        """``publish_batch`` without middleware; ``extra``: headers it added."""
        columns = _as_columns(items)
        if columns is not None:
            topic, bodies, ids, keys, rows = columns
            return self._publish_columns(topic, bodies, ids, keys, extra, rows)
        now = self._now()
        envelopes: list[Envelope] = []
        for index, item in enumerate(items):
            try:
                if isinstance(item, OutgoingMessage):
                    m = item
                elif isinstance(item, tuple) and len(item) == 2:
                    m = OutgoingMessage(item[0], item[1])
                elif isinstance(item, Mapping):
                    m = OutgoingMessage(**item)
                else:
                    raise InvalidArgument(
                        "batch items must be OutgoingMessage, a mapping, or (topic, body)"
                    )
                envelopes.append(
                    self._envelope(m.topic, m.body, _with(extra, m.headers), m.key,
                                   m.priority, m.delay, m.deliver_at, m.id, now, m.ttl)
                )
            except ValidationError as exc:
                raise type(exc)(str(exc), index=index) from exc
            except TypeError as exc:  # bad mapping keys
                raise InvalidArgument(str(exc), index=index) from exc
        return self._send_chunks(
            [e.id for e in envelopes],
            lambda a, b: self._driver.publish(envelopes[a:b]))

    def _send_envelopes(self, envelopes: Sequence[Envelope]) -> list[str]:
        """Send envelopes already validated (``_envelope``): the asyncio publishes that
        arrived together share these driver calls."""
        self._check_open()
        return self._send_chunks([e.id for e in envelopes],
                                 lambda a, b: self._driver.publish(envelopes[a:b]))

    def _send_chunks(self, ids: list[str], send: Callable[[int, int], None]) -> list[str]:
        """Send rows ``[a, b)`` in chunks of the driver's ``max_batch``, in order; on a
        failure raise ``PublishError`` with what was confirmed, failed and never sent."""
        if not ids:
            return []
        step = self._caps.max_batch
        total = len(ids)
        confirmed: list[str] = []
        for start in range(0, total, step):
            stop = min(start + step, total)
            try:
                send(start, stop)
            except Exception as exc:
                err = self._translate(exc)
                if start == 0 and not isinstance(err, PublishError):
                    raise err from exc
                outcomes: list[MQError | None] = [None] * start  # earlier chunks: confirmed
                if isinstance(err, PublishError):
                    outcomes += [err.failed.get(i) for i in range(stop - start)]
                else:
                    outcomes += [err] * (stop - start)
                not_sent = NotSent("not sent: an earlier part of the batch failed")
                outcomes += [not_sent] * (total - stop)
                raise PublishError.from_outcomes(ids, outcomes) from exc
            confirmed.extend(ids[start:stop])
        return confirmed

    def publish_columns(
        self,
        topic: str,
        bodies: Sequence[Any],
        *,
        ids: Sequence[str] | None = None,
        keys: Sequence[str | None] | None = None,
        headers: Mapping[str, str] | None = None,
        row_headers: Sequence[Mapping[str, str] | None] | None = None,
    ) -> list[str]:
        """Publish many messages to one topic from columns; return their ids in order.

        The fast form of ``publish_batch`` for data pipelines: each column is checked and
        encoded as a whole and the driver gets the rows in its tightest native loop.
        ``bodies``: all bytes, all str, or values the codec encodes one by one. ``ids``,
        ``keys`` (None per row allowed): one per body. ``headers``: for every row;
        ``row_headers``: one mapping (or None) per row, added to ``headers``. No delay or
        priority here (use ``publish_batch``). Errors as in ``publish_batch``: a bad row
        rejects the whole batch with its ``index`` before anything is sent.
        """
        self._check_open()
        chain = self._chain
        if chain.publishers:
            pub = Publishing(self.backend, topic if isinstance(topic, str) else None,
                             len(bodies) if isinstance(bodies, Sequence) else 0)
            return chain.publish(pub, lambda: self._publish_columns(
                topic, bodies, ids, keys, _with(pub.headers, headers), row_headers))
        return self._publish_columns(topic, bodies, ids, keys, headers, row_headers)

    def _publish_columns(
        self, topic: str, bodies: Sequence[Any], ids: Sequence[str] | None,
        keys: Sequence[str | None] | None, headers: Mapping[str, str] | None,
        row_headers: Sequence[Mapping[str, str] | None] | None,
    ) -> list[str]:
        """``publish_columns`` without middleware."""
        names.check_topic(topic)
        if isinstance(bodies, (str, bytes)) or not isinstance(bodies, Sequence):
            raise InvalidArgument("bodies must be a sequence (a list of bytes or str)")
        n = len(bodies)
        data, content_type, per_row_type = self._encode_column(bodies)
        shared = self._headers(headers, content_type)
        rows: list[Mapping[str, str] | None] | None = None
        if row_headers is not None:
            rows = []
            for i, h in enumerate(self._column(row_headers, n, "row_headers")):
                try:
                    if h:  # checked with the shared ones: counts and sizes are per message
                        self._headers({**(headers or {}), **h}, content_type)
                    rows.append(dict(h) if h else None)
                except ValidationError as exc:
                    raise type(exc)(str(exc), index=i) from exc
        if per_row_type is not None:  # mixed bodies: each row's own content-type
            rows = rows or [None] * n
            for i, ct in enumerate(per_row_type):
                if ct is not None:
                    mine = rows[i] or {}
                    if codec.CONTENT_TYPE in mine or codec.CONTENT_TYPE in shared:
                        raise InvalidArgument("content-type is set by the codec for str and "
                                              "JSON bodies; set it only on bytes bodies",
                                              index=i)
                    rows[i] = {**mine, codec.CONTENT_TYPE: ct}
        key_col: list[str | None] | None = None
        if keys is not None:
            key_col = self._column(keys, n, "keys")
            _check_column(key_col, names.check_key, names.MAX_KEY_LEN, spaces=True,
                          nullable=True)
        if ids is None:
            id_col = _ids_source.take(n)
        else:
            id_col = self._column(ids, n, "ids")
            _check_column(id_col, names.check_id, names.MAX_ID_LEN, spaces=False,
                          nullable=False)
        cols = Columns(topic, data, id_col, key_col, shared, rows, self._now())
        return self._send_chunks(
            id_col, lambda a, b: self._driver.publish_columns(
                cols if (a, b) == (0, n) else cols.rows(a, b)))

    @staticmethod
    def _column(values: object, n: int, what: str) -> list[Any]:
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise InvalidArgument(f"{what} must be a sequence with one entry per body")
        if len(values) != n:
            raise InvalidArgument(f"{what} has {len(values)} entries for {n} bodies")
        return values if isinstance(values, list) else list(values)

    def _encode_column(self, bodies: Sequence[Any]
                       ) -> tuple[list[bytes], str | None, list[str | None] | None]:
        """(encoded bodies, the content-type they share, or each row's when they differ)."""
        kinds = set(map(type, bodies))
        limit = self._caps.max_body_bytes
        per_row: list[str | None] | None = None
        content_type: str | None = None
        if kinds <= {bytes}:
            data = bodies if isinstance(bodies, list) else list(bodies)
        elif kinds == {str}:
            try:
                data = [b.encode() for b in bodies]
            except UnicodeEncodeError:
                data = []
                for i, b in enumerate(bodies):  # find the row
                    try:
                        data.append(codec.encode(b)[0])
                    except ValidationError as exc:
                        raise type(exc)(str(exc), index=i) from exc
            content_type = codec.TEXT
        else:
            data, per_row = [], []
            for i, b in enumerate(bodies):
                try:
                    raw, ct = codec.encode(b)
                except ValidationError as exc:
                    raise type(exc)(str(exc), index=i) from exc
                data.append(raw)
                per_row.append(ct)
        if data and max(map(len, data)) > limit:
            i = next(i for i, b in enumerate(data) if len(b) > limit)
            raise MessageTooLarge(
                f"body is {len(data[i])} bytes; {self._driver.name} allows {limit}", index=i)
        return data, content_type, per_row

    # -- groups -----------------------------------------------------------------------------
    def _spec(
        self,
        group: str,
        pattern: str,
        max_attempts: int,
        lease: float,
        ordered: bool,
        priority: bool,
        options: Mapping[str, Any],
        expired: str = "dead_letter",
    ) -> GroupSpec:
        names.check_group(group)
        if expired not in EXPIRED_CHOICES:
            raise InvalidArgument(f"expired must be one of {EXPIRED_CHOICES}, got {expired!r}")
        names.check_pattern(pattern)
        if "*" in pattern.split(".") or "#" in pattern.split("."):
            self._require(Feature.WILDCARDS)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
            raise InvalidArgument("max_attempts must be an int")
        if not 1 <= max_attempts <= 1000:
            raise InvalidArgument(f"max_attempts must be 1-1000, got {max_attempts}")
        lease = self._check_lease(lease, "lease")
        if ordered:
            self._require(Feature.ORDERING)
        if priority:
            self._require(Feature.PRIORITY)
        checked = check_options(options, self._driver.GROUP_OPTIONS,
                                f"{self._driver.name} group option", also=_GROUP_KEYWORDS)
        return GroupSpec(group, pattern, max_attempts, lease, bool(ordered), bool(priority),
                         checked, expired)

    def declare(
        self,
        group: str,
        pattern: str,
        *,
        max_attempts: int = 5,
        lease: float = 30.0,
        ordered: bool = False,
        priority: bool = False,
        expired: str = "dead_letter",
        **options: Any,
    ) -> GroupSpec:
        """Create a durable group on ``pattern`` (idempotent) without consuming.

        From now on the group keeps every message published to a matching topic, whether or
        not a consumer is attached. ``lease`` is the visibility timeout in seconds;
        ``max_attempts`` deliveries without ack move a message to the dead-letter store.
        ``expired``: what a consumer of this group does with a message whose TTL ended
        before it was delivered: ``"dead_letter"`` (reason ``expired``) or ``"drop"``.
        """
        self._check_open()
        spec = self._spec(group, pattern, max_attempts, lease, ordered, priority, options,
                          expired)
        with self._guard:
            self._driver.declare(spec)
        return spec

    def subscribe(
        self,
        group: str,
        pattern: str,
        *,
        max_attempts: int = 5,
        lease: float = 30.0,
        ordered: bool = False,
        priority: bool = False,
        model: type | None = None,
        expired: str = "dead_letter",
        **options: Any,
    ) -> Subscription:
        """Declare the group (as ``declare``) and attach a consumer to it.

        ``model`` (a pydantic v2 model class or a dataclass) types the payloads:
        ``Message.value`` is an instance built from the JSON body, and ``consume``
        dead-letters a message that does not validate (with the error as reason)."""
        typed = None if model is None else Model(model)
        spec = self.declare(
            group, pattern, max_attempts=max_attempts, lease=lease, ordered=ordered,
            priority=priority, expired=expired, **options,
        )
        with self._guard:
            inner = self._driver.subscribe(spec)
        sub = Subscription(self, spec, inner, typed)
        with self._lock:
            self._subs.add(sub)
        return sub

    def _forget(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def _group_call(self, fn: Callable[..., Any], group: str, *args: Any) -> Any:
        self._check_open()
        names.check_group(group)
        with self._guard:
            return fn(group, *args)

    # -- dead letters ---------------------------------------------------------------------
    def dead_letters(self, group: str, limit: int = 100) -> list[DeadLetter]:
        """List up to ``limit`` dead letters of ``group``, oldest first."""
        self._require(Feature.DEAD_LETTER)
        _check_count(limit, "limit")
        found: list[DeadLetter] = self._group_call(self._driver.dead_letters, group, limit)
        return [d if _CARRIED.isdisjoint(d.headers) else dataclasses.replace(
            d, headers={k: v for k, v in d.headers.items() if k not in _CARRIED})
            for d in found]

    def replay_dead_letters(self, group: str, ids: Collection[str] | None = None) -> int:
        """Move dead letters (all, or those with ``ids``) back into the group as fresh
        deliveries (attempt 1); return how many moved."""
        self._require(Feature.DEAD_LETTER)
        return int(self._group_call(self._driver.replay_dead_letters, group, _ids(ids)))

    def purge_dead_letters(self, group: str, ids: Collection[str] | None = None) -> int:
        """Delete dead letters (all, or those with ``ids``); return how many were deleted."""
        self._require(Feature.DEAD_LETTER)
        return int(self._group_call(self._driver.purge_dead_letters, group, _ids(ids)))

    def ping(self) -> float:
        """One round trip to the broker (for liveness and readiness probes); the seconds it
        took. Raises ``ConnectionFailed`` or ``Timeout`` when the broker does not answer."""
        self._check_open()
        start = time.perf_counter()
        with self._guard:
            self._driver.ping()
        return time.perf_counter() - start

    def stats(self, group: str) -> GroupStats:
        """Counts of ready, leased, delayed and dead messages in ``group``."""
        return self._group_call(self._driver.stats, group)  # type: ignore[no-any-return]

    def groups(self) -> list[str]:
        """The names of every group declared on the broker, sorted (``Unsupported`` where
        the broker cannot list them: ``Capabilities.lists_groups``)."""
        self._check_open()
        if not self._caps.lists_groups:
            raise Unsupported(f"{self.backend} cannot list its groups")
        with self._guard:
            return sorted(self._driver.groups())

    def delete_group(self, group: str) -> None:
        """Delete ``group`` with its queued and dead messages."""
        self._group_call(self._driver.delete_group, group)

    # -- request/reply ----------------------------------------------------------------------
    def request(
        self,
        topic: str,
        body: object,
        *,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        priority: int | None = None,
    ) -> Message:
        """Publish a request and return its reply (a ``Message``, already acked).

        A responder answers with ``msg.reply(body)`` (or a ``consume(…, reply=True)``
        handler's return value). Replies come back on this broker's private reply route,
        made at the first request and deleted by ``close``. ``Timeout`` when no reply came
        within ``timeout`` seconds; the request itself expires soon after (``ttl``), and a
        reply that still comes later is dropped, never handed to another request.
        """
        route, seconds, send = self._request_route(topic, body, timeout, headers, key, priority)
        return route.call(send, seconds)

    def _request_route(self, topic: str, body: object, timeout: float,
                       headers: Mapping[str, str] | None, key: str | None,
                       priority: int | None) -> tuple[ReplyRoute, float, Callable[[str], str]]:
        """Check a request and open the reply route (in that order: bad input leaves
        nothing behind): the route, the timeout in seconds, and the sender that publishes
        the request with a correlation id (sync and asyncio ``request``)."""
        self._check_open()
        seconds = _check_seconds(timeout, "timeout", math.inf, allow_zero=False)
        self._require(Feature.REQUEST_REPLY)
        # The request expires a little after its requester gives up (clocks differ).
        ttl = min(seconds * 1.1 + 1.0, self._caps.max_ttl)
        self._envelope(topic, body, headers, key, priority, None, None, None, self._now(), ttl)
        with self._lock:
            if self._closing:
                raise Closed("the broker is closing")
            if self._route is None:
                self._route = ReplyRoute(self)
            route = self._route

        route.open()

        def send(correlation: str) -> str:
            wire_headers = {wire.REPLY_TO: route.topic, wire.CORRELATION_ID: correlation}
            return self._publish_via_chain(topic, body, headers, key, priority, None, None,
                                           None, ttl, wire_headers)

        return route, seconds, send

    def _reply(self, reply_to: str, correlation: str, body: object,
               headers: Mapping[str, str] | None) -> str:
        """``Message.reply``: publish to the requester's route with the correlation id."""
        self._check_open()
        return self._publish_via_chain(reply_to, body, headers, None, None, None, None, None,
                                       None, {wire.CORRELATION_ID: correlation})

    def _publish_via_chain(self, topic: str, body: object, headers: Mapping[str, str] | None,
                           key: str | None, priority: int | None, delay: float | None,
                           deliver_at: datetime | None, id: str | None, ttl: float | None,
                           wire_headers: Mapping[str, str] | None) -> str:
        """One message through the middleware (when any listens), then ``_publish_one``."""
        chain = self._chain
        if chain.publishers:
            pub = Publishing(self.backend, topic if isinstance(topic, str) else None, 1)
            return chain.publish(pub, lambda: self._publish_one(
                topic, body, _with(pub.headers, headers), key, priority, delay, deliver_at,
                id, ttl, wire_headers))[0]
        return self._publish_one(topic, body, headers, key, priority, delay, deliver_at, id,
                                 ttl, wire_headers)[0]

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Close subscriptions (releasing their unsettled messages) and the connection.

        Every ``publish`` has already been confirmed when it returned, so nothing is lost.
        Idempotent; any later call raises ``Closed``.
        """
        if self._closed:
            return
        with self._lock:
            self._closing = True
            route, self._route = self._route, None
        if route is not None:
            route.close()
        with self._lock:
            subs = list(self._subs)
        first: BaseException | None = None
        for sub in subs:
            try:
                sub.close()
            except Exception as exc:
                first = first or exc
        self._closed = True
        self._chain.unbind(self)
        with self._guard:
            self._driver.close()
        if first is not None:
            raise self._translate(first)  # type: ignore[arg-type]

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Broker({self.url!r}{', closed' if self._closed else ''})"


def _with(extra: Mapping[str, str] | None, headers: Mapping[str, str] | None
          ) -> Mapping[str, str] | None:
    """A message's headers over those a middleware added (a non-mapping is left for the
    checks to reject)."""
    if not extra:
        return headers
    if headers is None:
        return extra
    return {**extra, **headers} if isinstance(headers, Mapping) else headers


def _topic_of(item: object) -> object:
    if isinstance(item, OutgoingMessage):
        return item.topic
    if isinstance(item, tuple) and len(item) == 2:
        return item[0]
    return item.get("topic") if isinstance(item, Mapping) else None


def _batch_publishing(backend: str, items: list[Any]) -> Publishing:
    """What middleware sees of a ``publish_batch`` (its topic when all share one)."""
    topics = [_topic_of(item) for item in items]
    first = topics[0] if topics else None
    same = isinstance(first, str) and all(t == first for t in topics)
    return Publishing(backend, first if same and isinstance(first, str) else None, len(items))


def _ids(ids: Collection[str] | None) -> Collection[str] | None:
    if ids is None:
        return None
    if isinstance(ids, str):
        raise InvalidArgument("ids must be a collection of message ids, not a str")
    return frozenset(names.check_id(i) for i in ids)
