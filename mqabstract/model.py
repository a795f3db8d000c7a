"""Plain data passed between the portable layer and drivers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import codec

__all__ = ["Columns", "DeadLetter", "Delivery", "Envelope", "GroupSpec", "GroupStats",
           "OutgoingMessage"]


@dataclass(slots=True)
class OutgoingMessage:
    """One message for ``Broker.publish_batch``; fields as in ``Broker.publish``."""

    topic: str
    body: Any
    headers: Mapping[str, str] | None = None
    key: str | None = None
    priority: int | None = None
    delay: float | None = None
    deliver_at: datetime | None = None
    id: str | None = None
    ttl: float | None = None  #: seconds; see ``Broker.publish``


@dataclass(frozen=True, slots=True)
class Envelope:
    """A validated, encoded message handed to a driver.

    ``headers`` already contains ``content-type`` when the codec set one; ``deliver_at`` is
    an epoch time (None = deliverable now); ``published_at`` is an epoch time.
    """

    id: str
    topic: str
    body: bytes
    headers: Mapping[str, str]
    key: str | None
    priority: int
    deliver_at: float | None
    published_at: float


@dataclass(frozen=True, slots=True)
class Columns:
    """A validated, encoded batch for one topic, column by column (``publish_columns``).

    Row ``i`` is ``bodies[i]`` with id ``ids[i]`` and key ``keys[i]`` (``keys`` None: no
    keys); its headers are ``headers`` (shared by every row, ``content-type`` included
    when the codec set one) updated with ``row_headers[i]`` when that is given. No row is
    delayed or prioritised; ``published_at`` (epoch) is the batch's.
    """

    topic: str
    bodies: Sequence[bytes]
    ids: Sequence[str]
    keys: Sequence[str | None] | None
    headers: Mapping[str, str]
    row_headers: Sequence[Mapping[str, str] | None] | None
    published_at: float

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, start: int, stop: int) -> Columns:
        """Rows ``start`` to ``stop`` (a chunk of at most a driver's batch size)."""
        return Columns(self.topic, self.bodies[start:stop], self.ids[start:stop],
                       None if self.keys is None else self.keys[start:stop], self.headers,
                       None if self.row_headers is None else self.row_headers[start:stop],
                       self.published_at)

    def envelopes(self) -> list[Envelope]:
        """The same rows as envelopes (the generic path of drivers without a column loop)."""
        keys = self.keys or [None] * len(self.ids)
        shared = self.headers
        rows = self.row_headers or [None] * len(self.ids)
        return [
            Envelope(mid, self.topic, body, {**shared, **own} if own else shared, key, 0, None,
                     self.published_at)
            for mid, body, key, own in zip(self.ids, self.bodies, keys, rows, strict=True)
        ]


@dataclass(slots=True)
class Delivery:
    """A message as a driver received it; ``receipt`` is the driver's handle to settle it."""

    id: str
    topic: str
    body: bytes
    headers: Mapping[str, str]
    key: str | None
    priority: int
    attempt: int
    published_at: float
    receipt: Any


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A durable subscription: a named group on a pattern, with its delivery policy.

    ``ordered`` and ``priority`` are hints for backends that must pick a queue type per
    group (RabbitMQ classic vs quorum, SQS FIFO vs standard): declare them when the group
    relies on per-key order or on priority. Backends that always provide both ignore them.
    """

    name: str
    pattern: str
    max_attempts: int = 5
    lease: float = 30.0
    ordered: bool = False
    priority: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    #: a message whose TTL ended before delivery: "dead_letter" (reason expired) or "drop"
    expired: str = "dead_letter"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message in a group's dead-letter store, with why and after how many deliveries."""

    id: str
    topic: str
    body: bytes
    headers: Mapping[str, str]
    key: str | None
    priority: int
    published_at: datetime
    attempts: int
    reason: str
    dead_lettered_at: datetime | None

    @property
    def value(self) -> Any:
        """The body decoded by its content-type (bytes when it has none)."""
        return codec.decode(self.body, self.headers.get(codec.CONTENT_TYPE))


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Message counts of one group; None where the backend cannot tell.

    ``ready``: deliverable now; ``leased``: delivered, not yet settled; ``delayed``: due
    later (a delay or a nack's backoff); ``dead``: in the dead-letter store; ``lag``
    (backends with offsets): messages published to the group's topics past its committed
    position, whatever their state. ``Capabilities.stats`` says which are exact."""

    group: str
    ready: int | None
    leased: int | None
    delayed: int | None
    dead: int | None
    lag: int | None = None


def utc(ts: float) -> datetime:
    """Epoch seconds to an aware UTC datetime."""
    return datetime.fromtimestamp(ts, tz=timezone.utc)
