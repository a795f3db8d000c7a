"""``Message``: one received message, its lease and its settles.

What a consumer holds: the delivery's fields, its decoded ``value``, request/reply
properties, and ``ack`` / ``nack`` / ``dead_letter`` / ``extend`` under the one lease rule.
The bookkeeping behind a settle (the driver call, the ordered-key gate, middleware
notices) is its ``Subscription``'s; a message only decides whether it may still settle.
Separate from ``subscription.py``, and below it: it is what the application holds, and it
names its subscription only by what it uses of it (``Source``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from types import MappingProxyType
from typing import Any, Protocol

from . import codec, wire
from .capabilities import Feature
from .errors import AlreadySettled, InvalidArgument, LeaseExpired
from .host import Host
from .model import Delivery, GroupSpec, utc
from .typed import Model

_EMPTY: Mapping[str, str] = MappingProxyType({})
_CARRIED = wire.CARRIED
_UNDECODED = object()


class Source(Protocol):
    """The subscription a message came from, as the message uses it: the lease rule's
    bookkeeping and the settles run there (``Subscription`` has it)."""

    @property
    def model(self) -> Model | None: ...

    @property
    def spec(self) -> GroupSpec: ...

    @property
    def _broker(self) -> Host: ...

    @property
    def _lock(self) -> threading.Lock: ...

    @property
    def _unsettled(self) -> set[Message]: ...

    @property
    def _extending(self) -> dict[Message, threading.Event]: ...

    def _await_extend(self, msg: Message) -> None: ...

    def _check_open(self) -> None: ...

    def _gone(self, messages: Sequence[Message]) -> None: ...

    def _forget(self, msg: Message) -> None: ...

    def _check_nack(self, delay: object) -> None: ...

    def _settle_nack(self, msg: Message, delay: float) -> None: ...

    def _settle_dead(self, msg: Message, reason: str, attempts: int) -> None: ...

    def _check_extend(self, seconds: object) -> float: ...

    def _extend(self, msg: Message, seconds: object) -> None: ...

    def _ack(self, msg: Message) -> None: ...

    def ack_many(self, messages: Iterable[Message]) -> None: ...


#: Ids a ``LeaseExpired`` about many messages names in its text (all are in ``ids``).
_NAMED = 10


def _ran_out(late: Sequence[Message]) -> LeaseExpired:
    """The error for settles refused after the lease: its text names the messages (the
    first ``_NAMED``), ``ids`` holds them all."""
    first = late[0]
    if len(late) == 1:
        what = f"message {first.id} (attempt {first.attempt})"
    else:
        more = f" and {len(late) - _NAMED} more" if len(late) > _NAMED else ""
        what = f"{len(late)} messages ({', '.join(m.id for m in late[:_NAMED])}{more})"
    return LeaseExpired(f"{what}: the lease ran out before this settle; delivered again with "
                        "the next attempt", ids=tuple(m.id for m in late))


class Message:
    """A received message, leased to this consumer until settled or the lease expires.

    ``id`` is stable across redeliveries; ``attempt`` is 1 on first delivery. Settle it with
    exactly one of ``ack``, ``nack`` or ``dead_letter``; repeating the same call is a no-op.
    The lease deadline is the start of the driver call inside ``receive`` that returned it
    plus the group's lease (renewed by ``extend``): at or after it, every settle and ``extend``
    raises ``LeaseExpired`` without reaching the broker (the contract's one lease rule).
    """

    __slots__ = (
        "_deadline",
        "_published_ts",
        "_receipt",
        "_state",
        "_sub",
        "_value",
        "_wire",
        "attempt",
        "body",
        "headers",
        "id",
        "key",
        "priority",
        "topic",
    )

    def __init__(self, delivery: Delivery, sub: Source, deadline: float) -> None:
        self.id: str = delivery.id
        self.topic: str = delivery.topic
        self.body: bytes = delivery.body
        headers = delivery.headers
        self._wire: dict[str, str] | None = None
        if headers and not _CARRIED.isdisjoint(headers):  # TTL, request/reply
            self._wire = {k: headers[k] for k in _CARRIED if k in headers}
            headers = {k: v for k, v in headers.items() if k not in _CARRIED}
        # Read-only view, no copy: drivers hand over a mapping nobody else mutates.
        self.headers: Mapping[str, str] = MappingProxyType(headers) if headers else _EMPTY
        self.key: str | None = delivery.key
        self.priority: int = delivery.priority
        self.attempt: int = delivery.attempt
        self._published_ts = delivery.published_at
        self._receipt = delivery.receipt
        self._sub = sub
        self._state: str | None = None
        self._deadline = deadline  # on the broker's monotonic clock
        self._value: Any = _UNDECODED

    @property
    def value(self) -> Any:
        """The body decoded by its content-type: JSON → objects, text → str, else bytes;
        an instance of the subscription's ``model`` when it has one (``InvalidPayload``
        when the body does not validate). Decoded once."""
        if self._value is _UNDECODED:
            value = codec.decode(self.body, self.headers.get(codec.CONTENT_TYPE))
            model = self._sub.model
            self._value = value if model is None else model.load(value)
        return self._value

    @property
    def group(self) -> str:
        """The group it was delivered to."""
        return self._sub.spec.name

    @property
    def expires_at(self) -> datetime | None:
        """When its TTL ends (``publish(ttl=…)``); None without one."""
        text = self._wire and self._wire.get(wire.EXPIRES_AT)
        try:
            at = float(text) if text else math.nan
            return utc(at) if math.isfinite(at) else None
        except (ValueError, OverflowError):  # a plain client's header: no TTL
            return None

    @property
    def reply_to(self) -> str | None:
        """The topic a reply goes to when this message is a request (``Broker.request``)."""
        return self._wire.get(wire.REPLY_TO) if self._wire else None

    @property
    def correlation_id(self) -> str | None:
        """The request this message answers, or (a request) the id its reply carries."""
        return self._wire.get(wire.CORRELATION_ID) if self._wire else None

    def reply(self, body: object, *, headers: Mapping[str, str] | None = None) -> str:
        """Answer this request: publish ``body`` to its requester's reply route, carrying
        its correlation id. ``InvalidArgument`` (nothing sent) when it asked for no reply.
        Settle the request separately (``ack``), after the reply went out."""
        if not self.reply_to or not self.correlation_id:
            raise InvalidArgument(f"message {self.id!r} asked for no reply (no reply route)")
        if not self.reply_to.startswith(wire.REPLY_PREFIX):
            raise InvalidArgument(f"message {self.id!r} names {self.reply_to!r} as its reply "
                                  "route, which is not a reply route")
        return self._sub._broker._reply(self.reply_to, self.correlation_id, body, headers)

    @property
    def published_at(self) -> datetime:
        """When the publisher sent it (UTC)."""
        return utc(self._published_ts)

    @property
    def settled(self) -> bool:
        """True once acked, nacked or dead-lettered (not when its lease ran out first)."""
        return self._state is not None and self._state != "expired"

    @property
    def lease_remaining(self) -> float:
        """Seconds left before the lease deadline (≤ 0 once it has passed)."""
        return self._deadline - self._sub._broker._monotonic()

    def _check_lease(self) -> None:
        """Raise ``LeaseExpired`` (and give the message up) at or after the deadline."""
        if self._sub._extending:
            self._sub._await_extend(self)
        if self._state == "expired" or self._sub._broker._monotonic() >= self._deadline:
            if self._state != "expired":  # told once, on the way into "expired"
                self._state = "expired"
                self._sub._gone((self,))
            self._sub._forget(self)
            raise _ran_out((self,))

    def _begin(self, op: str) -> bool:
        """Mark the message settled by ``op``; False if it already was by the same op.
        Atomic (under the subscription's lock): a consume loop may hand the message back
        from another thread at the same moment, and only one of the two may reach the
        broker."""
        sub = self._sub
        sub._check_open()
        if sub._extending:
            sub._await_extend(self)
        with sub._lock:
            state = self._state
            if state == op:
                return False
            if state is not None and state != "expired":
                raise AlreadySettled(f"message {self.id} was already {state}")
            late = state == "expired" or sub._broker._monotonic() >= self._deadline
            self._state = "expired" if late else op
            if late:
                sub._unsettled.discard(self)
        if late:
            if state != "expired":
                sub._gone((self,))
            raise _ran_out((self,))
        return True

    def _driver_settle(self, op: str | None, settle: Callable[..., None], *args: Any
                       ) -> None:
        """Run a driver settle (``op``: the state ``_begin`` set; None for ``extend``); a
        driver that knows the lease is gone before the deadline (its connection or
        partition was lost) raises ``LeaseExpired``: not settled then. Any other error (a
        broker error, an interrupt) is no settle either, as far as anyone knows: the
        message is unsettled again, as after a failed ``ack_many``, so any settle may
        follow (the same one too) and a close hands it back."""
        try:
            settle(self, *args)
        except LeaseExpired:
            self._state = "expired"
            self._sub._gone((self,))
            raise
        except BaseException:
            sub = self._sub
            with sub._lock:
                if op is not None and self._state == op:
                    self._state = None
                    sub._unsettled.add(self)
            raise

    def ack(self) -> None:
        """Done: remove the message for this group. A second ack is a no-op."""
        self._sub._ack(self)

    def nack(self, delay: float = 0.0) -> None:
        """Give the message back for redelivery after ``delay`` seconds.

        On the group's final attempt the message is dead-lettered instead, since it has then
        been delivered ``max_attempts`` times without an ack.
        """
        if self._state is None:
            self._sub._check_nack(delay)
        if self._begin("nacked"):
            self._driver_settle("nacked", self._sub._settle_nack, float(delay))

    def dead_letter(self, reason: str = "dead-lettered by consumer") -> None:
        """Move the message to the group's dead-letter store now, with ``reason``."""
        if not isinstance(reason, str):
            raise InvalidArgument("reason must be a str")
        if self._state is None:
            self._sub._broker._require(Feature.DEAD_LETTER)
        if self._begin("dead-lettered"):
            self._driver_settle("dead-lettered", self._sub._settle_dead, reason, self.attempt)

    def extend(self, seconds: float) -> None:
        """Renew the lease: keep the message ours for ``seconds`` from now."""
        if self.settled:
            raise AlreadySettled(f"message {self.id} was already {self._state}")
        self._check_lease()
        self._driver_settle(None, self._sub._extend, seconds)

    def __repr__(self) -> str:
        return (
            f"Message(id={self.id!r}, topic={self.topic!r}, attempt={self.attempt}, "
            f"bytes={len(self.body)})"
        )

