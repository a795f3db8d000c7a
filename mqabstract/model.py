"""Plain data passed between the portable layer and drivers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import codec

__all__ = ["DeadLetter", "Delivery", "Envelope", "GroupSpec", "GroupStats", "OutgoingMessage"]


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
    """Message counts of one group; None where the backend cannot tell."""

    group: str
    ready: int | None
    leased: int | None
    delayed: int | None
    dead: int | None


def utc(ts: float) -> datetime:
    """Epoch seconds to an aware UTC datetime."""
    return datetime.fromtimestamp(ts, tz=timezone.utc)
