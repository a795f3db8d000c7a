"""A RabbitMQ group's consumer side as its callers see it: receive, the settles of
receipts, close. What runs on the I/O thread is the consumer link (``consumer``); what
both share is the subscription's holdings (``holdings``)."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mqabstract.clock import Clock
from mqabstract.driver import DriverSubscription
from mqabstract.emulation import dead_headers
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    LeaseExpired,
    NotFound,
)
from mqabstract.model import Delivery, GroupSpec

from .consumer import _Consumer
from .holdings import _Holdings
from .io import _Item, _Link
from .wire import H_DUE, H_TOPIC, _copy_props, _Raw


class _Driver(Protocol):
    """What a subscription uses of its ``RabbitMQDriver``. A protocol, so this module need
    not import the driver's, which imports it to make subscriptions."""

    _link: _Link
    _where: str
    _prefetch: int
    _publish_timeout: float
    clock: Clock

    def _check(self) -> None: ...

    def _group_queue(self, group: str) -> str: ...

    def _dead_queue(self, group: str) -> str: ...

    def _topic_of(self, raw: _Raw) -> str: ...

    def _delivery(self, raw: _Raw, attempt: int, receipt: int) -> Delivery: ...

    def _retry_item(self, raw: _Raw, queue: str, delivered: int,
                    due: float | None) -> _Item: ...


