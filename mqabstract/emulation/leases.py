"""Driver-kept leases, for brokers that have no visibility timeout (RabbitMQ, Kafka).

The portable layer decides what the application sees (a settle at or after the deadline
raises ``LeaseExpired`` and never reaches the driver). This table is the driver's side:
which delivery a receipt token names, until when the driver holds it before handing it
back to the broker, and which of them ran out. Time comes from the injected clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from mqabstract.clock import Clock

__all__ = ["LeaseTable"]

T = TypeVar("T")


class LeaseTable(Generic[T]):
    """Leased items by token, with their monotonic deadlines. Not thread-safe: the caller
    holds its own lock (drivers already serialize settles and their expiry tick)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._items: dict[int, tuple[float, T]] = {}
        self._heap: list[tuple[float, int]] = []  # (deadline, token); stale rows skipped
        self._tokens = itertools.count(1)

    def grant(self, item: T, seconds: float, *, start: float | None = None) -> int:
        """Lease ``item`` for ``seconds`` from ``start`` (default: now); return its token."""
        token = next(self._tokens)
        deadline = (self._clock.monotonic() if start is None else start) + seconds
        self._items[token] = (deadline, item)
        heapq.heappush(self._heap, (deadline, token))
        return token

    def take(self, token: int) -> T | None:
        """Remove and return the item to settle it; None when the token is unknown, already
        settled or past its deadline (a stale settle: the message is handed back)."""
        row = self._items.get(token)
        if row is None or row[0] <= self._clock.monotonic():
            return None
        del self._items[token]
        return row[1]

    def extend(self, token: int, seconds: float) -> bool:
        """Move the deadline to now + ``seconds``; False when the lease is gone."""
        row = self._items.get(token)
        now = self._clock.monotonic()
        if row is None or row[0] <= now:
            return False
        self._items[token] = (now + seconds, row[1])
        heapq.heappush(self._heap, (now + seconds, token))
        return True

    def deadline(self, token: int) -> float | None:
        row = self._items.get(token)
        return None if row is None else row[0]

    def expired(self) -> list[T]:
        """Remove and return every item whose deadline has come, oldest deadline first."""
        now = self._clock.monotonic()
        out: list[T] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, token = heapq.heappop(heap)
            row = self._items.get(token)
            if row is not None and row[0] == deadline:  # not settled, not extended since
                del self._items[token]
                out.append(row[1])
        return out

    def next_deadline(self) -> float | None:
        """The earliest live deadline (for a driver's timer), or None."""
        heap = self._heap
        while heap:
            deadline, token = heap[0]
            row = self._items.get(token)
            if row is not None and row[0] == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def drop(self, where: Callable[[T], bool]) -> list[T]:
        """Remove and return the items ``where`` selects (e.g. a revoked partition's)."""
        gone = [(t, row[1]) for t, row in self._items.items() if where(row[1])]
        for token, _ in gone:
            del self._items[token]
        return [item for _, item in gone]

    def clear(self) -> list[T]:
        items = [row[1] for row in self._items.values()]
        self._items.clear()
        self._heap.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter([row[1] for row in self._items.values()])
