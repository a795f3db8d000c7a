"""Time, read through an injectable clock so tests of delays and leases need not sleep."""

from __future__ import annotations

import threading
import time as _time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """Wall-clock seconds since the epoch, a monotonic reading for deadlines, and a hook
    to learn when time jumps."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...

    def on_advance(self, callback: Callable[[], None]) -> None: ...


class SystemClock:
    """The real clock. Never jumps in a way callers must be told about."""

    # The C functions themselves: read on every settle, a method around them costs a call.
    time = staticmethod(_time.time)
    monotonic = staticmethod(_time.monotonic)

    def on_advance(self, callback: Callable[[], None]) -> None:
        return None


class FakeClock:
    """A clock that only moves when told to; waiters are woken on every ``advance``."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def time(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        """Moves with ``time()``: only ``advance`` changes either."""
        return self.time()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            callbacks = list(self._callbacks)
        for cb in callbacks:
            cb()

    def on_advance(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)