class RabbitMQSubscription(DriverSubscription):
    """One consumer on a group queue: a connection and channel of its own (closing it
    hands back exactly this subscription's messages), a local buffer ordered by priority,
    driver-kept leases (the toolkit's ``LeaseTable``; a receipt is its token) that the lease
    watchdog backs up when this process freezes. Started lazily on the first ``receive``
    and stopped (its unread buffer handed back) when nobody has called ``receive`` for a
    while, so an idle consumer never sits on messages that another one could take.

    Three parts: this object (the application threads' side), its consumer link ``_io``
    (``consumer._Consumer``: the connection, channels and transactions, on the I/O thread)
    and the holdings ``_held`` they share (``holdings._Holdings``: buffer, leases, acks to
    send, copies in flight, watchdog reports).

    Concurrency: ``receive``, ``ack``, ``nack``, ``extend``, ``dead_letter`` and ``close``
    run on application threads and share state with the I/O thread under ``_held.lock``;
    ``_io``'s methods run on the ``_Link`` I/O thread only (its ``close`` excepted), and
    application threads reach the pika objects through ``_link.call``. Watchdog reports go
    out under ``_held.lock``. Never retried: a settle of a stale receipt (expired, or its
    channel gone) raises ``LeaseExpired`` (the broker delivers the message again), and a
    nack or dead-letter whose transaction was not committed raises instead of being sent
    again (the broker delivers the message again).

    A nack without delay and an expired lease go back as a requeue the broker counts
    (``_Consumer.requeue``). Other messages go back by copy (a delayed nack, a dead letter,
    the unread buffer, a classic redelivery with its attempt written down): the copy is
    confirmed on the copy channel, then its original acked in the consumer channel's next
    transaction (AMQP transaction mode; one transaction for both lost messages on quorum
    queues). A cut
    between the two leaves both; the consumer drops the one that comes back superfluous
    (``consumer._Superseded``).
    """

    def __init__(self, driver: _Driver, spec: GroupSpec) -> None:
        self._driver = driver
        self._link = driver._link
        self.spec = spec
        self.queue = driver._group_queue(spec.name)
        self._held = _Holdings(spec, driver.clock)
        self._io = _Consumer(self._link, self._held, spec, self.queue, driver._prefetch,
                             driver._publish_timeout, driver._retry_item)

    def _check(self) -> None:
        held = self._held
        if held.closed:
            raise Closed(f"subscription to group {self.spec.name!r} is closed")
        if held.error is not None:
            raise held.error
        self._driver._check()

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        self._check()
        held = self._held
        # The lease starts with this call (the portable layer's deadline is no later).
        started = time.monotonic()
        # Not idle from here on: the I/O thread's tick may run before this thread counts
        # itself in ``receiving`` below, and must not pause the consumer this call is
        # about to use (or restart) right away.
        held.last_receive = started
        if not held.want or self._io.ch is None:
            held.want = True
            self._link.call(self._io.start)
        deadline = started + timeout
        out: list[Delivery] = []
        while True:
            again: list[tuple[_Raw, float | None]] = []
            with held.cond:
                held.receiving += 1
                try:
                    held.sync_locked()
                    while not held.buf and held.error is None and not held.closed:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        held.cond.wait(left)
                    if held.error is not None:
                        raise held.error
                    if held.buf:
                        held.sync_locked()
                        # Hand nothing out while a copy is in flight (the watchdog is
                        # held off then): a holder frozen right after this receive must
                        # be cut at its lease deadline. One round trip, rarely.
                        settled = time.monotonic() + 1.0
                        while held.inflight > 0 and not held.closed:
                            left = settled - time.monotonic()
                            if left <= 0:
                                break
                            held.cond.wait(left)
                    now = time.time()
                    later: list[tuple[int, int, _Raw]] = []
                    while held.buf and len(out) < max_messages:
                        entry = heapq.heappop(held.buf)
                        raw = entry[2]
                        if raw.gen != held.ch_gen or raw.gen <= held.cut_gen:
                            continue  # from a channel that is gone: it comes back anyway
                        if held.copying and raw.props.message_id in held.copying:
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
                        if held.returning:
                            held.returning.pop(raw.props.message_id, None)
                        token = held.leases.grant((raw, attempt), self.spec.lease,
                                                  start=started)
                        out.append(self._driver._delivery(raw, attempt, token))
                    for entry in later:
                        heapq.heappush(held.buf, entry)
                    for raw, _ in again:
                        mid = raw.props.message_id
                        held.copying[mid] = held.copying.get(mid, 0) + 1
                    held.inflight += len(again)
                    if out or again:
                        held.report_locked(time.monotonic())
                finally:
                    held.receiving -= 1
                    held.last_receive = time.monotonic()
            if again:
                self._recopy(again)
            if out or held.closed or deadline - time.monotonic() <= 0:
                return out
            if later:  # only copies waiting for their original's ack: not a busy loop
                with held.cond:
                    held.cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))

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
            self._link.call(lambda: self._io.copy_then_ack(
                copies, lambda _ok: self._held.release_done(count, ids)))

    def _stale(self, receipt: Any, *more: Any) -> LeaseExpired:
        why = self._held.lost_why or "its channel closed"
        return LeaseExpired(f"rabbitmq: receipt {receipt!r} of group {self.spec.name!r} is "
                            f"stale ({why}): the broker delivers the message again",
                            receipts=(receipt, *more))

    def _take(self, receipt: Any) -> tuple[_Raw, int]:
        """Settle a receipt: its (message, attempt). ``LeaseExpired`` when it is stale: the
        portable layer stops settles at its deadline, so here that means the channel that
        carried the message is gone (or the driver's own deadline, just after, passed)."""
        if not isinstance(receipt, int):
            raise InvalidArgument("not a receipt of this backend")
        held = self._held
        with held.lock:
            held.sync_locked()
            taken = held.leases.take(receipt)
            if taken is None:
                raise self._stale(receipt)
            held.inflight += 1
            held.report_locked(time.monotonic())
            return taken

    def ack(self, receipts: Sequence[Any]) -> None:
        self._check()
        held = self._held
        stale: list[Any] = []
        with held.lock:
            held.sync_locked()
            first = not held.acks
            for receipt in receipts:
                taken = held.leases.take(receipt) if isinstance(receipt, int) else None
                if taken is None:
                    stale.append(receipt)
                else:
                    held.acks.append((taken[0].gen, taken[0].tag))
            schedule = first and bool(held.acks)
            held.report_locked(time.monotonic())
        if schedule:
            self._link.call(self._io.flush_acks)
        if stale:
            raise self._stale(*stale)

    def _settle_on_io(self, start: Callable[[Callable[[bool | None], None]], None],
                      ) -> bool | None:
        """Run ``start(finish)`` on the I/O thread and wait (at most the publish timeout)
        for its outcome: True once committed, False if not (or not in time), None when a
        copy came back unroutable. Ends the in-flight count ``_take`` started."""
        done = threading.Event()
        committed: list[bool | None] = []

        def finish(ok: bool | None) -> None:
            committed.append(ok)
            self._held.release_done(1)
            done.set()

        self._link.call(lambda: start(finish))
        return committed[0] if done.wait(self._driver._publish_timeout) else False

    def _settle_by_copy(self, raw: _Raw, item: _Item, returned_ok: bool) -> bool | None:
        """Copy ``item`` and ack ``raw`` (``_Consumer.copy_then_ack``): True once done
        within the publish timeout, None if the copy came back unroutable (``raw``
        requeued, unless ``returned_ok``)."""
        return self._settle_on_io(
            lambda finish: self._io.copy_then_ack([(raw, item)], finish, returned_ok))

    def nack(self, receipt: Any, delay: float) -> None:
        self._check()
        taken = self._take(receipt)
        if self.spec.ordered:
            with self._held.lock:
                self._held.expect_locked([taken[0].props.message_id], delay)
        if delay <= 0 and not taken[0].pinned:
            # the broker counts it: one step (``_Consumer.requeue``); a message without an
            # id goes by copy, which pins one
            ok = bool(self._settle_on_io(lambda finish: self._io.requeue([taken[0]], finish)))
        else:
            try:
                item = self._driver._retry_item(taken[0], self.queue, taken[1],
                                                time.time() + delay)
            except BaseException:
                self._held.release_done(1)
                raise
            ok = bool(self._settle_by_copy(taken[0], item, returned_ok=True))
        if not ok:
            raise ConnectionFailed(f"rabbitmq at {self._driver._where}: nack not committed "
                                   f"({self._held.lost_why or 'connection lost'}); the "
                                   "message comes again")

    def extend(self, receipt: Any, seconds: float) -> None:
        self._check()
        if not isinstance(receipt, int):
            raise InvalidArgument("not a receipt of this backend")
        held = self._held
        with held.lock:
            held.sync_locked()
            if not held.leases.extend(receipt, seconds):
                raise self._stale(receipt)
            held.report_locked(time.monotonic())

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
            self._held.release_done(1)
            raise
        done = self._settle_by_copy(raw, item, returned_ok=False)
        if done is None:
            raise NotFound(f"dead-letter queue of group {self.spec.name!r} is missing")
        if not done:
            raise ConnectionFailed(f"rabbitmq at {self._driver._where}: dead letter not "
                                   f"committed ({self._held.lost_why or 'connection lost'}); "
                                   "the message comes again")

    def close(self) -> None:
        self._io.close()
