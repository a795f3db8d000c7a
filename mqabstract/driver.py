"""The small interface a backend implements (Go CDK's ``driver`` package, in Python).

Drivers only move bytes with their native client and declare what they can do. Everything
that must behave the same everywhere — validation, encoding, limits, batching, retry
policy, the consume loop, dead-letter decisions, error redaction — lives in the portable
layer (``mqabstract.broker``) and must not be re-implemented here.

Contract for implementers:

* Raise ``mqabstract.errors`` types, chaining the native exception (``raise ... from e``),
  with messages built from ``url.redacted()`` — never the raw URL.
* ``publish`` returns only when the broker has confirmed every envelope. On partial failure
  raise ``PublishError`` listing the confirmed ids and the failed indexes.
* Receipts are opaque to the portable layer, which stops every settle at or after the
  lease deadline. A driver that knows a lease is gone earlier (the connection or partition
  that carried the message was lost) raises ``LeaseExpired`` from the settle.
* Time is read through ``self.clock`` (the system clock unless the backend takes a
  ``clock`` option): lease tables and delay tiers of the emulation toolkit are given it.
* ``Delivery.attempt`` is 1 on first delivery and grows with each redelivery.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from .capabilities import Capabilities
from .clock import Clock, SystemClock
from .errors import Unsupported
from .model import Columns, DeadLetter, Delivery, Envelope, GroupSpec, GroupStats
from .options import Option
from .url import BrokerURL

__all__ = ["Driver", "DriverSubscription"]


class DriverSubscription(abc.ABC):
    """One consumer attached to one group.

    Threads: ``receive`` and the settles may be called from any thread, concurrently (the
    portable layer serialises nothing per subscription); ``close`` may race them. A
    background thread of the driver's own (I/O, heartbeats, lease timers) must never call
    back into the portable layer.
    """

    @abc.abstractmethod
    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Wait up to ``timeout`` s for at least one message; return at most
        ``max_messages``, early as soon as one arrives (no busy polling). Each ``Delivery``
        carries every ``mq-*`` wire field back (``mqabstract.wire.read``: id, key, topic,
        priority, published_at, attempt, deadline) and the user headers unchanged; its
        lease starts when this call started. A delivery whose attempt exceeds the group's
        ``max_attempts`` is returned anyway: the portable layer dead-letters it."""

    @abc.abstractmethod
    def ack(self, receipts: Sequence[Any]) -> None:
        """Remove the messages for this group, all or none of a chunk per broker call. A
        receipt whose lease the driver knows is gone (its connection, channel or partition
        was lost, another consumer holds it) raises ``LeaseExpired``; never retried here:
        the portable layer decides."""

    @abc.abstractmethod
    def nack(self, receipt: Any, delay: float) -> None:
        """Make the message deliverable again after ``delay`` seconds, to any consumer of
        the group, with ``attempt`` one higher (a copy writes ``wire.retry_fields``, the
        one rule for a copy's attempt). Stale receipt: ``LeaseExpired``, nothing sent."""

    def extend(self, receipt: Any, seconds: float) -> None:
        """Renew the lease: the message stays ours for ``seconds`` from now (stale receipt:
        ``LeaseExpired``)."""
        raise Unsupported("lease extend is not supported by this backend")

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        """Move the message to the group's dead-letter store with ``reason`` and
        ``attempts`` (``emulation.deadletters`` encodes them), at most once per id, and
        remove it from the group (stale receipt: ``LeaseExpired``)."""
        raise Unsupported("dead letters are not supported by this backend")

    @abc.abstractmethod
    def close(self) -> None:
        """Detach (idempotent): unsettled messages become deliverable again, to others,
        within the lease plus the declared ``release_margin`` at the latest; settles of
        them afterwards raise ``LeaseExpired``."""


class Driver(abc.ABC):
    """One connection to one broker."""

    #: Short backend name used in errors and the capability table ("rabbitmq").
    name: ClassVar[str] = "driver"
    #: The clock the portable layer and the driver's emulation read (leases, delays).
    clock: Clock = SystemClock()
    #: Backend-specific keyword options of ``declare`` / ``subscribe`` (none by default):
    #: the portable layer refuses any other keyword before anything is declared, and the
    #: driver finds the checked values in ``GroupSpec.options``.
    GROUP_OPTIONS: ClassVar[Mapping[str, Option]] = {}

    @classmethod
    @abc.abstractmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> Driver:
        """Connect. Raise ``ConnectionFailed`` naming the redacted URL within the timeout."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend can do and its limits."""

    @abc.abstractmethod
    def publish(self, envelopes: Sequence[Envelope]) -> None:
        """Send and wait for the broker's confirmation of every envelope (at most
        ``max_batch``, already validated and encoded: ``wire.encode`` gives the headers).
        Never retried here (a retry could duplicate what the broker did store); on a partial
        failure raise ``PublishError.from_outcomes``, so the caller knows which ids were
        confirmed and which may have landed."""

    def publish_columns(self, columns: Columns) -> None:
        """``publish`` for a column batch (at most ``max_batch`` rows), with the same duties
        (confirmed on return; ``PublishError`` by row index). Override it where the native
        client has a tighter loop than one envelope per row."""
        self.publish(columns.envelopes())

    @abc.abstractmethod
    def declare(self, spec: GroupSpec) -> None:
        """Create the group if missing (idempotent). Messages published before are not its."""

    @abc.abstractmethod
    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        """Attach a consumer to a declared group. ``capabilities.release_margin`` must be
        truthful for it: a consumer that stops (hangs, is frozen or killed) without
        settling loses its messages to the group's other consumers no later than its
        lease's end plus that margin (the conformance suite's abandoned-consumer scenario
        and the reliability freeze scenarios check it)."""

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        raise Unsupported("dead letters are not supported by this backend")

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        """Put dead letters (all, or these ids) back into their group only, attempt 1, same
        id, body, headers and key, without their delay or TTL (a replayed expired message
        would expire again); return how many."""
        raise Unsupported("dead letters are not supported by this backend")

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        raise Unsupported("dead letters are not supported by this backend")

    def stats(self, group: str) -> GroupStats:
        return GroupStats(group, None, None, None, None)

    def groups(self) -> list[str]:
        """The names of the groups declared on the broker (by any process)."""
        raise Unsupported("listing groups is not supported by this backend")

    @abc.abstractmethod
    def ping(self) -> None:
        """One round trip to the broker (the cheapest request it answers); raises when it
        does not answer. For a health probe: nothing is created or changed."""

    def delete_group(self, group: str) -> None:
        """Remove a group, its queued messages and its dead letters."""
        raise Unsupported("deleting groups is not supported by this backend")

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections (idempotent). Publishes have already been confirmed."""
