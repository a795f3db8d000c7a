"""The wire schema: the metadata headers every broker driver writes, named once.

Every backend that carries headers (RabbitMQ, Kafka; SQS packs them into one attribute)
uses these names with these meanings, so a plain client (pika, a Kafka client, boto3) can
read and write mqabstract messages, and one driver's records mean the same in another's
tooling. User headers may not start with ``mq-`` (the portable layer rejects them).

A message published by a plain client carries none of them and is received with defaults:
its native id, attempt from the broker's delivery count where it has one, published_at from
the broker's timestamp.

==================== ==================================================================
header               meaning
==================== ==================================================================
``mq-id``            the message id, stable across redeliveries (publisher may set it)
``mq-attempt``       deliveries so far, as an integer; absent = 0 (the next delivery is
                     attempt ``mq-attempt + 1``, plus any count the broker adds itself)
``mq-published-at``  when the publisher sent it: epoch seconds, float, exact
``mq-deliver-at``    not deliverable before this epoch time (delays, ``nack(delay)``)
``mq-expires-at``    epoch time after which it is not delivered (TTL)
``mq-reason``        why it was dead-lettered
``mq-dead-at``       when it was dead-lettered (epoch seconds)
``mq-key``           the ordering key, where the broker's own key field holds another value
``mq-topic``         the mqabstract topic, where the broker's routing cannot hold it exactly
                     (hashed names, retry and dead-letter copies)
``mq-reply-to``      where a reply to this request goes
``mq-correlation-id`` the request a reply answers
``mq-hops``          hand-offs between idle consumers (Kafka), for back-off
==================== ==================================================================

``PACKED`` gives each name a one-letter key for brokers that limit attribute counts (SQS
packs them into one JSON attribute; ``v`` is that packing's version).

The codec
---------
Every header-carrying driver writes and reads these headers through the functions below,
so the split of ``mq-*`` and user headers, the encoding of values and the attempt rule are
written once:

* values: an int is written ``str(n)``, a float ``repr(x)`` (exact, read back with
  ``float``), text as is; None means "absent" (a copy drops the header). Header values a
  client hands back (``str``, ``bytes`` from Kafka clients and pika, numbers a plain pika
  publisher set) are read as text by :func:`text`. The packed form (:func:`pack`) keeps
  numbers as JSON numbers.
* :func:`fields` / :func:`encode`: an envelope's ``mq-*`` fields / its headers (the
  user's, ``mq-*`` the portable layer set among them, then the wire schema's).
* :func:`retry_fields`: the one attempt rule of copies. ``mq-attempt`` counts deliveries
  so far: a copy made after delivery ``n`` (a nack, an expired lease, a dead letter) writes
  ``n``, so the copy's next delivery is ``n + 1``; a copy of a message nobody was handed
  (a buffer handed back, an early arrival) writes the deliveries it already had.
* :func:`split` / :func:`read`: a received message's header pairs into user headers (with
  :data:`CARRIED`) and ``mq-*`` values, and those values into typed :class:`Fields`,
  tolerant of a plain client's message (absent or malformed fields read as defaults: no
  id, attempt 0, no times; the driver falls back on the broker's own id, count and
  timestamp). :func:`received` is the two in one pass, for a consumer's hot path.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .model import Envelope

__all__ = [
    "ATTEMPT",
    "CARRIED",
    "CORRELATION_ID",
    "DEAD_AT",
    "DELIVER_AT",
    "EXPIRES_AT",
    "HOPS",
    "ID",
    "KEY",
    "NAMES",
    "PACKED",
    "PREFIX",
    "PUBLISHED_AT",
    "REASON",
    "REPLY_PREFIX",
    "REPLY_TO",
    "TOPIC",
    "Fields",
    "encode",
    "fields",
    "pack",
    "read",
    "received",
    "retry_fields",
    "split",
    "text",
    "to_text",
    "unpack",
    "value",
]

PREFIX = "mq-"

ID = "mq-id"
ATTEMPT = "mq-attempt"
PUBLISHED_AT = "mq-published-at"
DELIVER_AT = "mq-deliver-at"
EXPIRES_AT = "mq-expires-at"
REASON = "mq-reason"
DEAD_AT = "mq-dead-at"
KEY = "mq-key"
TOPIC = "mq-topic"
REPLY_TO = "mq-reply-to"
CORRELATION_ID = "mq-correlation-id"
HOPS = "mq-hops"

#: Every reply route's topic starts so (``mq-reply-to`` names one): ``Message.reply``
#: answers nothing else, and a wildcard group skips the replies on these topics.
REPLY_PREFIX = "mq-reply."

NAMES = frozenset({ID, ATTEMPT, PUBLISHED_AT, DELIVER_AT, EXPIRES_AT, REASON, DEAD_AT, KEY,
                   TOPIC, REPLY_TO, CORRELATION_ID, HOPS})

#: Wire headers a driver hands back among a delivery's headers, untouched: the portable
#: layer reads them (``Message.expires_at``, ``reply_to``, ``correlation_id``) and takes
#: them out of the headers users see.
CARRIED = frozenset({EXPIRES_AT, REPLY_TO, CORRELATION_ID})

#: One-letter keys of the packed form (one attribute holding a JSON object).
PACKED = {
    ID: "i",
    ATTEMPT: "a",
    PUBLISHED_AT: "t",
    DELIVER_AT: "d",
    EXPIRES_AT: "z",  # "e" is the packing's body encoding
    REASON: "r",
    DEAD_AT: "x",
    KEY: "k",
    REPLY_TO: "y",
    CORRELATION_ID: "c",
}

_UNPACKED = {letter: name for name, letter in PACKED.items()}
_KEEP: Any = object()  # "the envelope's own deliver_at"


# -- values ----------------------------------------------------------------------------------
def text(v: object) -> str:
    """A header value as a client handed it back, as text: ``bytes`` decoded as UTF-8
    (undecodable bytes replaced), None as ``""``, anything else with ``str``."""
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return "" if v is None else str(v)


def value(v: int | float | str) -> str:
    """The one text encoding of a wire value: ints ``str``, floats ``repr`` (exact)."""
    return repr(v) if v.__class__ is float else str(v)


def to_text(typed: Mapping[str, int | float | str | None]) -> dict[str, str | None]:
    """Typed wire fields as header text (None kept: "remove this header" in a copy)."""
    return {k: None if v is None else value(v) for k, v in typed.items()}


def pack(typed: Mapping[str, Any]) -> dict[str, Any]:
    """Wire fields under their one-letter ``PACKED`` keys, values as they are (JSON)."""
    return {PACKED[k]: v for k, v in typed.items()}


def unpack(packed: Mapping[str, Any]) -> dict[str, Any]:
    """The wire fields of a packed object by name (the packing's own keys left out)."""
    return {_UNPACKED[k]: v for k, v in packed.items() if k in _UNPACKED}


# -- encoding --------------------------------------------------------------------------------
def fields(env: Envelope, *, id: bool = True, key: bool = False, topic: str | None = None,
           deliver_at: float | None = _KEEP) -> dict[str, int | float | str]:
    """An envelope's wire fields, typed: ``mq-id`` (unless ``id`` is False: the broker
    carries it natively), ``mq-published-at``, ``mq-deliver-at`` when delayed (the
    envelope's own, or ``deliver_at`` when given: None for none), ``mq-key`` when ``key``
    (the broker's key field cannot hold it) and ``mq-topic`` when ``topic`` is given."""
    out: dict[str, int | float | str] = {ID: env.id} if id else {}
    out[PUBLISHED_AT] = env.published_at
    due = env.deliver_at if deliver_at is _KEEP else deliver_at
    if due is not None:
        out[DELIVER_AT] = due
    if key and env.key is not None:
        out[KEY] = env.key
    if topic is not None:
        out[TOPIC] = topic
    return out


def encode(env: Envelope, *, id: bool = True, key: bool = False, topic: str | None = None,
           deliver_at: float | None = _KEEP) -> dict[str, str]:
    """An envelope's headers: the user's (with the ``mq-*`` the portable layer set, such as
    ``mq-expires-at``), then its wire fields (:func:`fields`) as text."""
    out = dict(env.headers)  # written out (hot path): equal to to_text(fields(...))
    if id:
        out[ID] = env.id
    out[PUBLISHED_AT] = repr(env.published_at)
    due = env.deliver_at if deliver_at is _KEEP else deliver_at
    if due is not None:
        out[DELIVER_AT] = repr(due)
    if key and env.key is not None:
        out[KEY] = env.key
    if topic is not None:
        out[TOPIC] = topic
    return out


def retry_fields(delivered: int, deliver_at: float | None = None,
                 ) -> dict[str, int | float | None]:
    """The fields a retry copy changes: ``mq-attempt`` = ``delivered``, the deliveries the
    message had when copied (after delivery ``n``: ``n``; its next delivery is ``n + 1``),
    and ``mq-deliver-at`` (None: deliverable at once, the header removed)."""
    return {ATTEMPT: delivered, DELIVER_AT: deliver_at}


# -- decoding --------------------------------------------------------------------------------
class Fields(NamedTuple):
    """A received message's wire fields, typed; None (attempt and hops: 0) where absent or
    malformed, the driver then using the broker's own value."""

    id: str | None = None
    attempt: int = 0  #: deliveries so far (``mq-attempt``)
    published_at: float | None = None
    deliver_at: float | None = None
    key: str | None = None
    topic: str | None = None
    hops: int = 0


_PLAIN = Fields()
_new = tuple.__new__  # a Fields without NamedTuple's Python-level __new__ (hot path)


def split(pairs: Iterable[tuple[str, Any]], skip: Container[str] = (),
          ) -> tuple[dict[str, str], dict[str, str]]:
    """A received message's headers as ``(user headers, mq-* values)``, all as text
    (:func:`text`): the user's headers with :data:`CARRIED` ones, and the wire schema's
    for :func:`read`; names in ``skip`` (broker headers) dropped before any decoding."""
    headers: dict[str, str] = {}
    meta: dict[str, str] = {}
    for k, v in pairs:
        if skip and k in skip:
            continue
        cls = v.__class__
        s = v if cls is str else v.decode("utf-8", "replace") if cls is bytes else text(v)
        if k.startswith(PREFIX):
            meta[k] = s
            if k in CARRIED:
                headers[k] = s
        else:
            headers[k] = s
    return headers, meta


def _int(v: Any) -> int:
    try:
        return int(v) if v is not None else 0
    except (TypeError, ValueError, OverflowError):
        return 0


def _float(v: Any) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _str(v: Any) -> str | None:
    return None if v is None else v if v.__class__ is str else text(v)


def received(pairs: Iterable[tuple[str, Any]], skip: Container[str] = (),
             ) -> tuple[dict[str, str], Fields]:
    """``(headers, read(meta))`` for ``headers, meta = split(pairs, skip)``: a consumer
    decodes every record's headers (the hot path), and a record published through
    mqabstract on Kafka carries ``mq-id`` alone (its publish time is the record's
    timestamp), or, as written before, ``mq-published-at`` then ``mq-id`` (as bytes:
    Kafka's clients): read here straight; anything else, a value that does not parse
    too, goes through :func:`split` and :func:`read`."""
    n = len(pairs) if not skip and isinstance(pairs, list) else 0
    if n == 1:
        (k0, mid), = pairs
        if k0 == ID and mid.__class__ is bytes:
            return {}, _new(Fields, (mid.decode("utf-8", "replace") or None, 0, None, None,
                                     None, None, 0))
    elif n == 2:
        (k0, at), (k1, mid) = pairs
        if (k0 == PUBLISHED_AT and k1 == ID and at.__class__ is bytes
                and mid.__class__ is bytes):
            try:
                published = float(at)  # (bytes: ASCII only; else the general path decides)
            except ValueError:
                pass
            else:
                return {}, _new(Fields, (mid.decode("utf-8", "replace") or None, 0,
                                         published, None, None, None, 0))
    headers, meta = split(pairs, skip)
    return headers, read(meta)


def read(meta: Mapping[str, Any]) -> Fields:
    """The typed wire fields of ``mq-*`` values: text from :func:`split`, or the JSON
    values of a packed object (:func:`unpack`)."""
    if not meta:
        return _PLAIN
    get = meta.get
    mid = get(ID)
    n = get(ATTEMPT)
    at = get(PUBLISHED_AT)
    due = get(DELIVER_AT)
    key = get(KEY)
    topic = get(TOPIC)
    hops = get(HOPS)
    try:  # the fields as this codec writes them
        return _new(Fields, (
            (mid if mid.__class__ is str else text(mid)) or None if mid is not None else None,
            int(n) if n is not None else 0,
            float(at) if at is not None else None,
            float(due) if due is not None else None,
            key if key is None or key.__class__ is str else text(key),
            topic if topic is None or topic.__class__ is str else text(topic),
            int(hops) if hops is not None else 0,
        ))
    except (TypeError, ValueError, OverflowError):  # a malformed field reads as absent
        return _new(Fields, (_str(mid) or None, _int(n), _float(at), _float(due), _str(key),
                             _str(topic), _int(hops)))
