"""What a relay moves messages from: an outbox table or a broker group (``Source``)."""

from __future__ import annotations

from ..model import OutgoingMessage

__all__ = ["Source"]


class Source:
    """Where a ``Relay`` takes messages from, one claim at a time.

    ``claim`` takes up to ``max_messages`` in the order they must be published (a key's in
    commit order) and keeps them from every other relay until ``confirm`` (the target has
    them all: they go from here) or ``release`` (they stay, for this or another relay). A
    process killed in between releases them too (the database or the broker takes the
    claim back). ``reject(i)`` marks claimed message ``i`` as one the target refuses for
    good; ``confirm`` then settles it with the others. One claim is open at a time."""

    #: whether ``claim`` waits for messages itself (a broker group) or answers at once
    #: (an outbox table: the relay polls)
    waits = False
    where = ""

    def claim(self, max_messages: int, wait: float) -> list[OutgoingMessage]:
        raise NotImplementedError

    def confirm(self) -> None:
        raise NotImplementedError

    def reject(self, index: int, reason: str) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release any open claim and let go of the connection (idempotent)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where!r})"
