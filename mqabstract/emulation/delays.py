"""Delays where the broker's own are short, coarse or missing: tiers and deferral hops."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

__all__ = ["Tiers", "next_hop"]


class Tiers:
    """A fixed ladder of delay queues (milliseconds, ascending).

    A message waits in the largest tier not longer than its remaining delay and is looked
    at again when it comes out; so a delay of any length takes a few hops and never comes
    out early. Remaining delays below the smallest tier use the smallest.
    """

    def __init__(self, ms: Sequence[int]) -> None:
        if not ms or list(ms) != sorted(set(ms)) or ms[0] <= 0:
            raise ValueError("tiers must be positive, ascending and distinct")
        self.ms = tuple(ms)

    def tier_for(self, seconds: float) -> int:
        """The tier (ms) for a message due in ``seconds``."""
        wanted = seconds * 1000.0
        best = self.ms[0]
        for tier in self.ms:
            if tier > wanted:
                break
            best = tier
        return best

    def __iter__(self) -> Iterator[int]:
        return iter(self.ms)


def next_hop(remaining: float, longest: float) -> int:
    """Whole seconds of the next deferral of a message due in ``remaining`` seconds.

    The broker can hide a message for at most ``longest`` seconds at a time; the message is
    deferred again when it comes back before its due time (rounded up: never early).
    """
    return int(min(longest, max(0, math.ceil(remaining))))
