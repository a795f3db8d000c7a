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
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from . import codec, names, wire
from .capabilities import Capabilities, Feature
from .checks import check_count as _check_count
from .checks import check_seconds as _check_seconds
from .consuming import (
    Backoff,
    ConsumeStats,
)
from .driver import Driver
from .errors import (
    Closed,
    InvalidArgument,
    MessageTooLarge,
    MQError,
    NotSent,
    PublishError,
    Unsupported,
    ValidationError,
)
from .guard import _Guard, _translate
from .message import Message
from .middleware import NO_MIDDLEWARE, Chain, Publishing
from .model import (
    Columns,
    DeadLetter,
    Envelope,
    GroupSpec,
    GroupStats,
    OutgoingMessage,
)
from .options import check_options
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
