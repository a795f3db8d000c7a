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
from typing import TYPE_CHECKING

from .errors import MQError, Timeout

if TYPE_CHECKING:
    from .broker import Broker, Message, Subscription

log = logging.getLogger("mqabstract")

#: Lease of a reply while the route hands it over (it is acked at once).
REPLY_LEASE = 30.0
#: Longest a waiting thread sleeps before it checks for its reply or takes the receive turn.
TURN = 0.05


#: Every reply route's topic starts so; ``Message.reply`` answers nothing else.
REPLY_PREFIX = "mq-reply."


class ReplyRoute:
    """One requester's reply group, private topic and waiters."""

    def __init__(self, broker: Broker) -> None:
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

    def _subscription(self) -> Subscription:
        with self._open_lock:
            if self._sub is None:
                lease = max(REPLY_LEASE, self._broker.capabilities.min_lease)
                self._sub = self._broker.subscribe(self.group, self.topic, lease=lease)
            return self._sub

    def call(self, publish: Callable[[str], object], timeout: float) -> Message:
        """Publish the request (``publish(correlation_id)``) and wait for its reply."""
        sub = self._subscription()
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

    def _read(self, sub: Subscription, wait: float) -> None:
        """Receive replies and hand each to its waiter; ack them all (late ones too)."""
        got = sub.receive(100, wait)
        if not got:
            return
        try:
            sub.ack_many(got)
        except MQError as exc:  # a reply comes again; its waiter may have it already
            log.debug("request/reply: acking %d replies: %s", len(got), exc)
        with self._cv:
            for msg in got:
                correlation = msg.correlation_id
                if correlation in self._waiting:
                    self._replies[correlation] = msg
                else:
                    log.debug("request/reply: dropped a late or unknown reply %s", msg.id)
            self._cv.notify_all()

    def close(self) -> None:
        """Delete the route (its group and anything still queued for it)."""
        with self._open_lock:
            sub, self._sub = self._sub, None
        if sub is None:
            return
        try:
            sub.close()
            self._broker.delete_group(self.group)
        except MQError as exc:
            log.warning("request/reply: deleting reply route %s: %s", self.group, exc)
