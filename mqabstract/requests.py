"""Request/reply over any backend: a requester's private reply route and the waiting.

``Broker.request`` publishes a request carrying ``mq-reply-to`` (its route's topic) and a
fresh ``mq-correlation-id``, then waits for the reply with that id. The route is one group
on a topic of its own, declared at the first request (before any request goes out, so no
reply can miss it) and deleted when the broker closes. Threads that wait at once share it:
whichever holds the receive lock reads the replies and hands each to its waiter. A reply
nobody waits for (it came after its request timed out) is acked and dropped: correlation
ids are never reused, so it cannot answer a later request.

The request itself expires shortly after its timeout (``ttl = 1.1 * timeout + 1 s``, room for
clocks that differ): a responder that gets to it after its requester gave up never sees it
(dead-lettered with reason ``expired`` instead).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .errors import Closed, MQError, Timeout
from .wire import REPLY_PREFIX

if TYPE_CHECKING:
    from .capabilities import Capabilities
    from .message import Message
    from .subscription import Subscription

log = logging.getLogger("mqabstract")

#: Lease of a reply while the route hands it over (it is acked at once).
REPLY_LEASE = 30.0
#: Longest a waiting thread sleeps before it checks for its reply or takes the receive turn.
TURN = 0.05


class Requester(Protocol):
    """The broker a reply route belongs to, as the route uses it (``Broker`` has it): it
    subscribes the route's group and deletes it at the end."""

    @property
    def capabilities(self) -> Capabilities: ...

    def subscribe(self, group: str, pattern: str, *, lease: float = ...) -> Subscription: ...

    def delete_group(self, group: str) -> None: ...


class ReplyRoute:
    """One requester's reply group, private topic and waiters."""

    def __init__(self, broker: Requester) -> None:
        token = secrets.token_hex(8)
        self.topic = f"{REPLY_PREFIX}{token}"
        self.group = f"mq-reply-{token}"
        self._broker = broker
        self._sub: Subscription | None = None
        self._open_lock = threading.Lock()
        self._turn = threading.Lock()  # held by the thread reading replies
        self._cv = threading.Condition()
        self._waiting: set[str] = set()
        self._replies: dict[str, Message] = {}
        self._callbacks: dict[str, Callable[[Message | MQError], object]] = {}
        self._reading = False  # a reader thread serves the callbacks
        self._closed = False

    def open(self) -> Subscription:
        """The route's subscription, made (group declared) at the first call."""
        with self._open_lock:
            if self._closed:
                raise Closed("the broker is closing: its reply route is gone")
            if self._sub is None:
                lease = max(REPLY_LEASE, self._broker.capabilities.min_lease)
                self._sub = self._broker.subscribe(self.group, self.topic, lease=lease)
            return self._sub

    def call(self, publish: Callable[[str], object], timeout: float) -> Message:
        """Publish the request (``publish(correlation_id)``) and wait for its reply."""
        sub = self.open()
        correlation = secrets.token_hex(16)
        with self._cv:
            self._waiting.add(correlation)
        try:
            publish(correlation)
            deadline = time.monotonic() + timeout
            while True:
                with self._cv:
                    reply = self._replies.pop(correlation, None)
                if reply is not None:
                    return reply
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"no reply within {timeout:g}s (request {correlation})")
                if self._turn.acquire(timeout=min(left, TURN)):
                    try:
                        self._read(sub, min(left, 1.0))
                    finally:
                        self._turn.release()
                else:
                    with self._cv:
                        if correlation not in self._replies:
                            self._cv.wait(min(left, TURN))
        finally:
            with self._cv:
                self._waiting.discard(correlation)
                self._replies.pop(correlation, None)

    def expect(self, callback: Callable[[Message | MQError], object],
               spawn: Callable[[Callable[[], None]], object]) -> str:
        """A new correlation id whose reply is passed to ``callback`` (on a reader thread)
        instead of to a blocked caller: asyncio requests wait on a future, not a thread.
        If the route closes first, ``callback`` gets ``Closed`` instead.
        One reader, started with ``spawn`` when none runs, serves every such waiter and
        ends when none is left. ``forget`` the id when done (reply, timeout or cancel)."""
        self.open()
        correlation = secrets.token_hex(16)
        with self._cv:
            self._callbacks[correlation] = callback
            start, self._reading = not self._reading, True
        if start:
            try:
                spawn(self._serve_callbacks)
            except BaseException:
                with self._cv:
                    self._reading = False
                    self._callbacks.pop(correlation, None)
                raise
        return correlation

    def forget(self, correlation: str) -> None:
        """Stop waiting for ``correlation``'s reply (a later one is dropped)."""
        with self._cv:
            self._callbacks.pop(correlation, None)

    def _serve_callbacks(self) -> None:
        """The reader for ``expect``: takes the receive turn while callbacks wait (sync
        waiters meanwhile get their replies from it through the condition)."""
        try:
            while True:
                with self._cv:
                    sub = self._sub
                    if not self._callbacks or sub is None:
                        self._reading = False
                        return
                if self._turn.acquire(timeout=TURN):
                    try:
                        self._read(sub, 0.2)
                    except MQError as exc:  # the waiters time out if it lasts
                        log.debug("request/reply: reading replies: %s", exc)
                        time.sleep(TURN)
                    finally:
                        self._turn.release()
        except BaseException:
            # Not an MQError (a middleware's bug): said here, as nobody reads this thread's
            # result; the next expect starts a new reader, its waiters time out meanwhile.
            log.exception("request/reply: the reply reader stopped")
            with self._cv:
                self._reading = False
            raise

    def _read(self, sub: Subscription, wait: float) -> None:
        """Receive replies and hand each to its waiter; ack them all (late ones too)."""
        got = sub.receive(100, wait)
        if not got:
            return
        try:
            sub.ack_many(got)
        except MQError as exc:  # a reply comes again; its waiter may have it already
            log.debug("request/reply: acking %d replies: %s", len(got), exc)
        called: list[tuple[Callable[[Message | MQError], object], Message]] = []
        with self._cv:
            for msg in got:
                correlation = msg.correlation_id
                callback = self._callbacks.pop(correlation or "", None)
                if callback is not None:
                    called.append((callback, msg))
                elif correlation in self._waiting:
                    self._replies[correlation] = msg
                else:
                    log.debug("request/reply: dropped a late or unknown reply %s", msg.id)
            self._cv.notify_all()
        for callback, msg in called:
            try:
                callback(msg)
            except Exception:  # a waiter's own failure must not stop the others
                log.exception("request/reply: handing over reply %s", msg.id)

    def close(self) -> None:
        """Delete the route (its group and anything still queued for it)."""
        with self._open_lock:
            sub, self._sub = self._sub, None
            self._closed = True
        with self._cv:
            waiting, self._callbacks = self._callbacks, {}
        for callback in waiting.values():  # no reply can come now: tell them at once
            try:
                callback(Closed("the broker closed while waiting for the reply"))
            except Exception:
                log.exception("request/reply: telling a waiter of the close")
        if sub is None:
            return
        try:
            sub.close()
            self._broker.delete_group(self.group)
        except MQError as exc:
            log.warning("request/reply: deleting reply route %s: %s", self.group, exc)
