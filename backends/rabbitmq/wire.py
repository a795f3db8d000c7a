"""RabbitMQ wire format: header names, queue names, delay tiers, limits, the
property copies the driver re-publishes and a delivered message as read off the wire
(``_Raw``, which the driver and its subscriptions both use). No I/O, any thread."""

from __future__ import annotations

import contextlib
import math
import uuid
from typing import Any

import pika

from mqabstract import wire
from mqabstract.emulation import Tiers, fit_name

# Delay tiers in milliseconds: a message waits in the largest tier not longer than what is
# left of its delay (the smallest tier when less is left), then is re-tiered if still early.
TIERS_MS = (
    10, 25, 50, 100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000,
    300_000, 600_000, 1_800_000, 3_600_000, 7_200_000, 21_600_000, 43_200_000, 86_400_000,
    259_200_000, 604_800_000, 2_592_000_000,
)
TIERS = Tiers(TIERS_MS)
# Headers RabbitMQ adds; never shown to users and stripped from our copies.
_BROKER_HEADERS = frozenset({
    "x-death", "x-delivery-count", "x-first-death-exchange", "x-first-death-queue",
    "x-first-death-reason", "x-last-death-exchange", "x-last-death-queue",
    "x-last-death-reason",
})
#: The driver's own header on a copy it puts back into a queue: a token naming that copy,
#: so the consumer that made it can tell the copy from its original should both come back
#: (``consumer._Superseded``). Never shown to users, replaced on each copy.
H_COPY = "x-mq-copy"
#: Headers never shown to users and not carried onto copies: the broker's and ours.
_HIDDEN_HEADERS = _BROKER_HEADERS | {H_COPY}


def _copy_token() -> str:
    """A new ``H_COPY`` value: a copy's, or a replayed dead letter's."""
    return uuid.uuid4().hex
# The wire schema (mqabstract/wire.py, which also encodes and decodes it); H_ATTEMPT counts
# deliveries so far.
H_TOPIC, H_ATTEMPT, H_DUE = wire.TOPIC, wire.ATTEMPT, wire.DELIVER_AT
H_REASON, H_DEAD_AT = wire.REASON, wire.DEAD_AT
H_EXPIRES = wire.EXPIRES_AT
# The longest per-message expiration RabbitMQ accepts (ms); a longer TTL is left to the
# portable layer's check.
MAX_EXPIRATION_MS = 4_294_967_295
CONTENT_TYPE = "content-type"
_MAX_NAME = 255  # AMQP short string


def _queue_name(*parts: str) -> str:
    """Join name parts; a name over AMQP's 255-byte limit keeps a head and a digest."""
    return fit_name(".".join(parts), _MAX_NAME, digest_chars=32, sep="~")


def _own_headers(props: Any) -> dict[str, Any]:
    """The message's headers without those the broker or the driver added."""
    return {k: v for k, v in (props.headers or {}).items() if k not in _HIDDEN_HEADERS}


def _copy_props(props: Any, **headers: str | None) -> pika.BasicProperties:
    """The message's properties for a copy: broker headers stripped, ``headers`` applied
    (None removes one)."""
    new = _own_headers(props)
    for name, value in headers.items():
        name = name.replace("_", "-")
        if value is None:
            new.pop(name, None)
        else:
            new[name] = value
    return _props_with(props, new)


def _props_with(props: Any, headers: dict[str, Any]) -> pika.BasicProperties:
    """A persistent copy of ``props`` with ``headers`` (a message id pinned if it had none)."""
    return pika.BasicProperties(
        content_type=props.content_type,
        content_encoding=props.content_encoding,
        headers=headers,
        delivery_mode=2,
        priority=props.priority,
        correlation_id=props.correlation_id,
        reply_to=props.reply_to,
        message_id=props.message_id or uuid.uuid4().hex,
        timestamp=props.timestamp,
        type=props.type,
        app_id=props.app_id,
    )



def _expiration(headers: Any, now: float) -> str | None:
    """The AMQP ``expiration`` of a copy entering a queue at ``now``: the milliseconds left
    of its TTL (``mq-expires-at``; "0" once past), or None without a TTL or beyond what
    RabbitMQ accepts. Relative, so each copy gets what is left, not its original TTL."""
    value = headers.get(H_EXPIRES) if headers else None
    if value is None:
        return None
    try:
        left = float(wire.text(value)) - now
    except ValueError:
        return None
    if not math.isfinite(left):
        return None
    ms = max(0, math.ceil(left * 1000))
    return str(ms) if ms <= MAX_EXPIRATION_MS else None


def _dead_headers(props: Any) -> dict[str, Any]:
    """A dead letter's headers in the wire schema. Copies the driver dead-lettered carry
    ``mq-reason`` and the rest already; for one RabbitMQ dead-lettered itself (a TTL that
    ended in the group queue) they come from its newest ``x-death`` record: the reason, its
    time, the topic it was routed with, and the deliveries it had."""
    own = _own_headers(props)
    deaths = (props.headers or {}).get("x-death")
    if H_REASON in own or not deaths:
        return own
    death = deaths[0]
    when = death.get("time")
    keys = death.get("routing-keys") or []
    # Deliveries the driver wrote down; a broker redelivery (a consumer that died) is not
    # among them: RabbitMQ 3.10 leaves x-delivery-count off a dead-lettered message.
    so_far = wire.read(own).attempt
    reason = wire.text(death.get("reason", "expired"))
    dead_at = when.timestamp() if hasattr(when, "timestamp") else float(when or 0)
    if reason == "expired" and H_EXPIRES in own:
        # x-death keeps whole seconds; the TTL's end falls within that second.
        with contextlib.suppress(ValueError):
            dead_at = min(max(dead_at, float(wire.text(own[H_EXPIRES]))), dead_at + 1.0)
    own[H_REASON] = reason
    own[H_DEAD_AT] = repr(dead_at)
    own[H_ATTEMPT] = str(so_far)
    if H_TOPIC not in own and keys:
        own[H_TOPIC] = wire.text(keys[0])
    return own


class _Raw:
    """A message as the broker delivered it to our channel, before the user saw it."""

    __slots__ = ("_decoded", "body", "gen", "pinned", "props", "redelivered", "routing_key",
                 "tag")

    def __init__(self, gen: int, tag: int, redelivered: bool, routing_key: str,
                 props: Any, body: bytes) -> None:
        self.gen = gen
        self.tag = tag
        self.redelivered = redelivered
        self.routing_key = routing_key
        self.props = props
        self.body = body
        self.pinned = False  # its message id is ours (it had none): only a copy keeps it
        self._decoded: tuple[dict[str, str], wire.Fields] | None = None

    def decoded(self) -> tuple[dict[str, str], wire.Fields]:
        """(user headers, wire fields) of its AMQP headers, decoded once."""
        d = self._decoded
        if d is None:
            headers, meta = wire.split((self.props.headers or {}).items(), _HIDDEN_HEADERS)
            d = self._decoded = (headers, wire.read(meta))
        return d

    def so_far(self) -> int:
        """Deliveries so far: those written down plus those the broker counted itself."""
        count = (self.props.headers or {}).get("x-delivery-count")
        if count is not None:
            return self.decoded()[1].attempt + int(count)
        return self.decoded()[1].attempt + (1 if self.redelivered else 0)

    def attempt(self) -> int:
        """This delivery's attempt."""
        return self.so_far() + 1

    def due(self) -> float | None:
        return self.decoded()[1].deliver_at
