"""``Relay``: moves messages from a ``Source`` (an outbox table, or a broker group: the
bridge) to any broker, in claim order, ids unchanged, settling them at the source only
after the target confirmed them.

One step: claim up to ``batch`` messages, ``publish_batch`` them to the target, confirm
the claim. A message the target refuses for good (a ``ValidationError`` or ``Unsupported``:
too large for it, a priority it lacks) is marked at the source (the outbox row keeps it
with the reason; a group dead-letters it) and the rest go on. Any other failure releases
the claim: those messages are published again by a later claim, which is why the target
may see an id twice — never a message without its id, never one out of its key's order
within a claim. ``run`` repeats steps until stopped, waiting ``poll_interval`` (on the
injected clock) when an outbox is empty and backing off after failures.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..broker import Broker
from ..clock import Clock, SystemClock
from ..errors import InvalidArgument, MQError, Unsupported, ValidationError
from ..model import OutgoingMessage
from ..url import BrokerURL
from .source import Source

__all__ = ["Relay", "RelayStats", "open_source"]

log = logging.getLogger("mqabstract.outbox")


def open_source(url: str, *, lease: float = 30.0, clock: Clock | None = None) -> Source:
    """The source a URL names: ``sqlite:///app.db`` or ``postgresql://…/db`` (an outbox
    table; ``?schema=`` picks its schema, default ``mq``), or any broker URL with
    ``?group=NAME`` (a bridge from that group; ``pattern=``, ``ordered=``,
    ``max_attempts=`` too)."""
    from .bridge import GroupSource, split_url

    backend, mine = split_url(url)
    if "group" in mine:
        return GroupSource(backend, lease=lease, options=mine)
    parsed = BrokerURL.parse(url)
    if parsed.scheme == "sqlite":
        from .sqlite import SQLiteOutbox

        if parsed.hosts or not parsed.path:
            raise InvalidArgument(f"an outbox URL is sqlite:///path/to/app.db, not {parsed}")
        unknown = set(parsed.param_dict()) - {"schema"}
        if unknown:
            raise InvalidArgument(f"unknown outbox URL options {sorted(unknown)}")
        return SQLiteOutbox(parsed.path, schema=parsed.param("schema", "mq") or "mq",
                            lease=lease, clock=clock)
    if parsed.scheme in ("postgresql", "postgres"):
        pg = importlib.import_module("mqabstract.backends.postgresql.outbox")
        source: Source = pg.PGOutbox(url, lease=lease, clock=clock)
        return source
    raise InvalidArgument(f"an outbox source is sqlite:// or postgresql://, or a broker URL "
                          f"with ?group= (a bridge), not {parsed}")


@dataclass
class RelayStats:
    """What a relay did: messages moved (confirmed by the target), marked as refused by it
    (or expired before they were relayed), claims, and failed steps."""

    moved: int = 0
    rejected: int = 0
    claims: int = 0
    failures: int = 0


class Relay:
    """Moves ``source`` (a URL for ``open_source``, or a ``Source``) to ``target`` (a URL,
    or a ``Broker``, which stays the caller's). ``lease``: how long a claim may last before
    the source takes it back (a hung relay), seconds."""

    def __init__(self, source: str | Source, target: str | Broker, *, batch: int = 500,
                 poll_interval: float = 0.5, lease: float = 30.0,
                 clock: Clock | None = None) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 100_000:
            raise InvalidArgument(f"batch must be an int 1-100000, got {batch!r}")
        for name, value in (("poll_interval", poll_interval), ("lease", lease)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < 86400:
                raise InvalidArgument(f"{name} must be seconds > 0, got {value!r}")
        self.batch, self.poll_interval = batch, float(poll_interval)
        self._clock = clock or SystemClock()
        self._wake = threading.Event()
        self._clock.on_advance(self._wake.set)
        self.stats = RelayStats()
        self._own_target = not isinstance(target, Broker)
        self.target: Broker
        if isinstance(target, Broker):
            self.target = target
        else:
            from .. import connect

            self.target = connect(target)
        try:
            self.source = source if isinstance(source, Source) else open_source(
                source, lease=float(lease), clock=clock)
        except BaseException:
            if self._own_target:
                self.target.close()
            raise

    def step(self, wait: float = 0.0) -> int:
        """One claim moved to the target; the number of messages it held (0: none were
        waiting). Errors propagate after the claim was released."""
        msgs = self.source.claim(self.batch, wait)
        if not msgs:
            return 0
        self.stats.claims += 1
        try:
            rejected = self._publish(msgs)
            self.source.confirm()
        except BaseException:
            with contextlib.suppress(Exception):
                self.source.release()
            raise
        self.stats.moved += len(msgs) - rejected
        self.stats.rejected += rejected
        return len(msgs)

    def _publish(self, msgs: list[OutgoingMessage]) -> int:
        """Publish ``msgs`` in order, marking those the target refuses for good; how many."""
        todo = list(range(len(msgs)))
        rejected = 0
        while todo:
            try:
                self.target.publish_batch([msgs[i] for i in todo])
                return rejected
            except (ValidationError, Unsupported) as exc:
                if exc.index is None:
                    break  # not said which: one at a time below
                bad = todo.pop(exc.index)
                self.source.reject(bad, f"{type(exc).__name__}: {exc}")
                rejected += 1
        for i in todo:  # in order: a refused one is marked, the next still follows it
            try:
                self.target.publish_batch([msgs[i]])
            except (ValidationError, Unsupported) as exc:
                self.source.reject(i, f"{type(exc).__name__}: {exc}")
                rejected += 1
        return rejected

    def drain(self) -> int:
        """Steps until the source has nothing waiting; how many messages moved."""
        total = 0
        while n := self.step():
            total += n
        return total

    def run(self, stop: threading.Event | None = None, *, idle_timeout: float | None = None,
            on_error: Callable[[MQError], Any] | None = None) -> RelayStats:
        """Relay until ``stop`` is set (or nothing came for ``idle_timeout`` seconds).
        Failed steps are logged (``on_error`` sees them) and retried after a back-off of
        ``poll_interval`` doubling to 30 s; the relay never gives up on its own."""
        stop = stop or threading.Event()
        mono = getattr(self._clock, "monotonic", self._clock.time)
        idle_since = mono()
        pause = self.poll_interval
        while not stop.is_set():
            try:
                moved = self.step(self.poll_interval if self.source.waits else 0.0)
            except MQError as exc:
                self.stats.failures += 1
                log.warning("relay %s -> %s: %s", self.source.where, self.target.url, exc)
                if on_error is not None:
                    on_error(exc)
                self._sleep(stop, pause)
                pause = min(pause * 2, 30.0)
                continue
            pause = self.poll_interval
            if moved:
                idle_since = mono()
                continue
            if idle_timeout is not None and mono() - idle_since >= idle_timeout:
                break
            if not self.source.waits:
                self._sleep(stop, self.poll_interval)
        return self.stats

    def _sleep(self, stop: threading.Event, seconds: float) -> None:
        """Wait ``seconds`` of the clock (a ``FakeClock`` moves only when advanced) or
        until ``stop``."""
        mono = getattr(self._clock, "monotonic", self._clock.time)
        end = mono() + seconds
        while not stop.is_set():
            left = end - mono()
            if left <= 0:
                return
            self._wake.clear()
            self._wake.wait(min(left, 0.05))

    def close(self) -> None:
        """Release the open claim, close the source and (when it opened it) the target."""
        try:
            self.source.close()
        finally:
            if self._own_target:
                self.target.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Relay({self.source.where!r} -> {self.target.url!r})"
