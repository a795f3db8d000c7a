"""The production consume loop, one design for the sync and the asyncio API.

``Subscription.consume`` (a worker pool of threads) and ``AsyncSubscription.consume``
(tasks) share everything here but the waiting: what to ask ``receive`` for, which message
may start (``concurrency`` handlers at once; in an ordered group never two of one key),
which leases to renew while handlers run (``auto_extend``), and what a stop does: take no
more messages, let running handlers finish within ``grace`` seconds, hand the rest back for
redelivery at once. The settle decision after a handler (ack / nack with backoff /
dead-letter; an invalid payload dead-lettered unhandled) is ``ConsumeLoop``'s too.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from .capabilities import Feature
from .checks import check_count, check_seconds
from .dedupe import DedupeStore
from .errors import DecodeError, Duplicate, InvalidArgument, LeaseExpired, MQError
from .hooks import PUSHED
from .url import redact

if TYPE_CHECKING:
    from .host import Host
    from .message import Message
    from .model import GroupSpec
    from .typed import Model

__all__ = ["Backoff", "ConsumeStats"]

log = logging.getLogger("mqabstract")

#: Signals a consume loop stops on when asked to (``signals=True``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Consumable(Protocol):
    """The subscription a consume loop runs on, as the loop uses it (``Subscription``
    has it): receive, hand back, stop, and the group's settings."""

    @property
    def spec(self) -> GroupSpec: ...

    @property
    def model(self) -> Model | None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def _stop(self) -> threading.Event: ...

    @property
    def _broker(self) -> Host: ...

    def receive(self, max_messages: int = 1, wait: float = 0.0) -> list[Message]: ...

    def _release(self, messages: Iterable[Message]) -> None: ...


@dataclass(frozen=True)
class Backoff:
    """Redelivery delay after a handler failure: ``initial * multiplier**(attempt-1)``."""

    initial: float = 1.0
    multiplier: float = 2.0
    maximum: float = 300.0
    jitter: float = 0.1  #: ± fraction applied at random, so failing consumers don't stampede

    def delay(self, attempt: int) -> float:
        base = min(self.maximum, self.initial * self.multiplier ** max(0, attempt - 1))
        if self.jitter:
            base *= 1 + random.uniform(-self.jitter, self.jitter)
        return max(0.0, min(self.maximum, base))


@dataclass
class ConsumeStats:
    """What a ``consume`` run did."""

    received: int = 0
    acked: int = 0
    retried: int = 0
    dead_lettered: int = 0  #: includes ``invalid``
    failed: int = 0  #: handler raised
    expired: int = 0  #: settled at or after the lease deadline (``LeaseExpired``)
    invalid: int = 0  #: payload failed the subscription's model: dead-lettered, never retried
    released: int = 0  #: handed back unfinished at a stop (never started, or outlived grace)
    extended: int = 0  #: lease renewals made by ``auto_extend``
    duplicates: int = 0  #: already processed (``dedupe``): acked, handler not called

    def __iadd__(self, other: ConsumeStats) -> ConsumeStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


