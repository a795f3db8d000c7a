"""Idle receivers of a store-based driver (SQLite, PostgreSQL) and what wakes them.

Writers of this process bump a per-group counter (a publish, a nack, a freed key) or the
general one (close, a clock jump, a NOTIFY heard after a reconnect) and notify; a receiver
takes a stamp *before* it looks at the store, so a write landing between its look and its
wait is never missed, and waits only while the stamp is unchanged. Receivers of other
groups stay asleep.
"""

from __future__ import annotations

import threading
from collections.abc import Collection

__all__ = ["Waker"]


class Waker:
    """Counters under one condition: ``gen`` wakes every receiver, ``groups[gid]`` one
    group's."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.gen = 0
        self.groups: dict[int, int] = {}

    def stamp(self, gid: int) -> tuple[int, int]:
        return self.gen, self.groups.get(gid, 0)

    def wake(self, gids: Collection[int] | None = None) -> None:
        """Wake every receiver (``gids`` None) or those of ``gids``."""
        with self.cond:
            if gids is None:
                self.gen += 1
            else:
                for gid in gids:
                    self.groups[gid] = self.groups.get(gid, 0) + 1
            self.cond.notify_all()

    def wait(self, gid: int, seen: tuple[int, int], seconds: float) -> bool:
        """Wait up to ``seconds`` unless ``gid``'s stamp already moved past ``seen``;
        True when it did (something was written), False on a plain timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self.stamp(gid) != seen, seconds)
