"""An outbox row: a message checked and encoded as ``Broker.publish`` does it (the one
``Packer``), kept as columns until a relay publishes it, and what the relay publishes.

Times are epoch seconds of the writer's clock: ``deliver_at`` (a delay, made absolute when
written), ``expires_at`` (a TTL, likewise) and ``published_at`` (the write). A relay gives
the target what is left: a delay that has passed is none, a TTL the rest of it, and a row
whose TTL ended before it was relayed is never published (it is marked ``expired``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .. import wire
from ..capabilities import Capabilities
from ..model import Envelope, OutgoingMessage, utc
from ..outgoing import Packer

__all__ = ["LIMITS", "PARTS", "Row", "check", "check_one", "decode_headers", "encode_headers",
           "key_lock", "outgoing", "part"]

#: What ``outbox.publish`` checks a message against when not told the target's limits
#: (``limits=broker.capabilities``): every portable rule, the largest body any backend
#: takes. A row the target then refuses is marked, not retried forever (``Relay``).
LIMITS = Capabilities.all_native(max_body_bytes=16 * 1024 * 1024, max_batch=5000)

#: Relay partitions of a PostgreSQL outbox: a key's rows are always in one (its CRC-32),
#: and each partition is relayed by one relay at a time. Part of the table's format.
PARTS = 16


@dataclass(frozen=True, slots=True)
class Row:
    """One outbox message, encoded (``headers`` hold the codec's content-type)."""

    id: str
    topic: str
    body: bytes
    headers: Mapping[str, str]
    key: str | None
    priority: int
    deliver_at: float | None
    expires_at: float | None
    published_at: float


def _row(env: Envelope) -> Row:
    headers = dict(env.headers)
    expires = headers.pop(wire.EXPIRES_AT, None)
    return Row(env.id, env.topic, env.body, headers, env.key, env.priority, env.deliver_at,
               None if expires is None else float(expires), env.published_at)


def check(items: Iterable[Any], limits: Capabilities | None, now: float) -> list[Row]:
    """``publish_batch`` items (``OutgoingMessage``, mappings, ``(topic, body)``) checked
    like ``Broker.publish_batch`` checks them: a bad one raises its ``ValidationError``
    with its ``index`` before anything is written."""
    packer = Packer(limits or LIMITS, "outbox")
    return [_row(env) for env in packer.envelopes(list(items), None, now)]


def check_one(msg: OutgoingMessage, limits: Capabilities | None, now: float) -> Row:
    """One message checked as ``Broker.publish`` checks it (errors without an index)."""
    return _row(Packer(limits or LIMITS, "outbox").envelope(
        msg.topic, msg.body, msg.headers, msg.key, msg.priority, msg.delay, msg.deliver_at,
        msg.id, now, msg.ttl))


def part(row: Row) -> int:
    """The row's relay partition: its key's (so a key's rows stay in order), else its id's."""
    return zlib.crc32((row.key if row.key is not None else row.id).encode()) % PARTS


def key_lock(key: str) -> int:
    """A key's writer lock number (a signed 32-bit int, PostgreSQL's advisory lock half)."""
    return zlib.crc32(key.encode()) - 2**31


def encode_headers(headers: Mapping[str, str]) -> str | None:
    return json.dumps(dict(headers), separators=(",", ":"), ensure_ascii=False) \
        if headers else None


def decode_headers(text: str | None) -> dict[str, str]:
    return json.loads(text) if text else {}


def outgoing(row: Row, now: float) -> OutgoingMessage | None:
    """What the relay publishes for ``row`` at ``now``: same id, topic, body, headers, key
    and priority, the delay and TTL that are left; None when its TTL has ended."""
    ttl = None
    if row.expires_at is not None:
        ttl = row.expires_at - now
        if ttl <= 0:
            return None
    due: datetime | None = utc(row.deliver_at) \
        if row.deliver_at is not None and row.deliver_at > now else None
    return OutgoingMessage(row.topic, row.body, headers=dict(row.headers) or None, key=row.key,
                           priority=row.priority or None, deliver_at=due, id=row.id, ttl=ttl)


def claimed(rows: Iterable[tuple[Any, ...]], now: float
         ) -> tuple[list[OutgoingMessage], list[int], dict[int, str]]:
    """A claim's rows (``seq`` then the outbox columns: id, topic, key, priority, due,
    expires, at, headers, body) as what the relay publishes at ``now``, their seqs, and
    the seqs to mark ``expired`` (their TTL ended in the outbox). Both outboxes use it."""
    out: list[OutgoingMessage] = []
    seqs: list[int] = []
    marks: dict[int, str] = {}
    for seq, mid, topic, key, prio, due, exp, at, headers, body in rows:
        msg = outgoing(Row(mid, topic, bytes(body), decode_headers(headers), key, prio, due,
                           exp, at), now)
        if msg is None:
            marks[int(seq)] = "expired"
        else:
            seqs.append(int(seq))
            out.append(msg)
    return out, seqs, marks