class Flight:
    """The messages a consume loop holds (leased, not yet finished): at most ``limit``;
    at most ``concurrency`` of them running. In an ordered group ``receive`` never hands
    out a key's next message before the previous one is settled (the broker or the
    portable layer's gate, ``mqabstract.emulation.ordering``), so a key never has two
    handlers at once without anything here. Not locked: the sync loop guards it with its
    condition, the asyncio loop touches it from one thread."""

    def __init__(self, concurrency: int, limit: int) -> None:
        self.concurrency, self.limit = concurrency, limit
        self.held: dict[int, Message] = {}  # id(msg) -> msg
        self.running: dict[int, Message] = {}
        self.settling: set[int] = set()  # handler returned, settle in progress
        self.ready: deque[Message] = deque()  # may start as soon as a slot frees

    def room(self) -> int:
        """How many more messages may be leased now."""
        return self.limit - len(self.held)

    def wants_more(self) -> bool:
        """Time to receive: there is room, and either nothing is waiting to start or half
        the limit is free (refilling one message at a time would cost a receive each)."""
        room = self.room()
        return room > 0 and (not self.ready or room >= self.limit // 2)

    def admit(self, messages: Sequence[Message]) -> None:
        for msg in messages:
            self.held[id(msg)] = msg
            self.ready.append(msg)

    def take(self) -> list[Message]:
        """The messages to start now (marked running). A message being settled leaves its
        slot to the next handler."""
        out = []
        while self.ready and len(self.running) - len(self.settling) < self.concurrency:
            msg = self.ready.popleft()
            self.running[id(msg)] = msg
            out.append(msg)
        return out

    def settle(self, msg: Message) -> bool:
        """The handler of ``msg`` returned: False if the stop already handed it back."""
        if id(msg) not in self.running:
            return False
        self.settling.add(id(msg))
        return True

    def finish(self, msg: Message) -> None:
        """``msg`` is done (settled or handed back)."""
        self.settling.discard(id(msg))
        if self.running.pop(id(msg), None) is None:
            return
        del self.held[id(msg)]

    def due(self, now: float, margin: float) -> list[Message]:
        """Held messages, not being settled, whose lease ends within ``margin`` seconds."""
        return [m for k, m in self.held.items()
                if k not in self.settling and m._state is None and m._deadline - now <= margin]

    def drop_waiting(self) -> list[Message]:
        """Stop: every held message no handler has started (to hand back)."""
        out = [m for k, m in self.held.items() if k not in self.running]
        for msg in out:
            del self.held[id(msg)]
        self.ready.clear()
        return out

    def unstart(self, msg: Message) -> list[Message]:
        """Stopping: ``msg`` was taken but its handler never began; it and every message
        still waiting are to be handed back."""
        if self.running.pop(id(msg), None) is None:
            return []
        del self.held[id(msg)]
        return [msg, *self.drop_waiting()]

    def drop_running(self) -> list[Message]:
        """Grace is over: the running messages whose handler has not returned."""
        out = [m for k, m in self.running.items() if k not in self.settling]
        for msg in out:
            del self.running[id(msg)]
            del self.held[id(msg)]
        return out

    @property
    def busy(self) -> bool:
        return bool(self.running)


class ConsumeLoop:
    """One ``consume`` run's settings and state: checked before anything is received."""

    def __init__(self, sub: Consumable, *, max_messages: int | None,
                 idle_timeout: float | None, batch: int, wait: float,
                 backoff: Backoff | None, concurrency: int, auto_extend: bool | None,
                 grace: float, dedupe: DedupeStore | None = None) -> None:
        check_count(batch, "batch")
        check_count(concurrency, "concurrency")
        if max_messages is not None:
            check_count(max_messages, "max_messages")
        if idle_timeout is not None:
            check_seconds(idle_timeout, "idle_timeout", math.inf)
        if auto_extend is not None and not isinstance(auto_extend, bool):
            raise InvalidArgument(f"auto_extend must be a bool or None, got {auto_extend!r}")
        if backoff is not None and not isinstance(backoff, Backoff):
            raise InvalidArgument("backoff must be a mqabstract.Backoff")
        if dedupe is not None and not isinstance(dedupe, DedupeStore):
            raise InvalidArgument("dedupe must be a mqabstract.dedupe store (MemoryStore, "
                                  f"SQLiteStore), got {type(dedupe).__name__}")
        self.dedupe = dedupe
        self.sub = sub
        spec: GroupSpec = sub.spec
        can_extend = sub._broker.capabilities.supports(Feature.LEASE_EXTEND)
        if auto_extend and not can_extend:
            sub._broker._require(Feature.LEASE_EXTEND)
        self.max_messages, self.idle_timeout = max_messages, idle_timeout
        self.batch, self.wait = batch, check_seconds(wait, "wait", math.inf)
        self.grace = check_seconds(grace, "grace", math.inf)
        self.backoff = backoff or Backoff()
        self.concurrency = concurrency
        #: Renew leases of held messages that have less than half the lease left.
        self.extend_by = spec.lease if (can_extend if auto_extend is None else auto_extend) \
            else None
        self.tick = min(max(spec.lease / 4, 0.01), 5.0)
        self.flight = Flight(concurrency, max(concurrency, batch))
        self.stats = ConsumeStats()
        self.last_message = time.monotonic()
        self.failures = 0

    def next(self) -> tuple[int, float] | None:
        """(max_messages, wait) for the next receive; None when the loop should end.
        Call it only when ``flight.wants_more()``."""
        done = self.stats.received
        want = min(self.batch, self.flight.room())
        if self.max_messages is not None:
            if done >= self.max_messages:
                return None
            want = min(want, self.max_messages - done)
        if self.idle_timeout is None:
            return want, self.wait
        left = self.idle_timeout - (time.monotonic() - self.last_message)
        return None if left <= 0 else (want, min(self.wait, left))

    def got(self, messages: Sequence[Message]) -> None:
        """A receive returned: count the messages and hold them."""
        self.failures = 0
        if messages:
            self.last_message = time.monotonic()
            self.stats.received += len(messages)
            self.flight.admit(messages)

    def failed(self, exc: MQError, closed: bool) -> float:
        """A receive raised: re-raise unless retryable; else the seconds to pause."""
        if not exc.retryable or closed:
            raise exc
        self.failures += 1
        pause = self.backoff.delay(self.failures)
        log.warning("consume: %s; retrying in %.1fs", exc, pause)
        return pause

    def count(self, names: Sequence[str]) -> None:
        for name in names:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def seen(self, msg: Message) -> bool:
        """Whether the ``dedupe`` store says this group already processed ``msg``'s id."""
        return self.dedupe is not None and self.dedupe.seen(msg.group, msg.id)

    def processed(self, msg: Message) -> None:
        """``msg``'s handler succeeded: the ``dedupe`` store remembers its id (before the ack,
        so a crash in between makes the redelivery a duplicate)."""
        # Only when it will be acked: a handler that nacked or dead-lettered the message
        # itself gave it back, and its redelivery (or replay) must be handled again.
        if self.dedupe is not None and msg._state in (None, "acked"):
            self.dedupe.record(msg.group, msg.id)

    def due(self, now: float) -> list[Message]:
        """Messages whose lease ``auto_extend`` renews now (less than half of it left)."""
        assert self.extend_by is not None
        return self.flight.due(now, self.extend_by / 2)

    def invalid(self, msg: Message) -> str | None:
        """Why ``msg``'s payload fails the subscription's model (None: it fits, or there is
        no model). Decodes it once; the handler then reads ``msg.value`` for free."""
        if self.sub.model is None:
            return None
        try:
            msg.value  # noqa: B018 - decodes and caches
        except DecodeError as exc:
            return str(exc)
        return None

    def reject(self, msg: Message, reason: str) -> tuple[str, ...]:
        """Dead-letter a message whose payload is invalid: retrying cannot fix it."""
        log.warning("consume: %s dead-lettered: invalid payload: %s", msg.id, reason)
        try:
            msg.dead_letter(f"invalid payload: {reason}")
        except LeaseExpired as late:
            _count_expired(msg, late)
            return ("expired",)
        return ("invalid", "dead_lettered")

    def outcome(self, msg: Message, exc: Exception | None) -> tuple[str, ...]:
        """Settle ``msg`` after its handler returned (``exc`` None: ack unless it settled
        the message itself) or raised ``exc`` (nack with backoff; dead-letter on the final
        attempt; a ``LeaseExpired`` is counted, not retried). Returns the ``ConsumeStats``
        counters to add. Shared by the sync and the asyncio ``consume``."""
        if isinstance(exc, LeaseExpired):  # the handler settled too late: counted, logged
            _count_expired(msg, exc)
            return ("expired",)
        counts: tuple[str, ...] = () if exc is None else ("failed",)
        if msg.settled:
            return counts
        caps = self.sub._broker.capabilities
        try:
            if exc is None:
                msg.ack()
                return ("acked",)
            if caps.supports(Feature.DEAD_LETTER) and msg.attempt >= self.sub.spec.max_attempts:
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("consume: %s dead-lettered after %d attempts: %s",
                            msg.id, msg.attempt, reason)
                msg.dead_letter(reason)
                return (*counts, "dead_lettered")
            msg.nack(self.backoff.delay(msg.attempt) if caps.supports(Feature.NACK_DELAY) else 0.0)
            return (*counts, "retried")
        except LeaseExpired as late:
            _count_expired(msg, late)
            return (*counts, "expired")


def _count_expired(msg: Message, exc: LeaseExpired) -> None:
    log.warning("consume: handler outlived the lease of %s (attempt %d): %s",
                msg.id, msg.attempt, exc)


def renew(msg: Message, seconds: float) -> bool:
    """``msg.extend(seconds)`` for ``auto_extend``: a message settled or lost meanwhile is
    not an error of the loop (its handler or the stop decides its fate)."""
    try:
        msg.extend(seconds)
        return True
    except MQError as exc:
        log.debug("auto_extend of %s: %s", msg.id, redact(str(exc)))
        return False


def check_handler(handler: object, coroutine: bool) -> None:
    """A handler of the sync consume is a plain callable; of the asyncio one, ``async def``."""
    import inspect

    call = getattr(handler, "__call__", None)  # noqa: B004 - callable objects too
    is_coro = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)
    if not callable(handler):
        raise InvalidArgument(f"handler must be callable, got {type(handler).__name__}")
    if coroutine and not is_coro:
        raise InvalidArgument("the asyncio consume takes a coroutine function (async def)")
    if not coroutine and is_coro:
        raise InvalidArgument("a coroutine handler needs the asyncio API (mqabstract.aio)")


