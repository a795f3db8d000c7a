"""The portable layer's facade: ``Broker``, a connection to one backend.

Everything that must behave the same on every backend happens in this layer, once. The
``Broker`` ties it together: publishing (checks, encoding, ids and chunked sends in
``outgoing``; the middleware around them here), groups and their dead letters,
request/reply, and a lifecycle that closes subscriptions before the driver. The consumer
side is ``subscription`` (receive, the ordered-key gate, settles) and ``message``; stray
driver exceptions become ``MQError`` in ``guard``. ``Message``, ``Subscription``,
``Backoff`` and ``ConsumeStats`` are importable from here, as they always were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from . import names, wire
from .capabilities import Capabilities, Feature
from .checks import check_count as _check_count
from .checks import check_seconds as _check_seconds
from .consuming import Backoff, ConsumeStats
from .driver import Driver
from .errors import Closed, InvalidArgument, MQError, Unsupported
from .guard import _Guard, _translate
from .hooks import NO_MIDDLEWARE, Hooks, Publishing
from .message import Message
from .model import DeadLetter, Envelope, GroupSpec, GroupStats, OutgoingMessage
from .options import check_options
from .outgoing import Packer, _as_columns, _batch_publishing, _with
from .requests import ReplyRoute
from .subscription import Subscription
from .typed import Model
from .url import BrokerURL

__all__ = ["Backoff", "Broker", "ConsumeStats", "Message", "Subscription"]

_CARRIED = wire.CARRIED
#: What a group does with a message whose TTL ended before delivery (``declare(expired=)``).
EXPIRED_CHOICES = ("dead_letter", "drop")

#: The keywords ``declare`` / ``subscribe`` take themselves (named in an unknown-option
#: error beside the driver's ``GROUP_OPTIONS``).
_GROUP_KEYWORDS = ("expired", "lease", "max_attempts", "model", "ordered", "priority")


class Broker:
    """A connection to one backend, chosen by URL. Use ``mqabstract.connect()`` to get one."""

    def __init__(self, driver: Driver, url: BrokerURL, middleware: Hooks = NO_MIDDLEWARE
                 ) -> None:
        self._driver = driver
        self._chain = middleware
        self._url = url
        self._caps: Capabilities = driver.capabilities
        self._guard = _Guard(driver.name)
        self._packer = Packer(self._caps, driver.name)
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
        env = self._packer.envelope(topic, body, headers, key, priority, delay, deliver_at,
                                    id, self._now(), ttl, wire_headers)
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
        envelopes = self._packer.envelopes(items, extra, self._now())
        return self._packer.send_chunks(
            [e.id for e in envelopes],
            lambda a, b: self._driver.publish(envelopes[a:b]))

    def _send_envelopes(self, envelopes: Sequence[Envelope]) -> list[str]:
        """Send envelopes already validated (``Packer.envelope``): the asyncio publishes that
        arrived together share these driver calls."""
        self._check_open()
        return self._packer.send_chunks([e.id for e in envelopes],
                                        lambda a, b: self._driver.publish(envelopes[a:b]))

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
        cols = self._packer.columns(topic, bodies, ids, keys, headers, row_headers,
                                    self._now)
        n = len(cols)
        return self._packer.send_chunks(
            cols.ids, lambda a, b: self._driver.publish_columns(
                cols if (a, b) == (0, n) else cols.rows(a, b)))

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
        self._packer.envelope(topic, body, headers, key, priority, None, None, None,
                              self._now(), ttl)
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


def _ids(ids: Collection[str] | None) -> Collection[str] | None:
    if ids is None:
        return None
    if isinstance(ids, str):
        raise InvalidArgument("ids must be a collection of message ids, not a str")
    return frozenset(names.check_id(i) for i in ids)
