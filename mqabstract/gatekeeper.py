"""``Gatekeeper``: the ordered-key gate of one subscription, and the keeper thread.

For a group declared ``ordered=True`` on a broker that would hand out a key's next message
while an earlier one is out (``Capabilities.key_gate`` "hold" or "hand_back"), the
subscription passes what it receives through a ``KeyGate`` (the rule, in
``emulation/ordering.py``). The gatekeeper does the rest around it: admits received
messages, hands held ones out once their key is free (with a fresh lease), tells the gate
of settles, renews held leases on a keeper thread while any wait, and gives held ones
back to the broker where the gate says so (``hand_back``), remembering them so that their
next delivery does not count that one.

Separate from ``subscription.py``: one concern with its own thread and state; it takes
the subscription's lock (the same lock as its settles) around every gate call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Protocol

from .capabilities import Feature
from .driver import DriverSubscription
from .emulation.ordering import RETURN_PATIENCE, KeyGate
from .errors import LeaseExpired, MQError
from .host import Host
from .message import Message
from .model import Delivery, GroupSpec

__all__ = ["Gatekeeper"]

log = logging.getLogger("mqabstract")


class Owner(Protocol):
    """The subscription a gatekeeper serves, as the gatekeeper uses it (``Subscription``
    has it)."""

    @property
    def spec(self) -> GroupSpec: ...

    @property
    def _broker(self) -> Host: ...

    @property
    def _inner(self) -> DriverSubscription: ...

    @property
    def _lock(self) -> threading.Lock: ...

    @property
    def _unsettled(self) -> set[Message]: ...

    def _release(self, messages: Iterable[Message]) -> None: ...


class Gatekeeper:
    """One ordered subscription's gate, its keeper thread and its handed-back ids."""

    def __init__(self, sub: Owner) -> None:
        self.sub = sub
        caps = sub._broker.capabilities
        self.gate: KeyGate[Message] = KeyGate(max(2 * sub.spec.lease, RETURN_PATIENCE),
                                              hand_back=caps.key_gate == "hand_back")
        self.can_extend = caps.supports(Feature.LEASE_EXTEND)
        self.keeper: threading.Thread | None = None
        self.keeper_stop = threading.Event()
        # Held messages handed back unseen (key_gate="hand_back") -> how many times: the
        # broker counted those receives as deliveries; the application never saw them.
        self.unseen: dict[str, int] = {}

    def admit(self, fresh: list[Message]) -> list[Message]:
        """Received messages through the gate: those that go out now (the rest are held,
        their leases renewed by the keeper thread until their key is free)."""
        gate = self.gate
        now = self.sub._broker._monotonic()
        with self.sub._lock:
            out = [m for m in fresh if gate.admit(m, now)]
            if len(gate) and (self.keeper is None or not self.keeper.is_alive()):
                self.keeper = threading.Thread(
                    target=self._keep, name=f"mqabstract-held-{self.sub.spec.name}", daemon=True)
                self.keeper.start()
            back = self._outgoing_locked()
        if back:
            self._hand_back(back)
        return out

    def _hand_back(self, messages: list[Message]) -> None:
        """Give held messages back to the broker unseen; their next delivery here does not
        count this one (the broker did: SQS's receive count)."""
        unseen = self.unseen
        if len(unseen) > 10_000:  # ids that came back to other consumers: forget them
            unseen.clear()
        for msg in messages:
            unseen[msg.id] = unseen.get(msg.id, 0) + 1
        self.sub._release(messages)

    def _outgoing_locked(self) -> list[Message]:
        """Held messages the gate gives back to the broker (``key_gate="hand_back"``)."""
        gate = self.gate
        if not gate.outgoing:
            return []
        out, gate.outgoing = gate.outgoing, []
        return out

    def unhold(self, limit: int) -> list[Message]:
        """Held messages whose key became free, each with a fresh lease from now (one
        whose lease is gone is never handed out: it comes again, first of its key)."""
        gate = self.gate
        now = self.sub._broker._monotonic()
        with self.sub._lock:
            ready = gate.ready(now, limit)
            back = self._outgoing_locked()
        if back:
            self._hand_back(back)
        out: list[Message] = []
        for i, msg in enumerate(ready):
            try:
                renewed = self._renew(msg)
            except BaseException:
                with self.sub._lock:
                    for rest in reversed(ready[i:]):
                        gate.put_back(rest)
                if out:
                    with self.sub._lock:
                        self.sub._unsettled.update(out)
                raise
            if renewed:
                out.append(msg)
            else:
                with self.sub._lock:
                    gate.returned(msg, now + gate.patience)
        return out

    def _renew(self, msg: Message) -> bool:
        """Renew a held message's lease for a whole lease from now; False when it is gone
        (without lease extend: whether its first lease still runs)."""
        broker = self.sub._broker
        now = broker._monotonic()
        if now >= msg._deadline or not self.can_extend:  # the lease rule: ours ended
            return now < msg._deadline
        renewed = now + self.sub.spec.lease  # read before the driver renews
        try:
            with broker._guard:
                self.sub._inner.extend(msg._receipt, self.sub.spec.lease)
        except LeaseExpired:
            return False
        msg._deadline = renewed
        return True

    def renew_held(self) -> int:
        """Renew the leases of held messages with less than half a lease left, so their
        broker lease never runs out while they wait; returns how many are held."""
        gate = self.gate
        now = self.sub._broker._monotonic()
        with self.sub._lock:
            due = gate.renewals(now, self.sub.spec.lease / 2)
        for msg in due:
            try:
                kept = self._renew(msg)
            except MQError as exc:  # the broker away for a moment: the next tick retries
                log.debug("renewing a held message of group %r: %s", self.sub.spec.name, exc)
                continue
            if not kept:
                with self.sub._lock:
                    gate.lost(msg, now + gate.patience)
        with self.sub._lock:
            back = self._outgoing_locked()
        if back:
            self._hand_back(back)
        with self.sub._lock:
            return len(gate)

    def _keep(self) -> None:
        """The keeper thread: renews held leases every quarter lease while any are held."""
        tick = min(max(self.sub.spec.lease / 4, 0.01), 5.0)
        while not self.keeper_stop.wait(tick):
            try:
                if not self.renew_held():
                    with self.sub._lock:
                        if not len(self.gate):
                            self.keeper = None
                            return
            except Exception as exc:  # e.g. Closed while closing
                log.debug("keeper of group %r: %s", self.sub.spec.name, exc)

    def ungate(self, messages: Iterable[Message], back: float | None) -> None:
        """Settled: ``back`` None, done (acked, dead-lettered): the key is free; else the
        message comes again after ``back`` seconds and its key waits for it."""
        gate = self.gate
        with self.sub._lock:
            if back is None:
                for msg in messages:
                    gate.done(msg)
            else:
                until = self.sub._broker._monotonic() + back + gate.patience
                for msg in messages:
                    gate.returned(msg, until)
            out = self._outgoing_locked()
        if out:
            self._hand_back(out)

    def forget(self, delivery: Delivery) -> None:
        """A delivery nobody is shown (dead-lettered or expired on receipt) will not come
        again: its key stops waiting for it."""
        with self.sub._lock:
            self.gate.gone(delivery.key, delivery.id)

    def stop(self) -> None:
        """The subscription closes: the keeper thread ends at its next tick."""
        self.keeper_stop.set()