def replying(handler: Callable[[Any], object], reply: object) -> Callable[[Any], object]:
    """``consume(reply=True)``: a handler's non-None return value answers a request (a
    message with a reply route) before the message is acked; a failed reply is a failure
    of the handler (the request comes again)."""
    if not isinstance(reply, bool):
        raise InvalidArgument(f"reply must be a bool, got {reply!r}")
    if not reply:
        return handler
    import inspect

    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)):  # noqa: B004
        async def answer_async(msg: Any) -> object:
            result = await handler(msg)  # type: ignore[misc]
            if result is not None and msg.reply_to:
                await msg.reply(result)
            return result

        return answer_async

    def answer(msg: Any) -> object:
        result = handler(msg)
        if result is not None and msg.reply_to:
            msg.reply(result)
        return result

    return answer


@contextmanager
def stop_on_signals(enabled: bool, stop: Callable[[], None]) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call ``stop`` (then the previous handlers
    are back). Only the main thread may install signal handlers: elsewhere, a typed error."""
    if not enabled:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise InvalidArgument("signals=True works only in the main thread")
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def on_signal(signum: int, frame: Any) -> None:
        log.info("consume: %s: stopping", signal.Signals(signum).name)
        stop()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class ThreadedConsume:
    """The sync ``consume``: receives on the calling thread, runs handlers inline
    (``concurrency=1``) or on a pool of ``concurrency`` threads, renews leases on a thread of
    its own."""

    def __init__(self, sub: Consumable, handler: Callable[[Message], object],
                 loop: ConsumeLoop, stop: threading.Event | None) -> None:
        self.sub, self.handler, self.loop, self.stop = sub, handler, loop, stop
        self.flight = loop.flight
        self.cond = threading.Condition()
        self.pool = (ThreadPoolExecutor(loop.concurrency, thread_name_prefix="mqabstract-consume")
                     if loop.concurrency > 1 else None)
        self.ended = threading.Event()
        self.wake = threading.Event()

    def stopping(self) -> bool:
        return (self.sub._stop.is_set() or self.sub.closed
                or (self.stop is not None and self.stop.is_set()))

    def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless stopped first; True if stopped."""
        end = time.monotonic() + seconds
        while not self.stopping():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self.sub._stop.wait(min(left, 0.1))
        return True

    def run(self) -> ConsumeStats:
        renewer = None
        if self.loop.extend_by is not None:
            clock = self.sub._broker._clock
            if clock is not None:
                clock.on_advance(self.wake.set)  # a fake clock's jump is a tick
            renewer = threading.Thread(target=self._renew, name="mqabstract-extend",
                                       daemon=True)
            renewer.start()
        try:
            try:
                self._feed()
                self._finish()
            finally:
                self._wind_down()
        finally:  # even when a second Ctrl-C interrupts the grace period
            self.ended.set()
            self.wake.set()
            if renewer is not None:
                renewer.join()
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
        return self.loop.stats

    def _feed(self) -> None:
        loop, flight, cond = self.loop, self.flight, self.cond
        while not self.stopping():
            with cond:
                while not flight.wants_more() and not self.stopping():
                    cond.wait(0.1)
                if self.stopping():
                    return
                step = loop.next()
            if step is None:
                return
            pushed = PUSHED.set(True)  # middleware hears of it as a delivery
            try:
                messages = self.sub.receive(*step)
            except MQError as exc:
                if self._pause(loop.failed(exc, self.sub.closed)):
                    return
                continue
            finally:
                PUSHED.reset(pushed)
            with cond:
                loop.got(messages)
            self._start()

    def _start(self) -> None:
        """Start what may start: inline one after the other, or on the pool."""
        while not self.stopping():
            with self.cond:
                todo = self.flight.take()
            if not todo:
                return
            if self.pool is None:
                for msg in todo:
                    self._handle(msg)
                continue
            for msg in todo:
                self.pool.submit(self._handle, msg)
            return

    def _handle(self, msg: Message) -> None:
        names: Sequence[str] = ()
        with self.cond:  # queued on the pool when the stop came: never started
            back = self.flight.unstart(msg) if self.stopping() else None
            self.cond.notify_all()
        if back is not None:
            self._hand_back(back, "not started")
            return
        try:
            invalid = self.loop.invalid(msg)
            duplicate = False
            if invalid is None:
                exc: Exception | None = None
                try:
                    if self.loop.seen(msg):
                        duplicate = True
                    else:
                        self.handler(msg)
                        self.loop.processed(msg)
                except Duplicate:
                    duplicate = True
                except Exception as raised:
                    exc = raised
            with self.cond:
                if not self.flight.settle(msg):  # handed back at the end of grace
                    return
            if invalid is not None:
                names = self.loop.reject(msg, invalid)
            else:
                names = self.loop.outcome(msg, exc)
                if duplicate:
                    names = (*names, "duplicates")
        except MQError as exc:  # the broker refused the settle: the lease brings it back
            log.warning("consume: settling %s failed: %s", msg.id, exc)
        except Exception:  # a bug: logged (a pool would drop it), the lease brings it back
            log.exception("consume: handling %s failed", msg.id)
        finally:
            with self.cond:
                self.loop.count(names)
                self.flight.finish(msg)
                self.cond.notify_all()
            if self.pool is not None:
                self._start()

    def _finish(self) -> None:
        """The loop ended by itself (max_messages, idle_timeout): let all held finish."""
        with self.cond:
            while self.flight.held and not self.stopping():
                self.cond.wait(0.1)

    def _wind_down(self) -> None:
        """Stopped: hand back what never started, give running handlers ``grace`` seconds,
        then hand back theirs too."""
        with self.cond:
            waiting = self.flight.drop_waiting()
        self._hand_back(waiting, "not started")
        end = time.monotonic() + self.loop.grace
        with self.cond:
            while self.flight.busy and (left := end - time.monotonic()) > 0:
                self.cond.wait(left)
            late = self.flight.drop_running()
        self._hand_back(late, f"still running after the {self.loop.grace:g}s grace period")
        with self.cond:  # settles under way finish (bounded: a stalled broker times out)
            while self.flight.settling and time.monotonic() < end + 5.0:
                self.cond.wait(0.1)

    def _hand_back(self, messages: list[Message], why: str) -> None:
        if messages:
            log.warning("consume: handing back %d messages (%s)", len(messages), why)
            self.sub._release(messages)
            with self.cond:
                self.loop.stats.released += len(messages)

    def _renew(self) -> None:
        seconds = self.loop.extend_by
        assert seconds is not None
        now = self.sub._broker._monotonic
        stopped_at = None
        while not self.ended.is_set():
            self.wake.wait(self.loop.tick)
            self.wake.clear()
            if self.ended.is_set():
                return
            if self.stopping():  # a handler on the calling thread cannot be handed back:
                stopped_at = stopped_at or time.monotonic()  # its lease runs out instead
                if time.monotonic() - stopped_at > self.loop.grace:
                    return
            with self.cond:
                due = self.loop.due(now())
            renewed = sum(renew(msg, seconds) for msg in due)
            if renewed:
                with self.cond:
                    self.loop.stats.extended += renewed
