"""One message of a key at a time, for ordered groups whose broker would hand out more.

RabbitMQ's single active consumer and Kafka's partition owner deliver a key's messages in
order to one consumer, but hand it the next one while the previous is still leased. The
contract (one at a time) is kept here, once, for every such driver: the portable layer
passes each received message of an ordered group through a ``KeyGate``, which lets the
first of a key out and holds the later ones until the key is free again.

A key is busy while its *head* (the message handed out) is leased, and while a message
that went back to the broker (nacked, released, its lease ran out, or lost while held) has
not come again: that one goes first when it does. Waiting for it has a bound (``until``):
a message that comes back to another consumer (a Kafka rebalance) must not stop the key
here for ever. Held messages stay leased by the driver; the caller renews them
(``renewals``) so their broker lease never runs out while they wait.

With ``hand_back`` (SQS FIFO: the broker keeps a key's messages behind any of them that
is out, so a held one would keep the returned one from coming again) a head that goes
back takes the key's held messages with it: they move to ``outgoing`` for the caller to
give back to the broker, which then delivers them in order; nothing is waited for here.

Not thread-safe: the caller serialises calls (the subscription's lock). Time is the
caller's monotonic clock, passed in, so every rule is testable on a ``FakeClock``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = ["RETURN_PATIENCE", "Gated", "KeyGate"]

#: Seconds a key waits, beyond a nack's delay, for a message that went back to the broker
#: to come again before its later messages go out without it (a lower bound; the caller
#: adds the lease).
RETURN_PATIENCE = 30.0


class Gated(Protocol):
    """What the gate reads of a message (``mqabstract.Message`` has it)."""

    @property
    def id(self) -> str: ...

    @property
    def key(self) -> str | None: ...

    @property
    def _deadline(self) -> float: ...

    @property
    def _state(self) -> str | None: ...


M = TypeVar("M", bound=Gated)

@dataclass
class _Key(Generic[M]):
    head: M | None = None  #: handed out, leased
    back: dict[str, float] = field(default_factory=dict)  #: id -> until: gone back, comes first
    held: deque[M] = field(default_factory=deque)  #: later ones, in arrival order


class KeyGate(Generic[M]):
    """Per-key hold-back of an ordered group's messages (see the module doc)."""

    def __init__(self, patience: float = RETURN_PATIENCE, hand_back: bool = False) -> None:
        self.patience = patience
        self.hand_back = hand_back
        #: held messages to give back to the broker (``hand_back`` only); the caller empties it
        self.outgoing: list[M] = []
        self._keys: dict[str, _Key[M]] = {}
        self._count = 0  # held messages, all keys

    def __len__(self) -> int:
        """How many messages are held."""
        return self._count

    def _free(self, k: _Key[M], now: float) -> bool:
        """Whether nothing of the key is out: forgets a head that was settled, or whose
        lease ended (then it comes again: waited for), and waits that passed their bound."""
        head = k.head
        if head is not None and (head._state == "expired" or head._deadline <= now):
            # Its lease ended before a settle was confirmed (``done`` and ``returned``
            # forget the head): it comes again, first.
            self._went_back(k, head, now + self.patience)
        if k.back:
            for mid in [m for m, until in k.back.items() if until <= now]:
                del k.back[mid]
        return k.head is None and not k.back

    def _went_back(self, k: _Key[M], head: M, until: float) -> None:
        k.head = None
        if self.hand_back:
            self.outgoing += k.held
            self._count -= len(k.held)
            k.held.clear()
        else:
            k.back.setdefault(head.id, until)

    def admit(self, msg: M, now: float) -> bool:
        """A message of ``msg.key`` was received: True to hand it out now (it becomes the
        key's head), False when it is held (it goes out from ``ready``)."""
        key = msg.key
        if key is None:
            return True
        k = self._keys.get(key)
        if k is None:
            self._keys[key] = _Key(head=msg)
            return True
        free = self._free(k, now)
        if msg.id in k.back:  # the one that went back: before every held one
            del k.back[msg.id]
            if k.head is None:
                k.head = msg
                return True
            k.held.appendleft(msg)
            self._count += 1
            return False
        for i, other in enumerate(k.held):
            if other.id == msg.id:  # a held one delivered again (its old lease is gone)
                k.held[i] = msg
                return False
        if free and not k.held:
            k.head = msg
            return True
        k.held.append(msg)
        self._count += 1
        return False

    def ready(self, now: float, limit: int) -> list[M]:
        """Up to ``limit`` held messages whose key is free now, each its key's new head."""
        out: list[M] = []
        if not self._keys:
            return out
        for key in list(self._keys):
            if len(out) >= limit:
                break
            k = self._keys[key]
            if not self._free(k, now):
                continue
            if not k.held:
                del self._keys[key]  # nothing out, nothing waiting: forgotten
                continue
            msg = k.held.popleft()
            self._count -= 1
            k.head = msg
            out.append(msg)
        return out

    def put_back(self, msg: M) -> None:
        """``msg`` came out of ``ready`` but could not be handed out (its lease could not
        be renewed for a passing reason): held again, first of its key."""
        k = self._keys.get(msg.key) if msg.key is not None else None
        if k is not None and k.head is msg:
            k.head = None
            k.held.appendleft(msg)
            self._count += 1

    def returned(self, msg: M, until: float) -> None:
        """``msg`` went back to the broker (nack, release) and comes again: its key waits
        for it until ``until``."""
        k = self._keys.get(msg.key) if msg.key is not None else None
        if k is not None and k.head is msg:
            self._went_back(k, msg, until)

    def done(self, msg: M) -> None:
        """``msg`` was acked or dead-lettered: its key is free (unless others went back)."""
        k = self._keys.get(msg.key) if msg.key is not None else None
        if k is not None and k.head is msg:
            k.head = None

    def gone(self, key: str | None, mid: str) -> None:
        """A message the application never sees (dead-lettered at max attempts, its TTL
        over) was received: it will not come again."""
        k = self._keys.get(key) if key is not None else None
        if k is not None:
            k.back.pop(mid, None)

    def lost(self, msg: M, until: float) -> None:
        """A held message's lease is gone (its connection or partition was lost): no
        longer held; it comes again, before the key's later messages."""
        k = self._keys.get(msg.key) if msg.key is not None else None
        if k is not None and msg in k.held:
            k.held.remove(msg)
            self._count -= 1
            if not self.hand_back:
                k.back[msg.id] = until

    def held(self) -> Iterator[M]:
        """Every held message (for renewing their leases)."""
        for k in self._keys.values():
            yield from k.held

    def renewals(self, now: float, margin: float) -> list[M]:
        """Held messages whose lease ends within ``margin`` seconds."""
        return [m for m in self.held() if m._deadline - now <= margin]

    def drain(self) -> list[M]:
        """Take every held message out (closing: they are handed back, in order per key)."""
        out = list(self.held())
        self._keys.clear()
        self._count = 0
        return out
