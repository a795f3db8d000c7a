"""RabbitMQ wire format: header names, queue names, delay tiers, limits and the
property copies the driver re-publishes. Pure functions: no I/O, any thread."""

from __future__ import annotations

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
# The wire schema (mqabstract/wire.py); H_ATTEMPT counts deliveries so far.
H_TOPIC, H_KEY, H_ATTEMPT = wire.TOPIC, wire.KEY, wire.ATTEMPT
H_PUBLISHED, H_DUE = wire.PUBLISHED_AT, wire.DELIVER_AT
H_REASON, H_DEAD_AT = wire.REASON, wire.DEAD_AT
CONTENT_TYPE = "content-type"
_MAX_NAME = 255  # AMQP short string


def _queue_name(*parts: str) -> str:
    """Join name parts; a name over AMQP's 255-byte limit keeps a head and a digest."""
    return fit_name(".".join(parts), _MAX_NAME, digest_chars=32, sep="~")


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _own_headers(props: Any) -> dict[str, Any]:
    """The message's headers without those the broker added."""
    return {k: v for k, v in (props.headers or {}).items() if k not in _BROKER_HEADERS}


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

