"""The way out: what a publish does before, and while, a driver sends it.

Shared by ``Broker``'s publish methods and the asyncio ones: message ids (``_IdSource``);
a ``publish_batch`` list as columns when it allows (``_as_columns``); ``Packer``, which
checks and encodes messages against the backend's capabilities into an ``Envelope`` or
``Columns`` and sends rows in chunks of its ``max_batch``, with a ``PublishError`` that says
what went out; and what middleware sees of a publish (``_batch_publishing``, ``_with``).
Apart from ``broker.py`` because none of it needs a connection: checks and encoding, the
same for every backend.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from . import codec, names, wire
from .capabilities import Capabilities, Feature
from .checks import check_seconds as _check_seconds
from .errors import (
    InvalidArgument,
    MessageTooLarge,
    MQError,
    NotSent,
    PublishError,
    ValidationError,
)
from .guard import _translate
from .hooks import Publishing
from .model import Columns, Envelope, OutgoingMessage


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


class Packer:
    """What a publish is checked and encoded against: one backend's ``Capabilities``
    (``backend`` names it in errors). The ``Broker`` holds one; it holds no connection."""

    __slots__ = ("_backend", "_caps")

    def __init__(self, caps: Capabilities, backend: str) -> None:
        self._caps = caps
        self._backend = backend

    def _require(self, feature: Feature) -> None:
        self._caps.require(feature, self._backend)

    def envelope(
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
        """One message checked against the backend's limits and encoded (``publish``,
        ``request``, the asyncio ``publish``); ``now`` stamps it and dates its delay and TTL."""
        caps = self._caps
        names.check_topic(topic)
        data, content_type = codec.encode(body)
        if len(data) > caps.max_body_bytes:
            raise MessageTooLarge(
                f"body is {len(data)} bytes; {self._backend} allows {caps.max_body_bytes}"
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
                        f"priority {priority} exceeds {self._backend}'s maximum "
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
                        f"deliver_at is {ts - now:g}s away; {self._backend} allows "
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
                    f"{len(headers)} headers; {self._backend} allows {caps.max_headers}"
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
                    f"headers take {size} bytes; {self._backend} allows "
                    f"{caps.max_header_bytes}"
                )
        if content_type is not None:
            out_headers[codec.CONTENT_TYPE] = content_type
        return out_headers

    def envelopes(self, items: list[Any], extra: Mapping[str, str] | None, now: float
                  ) -> list[Envelope]:
        """A ``publish_batch`` list item by item as envelopes (``extra``: headers middleware
        added); a bad item raises with its ``index``."""
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
                    self.envelope(m.topic, m.body, _with(extra, m.headers), m.key,
                                  m.priority, m.delay, m.deliver_at, m.id, now, m.ttl)
                )
            except ValidationError as exc:
                raise type(exc)(str(exc), index=index) from exc
            except TypeError as exc:  # bad mapping keys
                raise InvalidArgument(str(exc), index=index) from exc
        return envelopes

    def columns(
        self, topic: str, bodies: Sequence[Any], ids: Sequence[str] | None,
        keys: Sequence[str | None] | None, headers: Mapping[str, str] | None,
        row_headers: Sequence[Mapping[str, str] | None] | None, clock: Callable[[], float],
    ) -> Columns:
        """``publish_columns``' rows checked and encoded column by column (a bad row
        raises with its ``index``); ``clock`` stamps them once they passed."""
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
        return Columns(topic, data, id_col, key_col, shared, rows, clock())

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
                f"body is {len(data[i])} bytes; {self._backend} allows {limit}", index=i)
        return data, content_type, per_row

    def send_chunks(self, ids: Sequence[str], send: Callable[[int, int], None]) -> list[str]:
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
                err = _translate(exc, self._backend)
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
