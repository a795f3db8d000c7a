"""asyncio API: the same brokers, methods, checks, errors and lease rule as the sync API.

    from mqabstract import aio

    async with await aio.connect("amqp://…") as mq:
        sub = await mq.subscribe("billing", "orders.#")
        await mq.publish("orders.eu.created", {"order": 42})
        async for msg in sub:
            print(msg.value)
            await msg.ack()

Every call goes through the sync portable layer (one implementation of validation,
leases, dead-lettering and drivers) on a pool of I/O threads owned by the broker, so the
event loop never waits for broker I/O. A ``receive`` waits in slices of at most
``SLICE`` seconds, which bounds how long it holds a pool thread; cancelling it is safe:
messages its last slice returns after the cancellation are handed back for redelivery at
once (as ``Subscription.close`` does), never left leased to nobody.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import math
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Sequence,
)
from datetime import datetime
from typing import Any, TypeVar

from . import connect as _connect_sync
from .batch import AsyncBatch
from .broker import Broker, Message, Subscription
from .capabilities import Capabilities
from .checks import check_count as _check_count
from .checks import check_seconds as _check_seconds
from .consuming import (
    STOP_SIGNALS,
    Backoff,
    ConsumeLoop,
    ConsumeStats,
    check_handler,
    renew,
    replying,
)
from .dedupe import DedupeStore
from .errors import Closed, Duplicate, InvalidArgument, MQError, PublishError, Timeout
from .hooks import PUSHED, Publishing
from .model import DeadLetter, Envelope, GroupSpec, GroupStats
from .outgoing import _batch_publishing, _with
from .requests import ReplyRoute

__all__ = ["AsyncBatch", "AsyncBroker", "AsyncMessage", "AsyncSubscription", "connect"]

log = logging.getLogger("mqabstract")

T = TypeVar("T")
_Got = TypeVar("_Got", bound=Sequence[Message])  # what a receive returns: a list or a Batch

#: Longest single wait of a ``receive`` on a pool thread (seconds).
SLICE = 0.5
#: Batches of concurrent publishes in flight at once (each on an I/O thread).
SENDERS = 3
#: I/O threads per broker by default: waiting receives and other calls share them.
IO_THREADS = 16


class _Runner:
    """The broker's I/O pool: runs sync calls off the event loop."""

    def __init__(self, threads: int) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                          thread_name_prefix="mqabstract-aio")

        self.shut = False

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        """On the pool; once the broker is closed (pool shut down) right here: every call
        then fails at once with ``Closed`` from the sync layer, without I/O."""
        if not self.shut:
            try:
                return self.pool.submit(fn, *args, **kwargs)
            except RuntimeError:  # shut down meanwhile
                pass
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # In the caller's context (as asyncio.to_thread): a sync middleware scope entered
        # on the pool (a reply's publish span) sees the handler's trace context.
        context = contextvars.copy_context()
        return await asyncio.wrap_future(self.submit(context.run, fn, *args, **kwargs))

    def shutdown(self) -> None:
        self.shut = True
        self.pool.shutdown(wait=False)


async def connect(url: str | None = None, *, io_threads: int = IO_THREADS,
                  **options: Any) -> AsyncBroker:
    """``mqabstract.connect`` for asyncio: the same URL rules and options."""
    _check_count(io_threads, "io_threads")
    run = _Runner(io_threads)
    try:
        broker = await run(_connect_sync, url, **options)
    except BaseException:
        run.shutdown()
        raise
    return AsyncBroker(broker, run)


class AsyncMessage:
    """A received message; settle it with ``await msg.ack()`` and friends."""

    __slots__ = ("_run", "_sub", "message")

    def __init__(self, message: Message, sub: AsyncSubscription) -> None:
        self.message = message  #: the sync message underneath (same state)
        self._sub = sub
        self._run = sub._run

    id = property(lambda self: self.message.id)
    topic = property(lambda self: self.message.topic)
    body = property(lambda self: self.message.body)
    headers = property(lambda self: self.message.headers)
    key = property(lambda self: self.message.key)
    priority = property(lambda self: self.message.priority)
    attempt = property(lambda self: self.message.attempt)
    group = property(lambda self: self.message.group)

    @property
    def value(self) -> Any:
        return self.message.value

    @property
    def published_at(self) -> datetime:
        return self.message.published_at

    @property
    def settled(self) -> bool:
        return self.message.settled

    @property
    def lease_remaining(self) -> float:
        return self.message.lease_remaining

    async def ack(self) -> None:
        """Done: remove the message for this group. A second ack is a no-op."""
        await self._run(self.message.ack)

    async def nack(self, delay: float = 0.0) -> None:
        """Give it back for redelivery after ``delay`` seconds (dead-lettered on the final
        attempt)."""
        await self._run(self.message.nack, delay)

    async def dead_letter(self, reason: str = "dead-lettered by consumer") -> None:
        await self._run(self.message.dead_letter, reason)

    async def extend(self, seconds: float) -> None:
        """Renew the lease: keep the message ours for ``seconds`` from now."""
        await self._run(self.message.extend, seconds)

    @property
    def expires_at(self) -> datetime | None:
        return self.message.expires_at

    @property
    def reply_to(self) -> str | None:
        return self.message.reply_to

    @property
    def correlation_id(self) -> str | None:
        return self.message.correlation_id

    async def reply(self, body: Any, *, headers: Mapping[str, str] | None = None) -> str:
        """``Message.reply``: answer this request (``InvalidArgument`` if it asked for none)."""
        if not self.reply_to or not self.correlation_id:
            return self.message.reply(body, headers=headers)  # raises, nothing sent
        return await self._run(self.message.reply, body, headers=headers)

    def __repr__(self) -> str:
        return f"Async{self.message!r}"


class AsyncSubscription:
    """A consumer of a group: ``receive``, ``async for``, ``consume``."""

    def __init__(self, sub: Subscription, run: _Runner) -> None:
        self.subscription = sub  #: the sync subscription underneath
        self._run = run
        self._stop = asyncio.Event()

    group = property(lambda self: self.subscription.group)
    pattern = property(lambda self: self.subscription.pattern)
    closed = property(lambda self: self.subscription.closed)

    async def receive(self, max_messages: int = 1, wait: float = 0.0) -> list[AsyncMessage]:
        """Up to ``max_messages`` messages, waiting up to ``wait`` seconds for the first;
        the sync ``receive``'s checks and lease rule. Cancellation hands back what the
        pending slice returns."""
        got = await self._sliced(self.subscription.receive, max_messages, wait)
        return [AsyncMessage(m, self) for m in got]

    async def receive_batch(self, max_messages: int = 100, wait: float = 0.0
                            ) -> AsyncBatch[AsyncMessage]:
        """``Subscription.receive_batch``: up to ``max_messages`` messages as one
        ``AsyncBatch``, waiting up to ``wait`` seconds for the first; empty when none
        arrived. Cancellation hands back what the pending slice returns."""
        got = await self._sliced(self.subscription.receive_batch, max_messages, wait)
        return AsyncBatch(got, self._run, lambda m: AsyncMessage(m, self))

    async def _sliced(self, receive: Callable[[int, float], _Got], max_messages: int,
                      wait: float) -> _Got:
        """``receive`` on the pool in slices of at most ``SLICE`` seconds until something
        arrives or ``wait`` is over (checked first, as the sync call does)."""
        sub = self.subscription
        sub._check_open()
        _check_count(max_messages, "max_messages")
        deadline = time.monotonic() + _check_seconds(wait, "wait", math.inf)
        while True:
            left = max(0.0, deadline - time.monotonic())
            future = self._run.submit(contextvars.copy_context().run, receive,
                                      max_messages, min(left, SLICE))
            try:
                got: _Got = await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                future.add_done_callback(functools.partial(_hand_back, sub))
                raise
            if got or left <= SLICE or sub.closed:
                return got

    async def ack_many(self, messages: Iterable[AsyncMessage]) -> None:
        """``Subscription.ack_many``: one driver call for many acks."""
        batch = [m.message if isinstance(m, AsyncMessage) else m for m in messages]
        await self._run(self.subscription.ack_many, batch)

    def __aiter__(self) -> AsyncIterator[AsyncMessage]:
        return self._iterate()

    async def _iterate(self, batch: int = 10) -> AsyncIterator[AsyncMessage]:
        """Messages as they come, until the subscription is closed or ``stop()`` called."""
        while not self.closed and not self._stop.is_set():
            for msg in await self.receive(batch, SLICE):
                yield msg

    async def consume(
        self,
        handler: Callable[[AsyncMessage], Awaitable[object]],
        *,
        max_messages: int | None = None,
        idle_timeout: float | None = None,
        batch: int = 10,
        wait: float = 1.0,
        backoff: Backoff | None = None,
        concurrency: int = 1,
        auto_extend: bool | None = None,
        grace: float = 30.0,
        signals: bool = False,
        dedupe: DedupeStore | None = None,
        reply: bool = False,
    ) -> ConsumeStats:
        """The sync ``consume`` with a coroutine handler, ``concurrency`` of them as tasks:
        the same settle rules, per-key order, ``auto_extend``, typed payloads and stop
        (``stop()``, or SIGTERM/SIGINT on this event loop with ``signals=True``: no more
        messages, ``grace`` seconds for running handlers, then they are cancelled and
        their messages handed back), ``dedupe`` (an idempotent consumer) and ``reply``."""
        check_handler(handler, coroutine=True)
        handler = replying(handler, reply)  # type: ignore[assignment]
        loop = ConsumeLoop(self.subscription, max_messages=max_messages,
                           idle_timeout=idle_timeout, batch=batch, wait=wait, backoff=backoff,
                           concurrency=concurrency, auto_extend=auto_extend, grace=grace,
                           dedupe=dedupe)
        if not isinstance(signals, bool):
            raise InvalidArgument(f"signals must be a bool, got {signals!r}")
        self.subscription._check_open()
        self._stop.clear()
        return await _TaskConsume(self, handler, loop).run(signals)

    def stop(self) -> None:
        """Make a running ``consume`` or ``async for`` return after its current message."""
        self._stop.set()

    async def close(self) -> None:
        """Detach; unsettled messages are handed back for redelivery at once."""
        self._stop.set()
        await self._run(self.subscription.close)

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Async{self.subscription!r}"


def _hand_back(sub: Subscription, future: concurrent.futures.Future[_Got]) -> None:
    """A cancelled receive's slice came back with messages nobody will see: release them."""
    if not future.cancelled() and future.exception() is None:
        sub._release(future.result())


class _TaskConsume:
    """The asyncio ``consume``: receives in this task, runs each handler as a task of its
    own, renews leases in another; the bookkeeping is ``consuming.ConsumeLoop``'s."""

    def __init__(self, asub: AsyncSubscription, handler: Callable[[AsyncMessage],
                 Awaitable[object]], loop: ConsumeLoop) -> None:
        self.asub, self.sub, self.handler, self.loop = asub, asub.subscription, handler, loop
        self.flight = loop.flight
        self.run_io = asub._run
        self.changed = asyncio.Event()  # a handler finished (room, or grace may be over)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.acks: list[Message] = []  # handlers returned: to ack in the next batch
        self.flusher: asyncio.Task[None] | None = None
        self.chain = self.sub._broker._chain

    def stopping(self) -> bool:
        return self.asub._stop.is_set() or self.sub.closed

    async def _changes(self, timeout: float = 0.1) -> None:
        """Until a handler finishes (or ``timeout``: the stop flag is polled)."""
        self.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)

    async def run(self, signals: bool) -> ConsumeStats:
        events = asyncio.get_running_loop()
        installed = []
        renewer = None
        try:
            if signals:
                for sig in STOP_SIGNALS:
                    try:
                        events.add_signal_handler(sig, self.asub.stop)
                    except (NotImplementedError, RuntimeError) as exc:
                        raise InvalidArgument(f"signals=True: {exc}") from None
                    installed.append(sig)
            if self.loop.extend_by is not None:
                renewer = asyncio.create_task(self._renew())
            await self._feed()
            while self.flight.held and not self.stopping():  # ended by itself: finish all
                await self._changes()
        finally:
            try:
                await self._wind_down()
            finally:  # even when the grace period is cancelled
                if renewer is not None:
                    renewer.cancel()
                for sig in installed:
                    events.remove_signal_handler(sig)
        return self.loop.stats

    async def _feed(self) -> None:
        loop, asub = self.loop, self.asub
        while not self.stopping():
            if not self.flight.wants_more():
                await self._changes()
                continue
            step = loop.next()
            if step is None:
                return
            # One slice at a time, never cancelled: a stop is seen within SLICE seconds,
            # and what a receive took is held (and handed back by the stop if need be).
            want, wait = step
            error: MQError | None = None
            pushed = PUSHED.set(True)  # middleware hears of it as a delivery
            try:
                got = await asub.receive(want, min(wait, SLICE))
            except MQError as exc:
                error = exc
            finally:
                PUSHED.reset(pushed)
            if error is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asub._stop.wait(),
                                           loop.failed(error, self.sub.closed))
                continue
            loop.got([m.message for m in got])
            self._start()

    def _start(self) -> None:
        if self.stopping():
            return
        for msg in self.flight.take():
            self.tasks[id(msg)] = asyncio.create_task(self._handle(msg))

    async def _store(self, call: Callable[[Message], T], msg: Message) -> T:
        """A dedupe store call: on the I/O thread when the store does I/O (SQLite)."""
        store = self.loop.dedupe
        if store is not None and store.blocking:
            return await self.run_io(call, msg)
        return call(msg)

    async def _handle(self, msg: Message) -> None:
        names: Sequence[str] = ()
        later = False
        try:
            invalid = self.loop.invalid(msg)
            exc: Exception | None = None
            if invalid is None:
                try:
                    if await self._store(self.loop.seen, msg):
                        raise Duplicate(msg.id)
                    if self.chain.handlers:
                        await self.chain.ahandle(
                            msg, lambda: self.handler(AsyncMessage(msg, self.asub)))
                    else:
                        await self.handler(AsyncMessage(msg, self.asub))
                    await self._store(self.loop.processed, msg)
                except Duplicate:
                    self.loop.count(("duplicates",))
                except Exception as raised:
                    exc = raised
            if not self.flight.settle(msg):
                return
            if invalid is not None:
                names = await self.run_io(self.loop.reject, msg, invalid)
                return
            if exc is None and not msg.settled:  # the common case: acked with others
                self.acks.append(msg)
                later = True
                if self.flusher is None:
                    self.flusher = asyncio.create_task(self._flush())
                return
            names = await self.run_io(self.loop.outcome, msg, exc)
        except MQError as exc:  # the broker refused the settle: the lease brings it back
            log.warning("consume: settling %s failed: %s", msg.id, exc)
        except Exception:  # a bug: logged, the lease brings the message back
            log.exception("consume: handling %s failed", msg.id)
        finally:
            self.tasks.pop(id(msg), None)
            if later:
                self._start()  # its slot is free while the ack is on its way
            else:
                self._done(msg, names)

    def _handling(self) -> bool:
        """A handler is running (not yet returned)."""
        flight = self.flight
        return len(flight.running) > len(flight.settling)

    def _done(self, msg: Message, names: Sequence[str]) -> None:
        self.loop.count(names)
        self.flight.finish(msg)
        self.changed.set()
        self._start()

    async def _flush(self) -> None:
        """Ack the messages whose handlers returned, many per I/O call (one thread hop for
        all that finished meanwhile, instead of one each); the next handlers already run."""
        try:
            for _ in range(self.loop.batch):  # let handlers about to return join this batch
                if len(self.acks) >= self.loop.batch or not self._handling():
                    break
                await asyncio.sleep(0)
            while self.acks:
                batch, self.acks = self.acks, []
                try:
                    await self.run_io(self.sub.ack_many, batch)
                except MQError as exc:  # LeaseExpired names the late ones; others were acked
                    log.warning("consume: acking %d messages: %s", len(batch), exc)
                finally:  # (unacked ones come back with their lease)
                    for msg in batch:
                        state = msg._state
                        self._done(msg, ("acked",) if state == "acked" else
                                   ("expired",) if state == "expired" else ())
        finally:
            self.flusher = None

    async def _wind_down(self) -> None:
        flight, loop = self.flight, self.loop
        await self._hand_back(flight.drop_waiting(), "not started")
        end = time.monotonic() + loop.grace
        while flight.busy and (left := end - time.monotonic()) > 0:
            await self._changes(min(left, 0.1))
        late = flight.drop_running()
        for msg in late:
            task = self.tasks.get(id(msg))
            if task is not None:
                task.cancel()
        await self._hand_back(late, f"still running after the {loop.grace:g}s grace period")
        pending = [*self.tasks.values(), *([self.flusher] if self.flusher else [])]
        if pending:  # settles under way, and the cancelled handlers
            await asyncio.wait(pending, timeout=5.0)

    async def _hand_back(self, messages: list[Message], why: str) -> None:
        if messages:
            log.warning("consume: handing back %d messages (%s)", len(messages), why)
            await self.run_io(self.sub._release, messages)
            self.loop.stats.released += len(messages)

    async def _renew(self) -> None:
        seconds = self.loop.extend_by
        assert seconds is not None
        now = self.sub._broker._monotonic
        wake = asyncio.Event()
        clock = self.sub._broker._clock
        if clock is not None:  # a fake clock's jump is a tick
            events = asyncio.get_running_loop()

            def poke() -> None:  # stays registered: harmless once this loop is gone
                with contextlib.suppress(RuntimeError):
                    events.call_soon_threadsafe(wake.set)

            clock.on_advance(poke)
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), self.loop.tick)
            wake.clear()
            for msg in self.loop.due(now()):
                if await self.run_io(renew, msg, seconds):
                    self.loop.stats.extended += 1


def _resolve(done: asyncio.Future[str], msg_id: str, failure: BaseException | None) -> None:
    if done.done():  # the publisher was cancelled
        return
    if failure is None:
        done.set_result(msg_id)
    else:
        done.set_exception(failure)


class AsyncBroker:
    """``Broker`` for asyncio: the same methods as coroutines."""

    def __init__(self, broker: Broker, run: _Runner) -> None:
        self.broker = broker  #: the sync broker underneath
        self._requests: concurrent.futures.ThreadPoolExecutor | None = None
        self._run = run
        self._outbox: list[tuple[Envelope, asyncio.Future[str]]] = []
        self._senders = 0  # tasks sending queued publishes (at most SENDERS)
        self._tasks: set[asyncio.Task[None]] = set()  # (referenced while they run)
        self._busy = False  # a lone publish is in flight (others queue for the senders)

    url = property(lambda self: self.broker.url)
    backend = property(lambda self: self.broker.backend)
    closed = property(lambda self: self.broker.closed)

    @property
    def capabilities(self) -> Capabilities:
        return self.broker.capabilities

    async def publish(
        self,
        topic: str,
        body: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        deliver_at: datetime | None = None,
        id: str | None = None,
        ttl: float | None = None,
    ) -> str:
        """``Broker.publish``: confirmed by the broker when it returns; the message id.

        Checked and encoded here (a typed error before anything is sent); then publishes
        awaited at the same time go out together, as one driver call (confirms pipelined,
        as ``publish_batch`` does), and each caller learns its own message's outcome. A
        cancelled publish may still be sent: it was handed over to the broker already.
        """
        broker = self.broker
        broker._check_open()
        chain = broker._chain
        if chain.publishers:
            pub = Publishing(broker.backend, topic if isinstance(topic, str) else None, 1)

            async def send() -> list[str]:
                return [await self._publish(
                    topic, body, _with(pub.headers, headers), key, priority, delay,
                    deliver_at, id, ttl)]

            return (await chain.apublish(pub, send))[0]
        return await self._publish(topic, body, headers, key, priority, delay, deliver_at, id,
                                   ttl)

    async def _publish(self, topic: str, body: Any, headers: Mapping[str, str] | None,
                       key: str | None, priority: int | None, delay: float | None,
                       deliver_at: datetime | None, id: str | None,
                       ttl: float | None = None) -> str:
        broker = self.broker
        env = broker._packer.envelope(topic, body, headers, key, priority, delay, deliver_at,
                                      id, broker._now(), ttl)
        if not (self._busy or self._senders):  # alone: at once; others queue behind it
            self._busy = True
            try:
                await self._run(broker._send_envelopes, (env,))
            except PublishError as err:
                raise err.failed.get(0, err) from None
            finally:
                self._busy = False
            return env.id
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._outbox.append((env, done))
        if self._senders < SENDERS:
            self._senders += 1
            self._tasks.add(task := asyncio.create_task(self._send()))
            task.add_done_callback(self._tasks.discard)
        return await done

    async def _send(self) -> None:
        """Send what the publishes queued, many per I/O call, until nothing is queued (up
        to ``SENDERS`` of these run at once: the next batch need not wait for the last
        one's confirms)."""
        batch: list[tuple[Envelope, asyncio.Future[str]]] = []
        try:
            await asyncio.sleep(0)  # publishers awaited together join this batch
            while self._outbox:
                step = self.broker.capabilities.max_batch
                batch, self._outbox = self._outbox[:step], self._outbox[step:]
                try:
                    await self._run(self.broker._send_envelopes, [env for env, _ in batch])
                except PublishError as err:  # some confirmed, some not: each gets its own
                    for index, (env, done) in enumerate(batch):
                        failure = err.failed.get(index)
                        _resolve(done, env.id, failure)
                    continue
                except Exception as exc:
                    failure = exc if isinstance(exc, MQError) else MQError(str(exc))
                    for env, done in batch:
                        _resolve(done, env.id, failure)
                    continue
                for env, done in batch:
                    _resolve(done, env.id, None)
        except BaseException:  # cancelled (the loop is closing): nobody may wait forever
            gone = Closed("the publish was cancelled with its event loop")
            for env, done in [*batch, *self._outbox]:
                _resolve(done, env.id, gone)
            self._outbox = []
            raise
        finally:
            self._senders -= 1

    async def publish_batch(self, messages: Iterable[Any]) -> list[str]:
        """``Broker.publish_batch`` (middleware scopes entered on this task)."""
        broker = self.broker
        items = list(messages)
        if not broker._chain.publishers:
            return await self._run(broker.publish_batch, items)
        broker._check_open()
        pub = _batch_publishing(broker.backend, items)
        return await broker._chain.apublish(
            pub, lambda: self._run(broker._publish_batch, items, pub.headers))

    async def publish_columns(
        self, topic: str, bodies: Sequence[Any], *, ids: Sequence[str] | None = None,
        keys: Sequence[str | None] | None = None, headers: Mapping[str, str] | None = None,
        row_headers: Sequence[Mapping[str, str] | None] | None = None,
    ) -> list[str]:
        """``Broker.publish_columns`` (middleware scopes entered on this task)."""
        broker = self.broker
        if not broker._chain.publishers:
            return await self._run(broker.publish_columns, topic, bodies, ids=ids, keys=keys,
                                   headers=headers, row_headers=row_headers)
        broker._check_open()
        pub = Publishing(broker.backend, topic if isinstance(topic, str) else None,
                         len(bodies) if isinstance(bodies, Sequence) else 0)
        return await broker._chain.apublish(pub, lambda: self._run(
            broker._publish_columns, topic, bodies, ids, keys, _with(pub.headers, headers),
            row_headers))

    async def declare(self, group: str, pattern: str, **options: Any) -> GroupSpec:
        """``Broker.declare``: create the durable group (idempotent)."""
        return await self._run(self.broker.declare, group, pattern, **options)

    async def subscribe(self, group: str, pattern: str, **options: Any) -> AsyncSubscription:
        """``Broker.subscribe``: declare the group and attach a consumer."""
        sub = await self._run(self.broker.subscribe, group, pattern, **options)
        return AsyncSubscription(sub, self._run)

    async def dead_letters(self, group: str, limit: int = 100) -> list[DeadLetter]:
        return await self._run(self.broker.dead_letters, group, limit)

    async def replay_dead_letters(self, group: str, ids: Collection[str] | None = None) -> int:
        return await self._run(self.broker.replay_dead_letters, group, ids)

    async def purge_dead_letters(self, group: str, ids: Collection[str] | None = None) -> int:
        return await self._run(self.broker.purge_dead_letters, group, ids)

    async def ping(self) -> float:
        """``Broker.ping``: one round trip to the broker; the seconds it took."""
        return await self._run(self.broker.ping)

    async def stats(self, group: str) -> GroupStats:
        return await self._run(self.broker.stats, group)

    async def groups(self) -> list[str]:
        return await self._run(self.broker.groups)

    async def delete_group(self, group: str) -> None:
        await self._run(self.broker.delete_group, group)

    async def request(self, topic: str, body: Any, *, timeout: float = 30.0,
                      headers: Mapping[str, str] | None = None, key: str | None = None,
                      priority: int | None = None) -> AsyncMessage:
        """``Broker.request``: the reply (already acked), or ``Timeout``.

        The request waits on a future: one reader thread (on a pool of its own, not the I/O
        pool, so a slow responder holds up no other call) serves every request waiting at
        once. A cancelled request stops waiting at once; a reply that still comes is
        dropped."""
        broker = self.broker
        broker._check_open()
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Message] = loop.create_future()

        def settle(reply: Message | MQError) -> None:
            if answer.done():  # cancelled or timed out meanwhile
                return
            if isinstance(reply, MQError):  # the route closed
                answer.set_exception(reply)
            else:
                answer.set_result(reply)

        def arrived(reply: Message | MQError) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, reply)

        if self._requests is None:
            self._requests = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="mqabstract-replies")
        spawn = self._requests.submit
        lock = threading.Lock()
        waiting: list[tuple[ReplyRoute, str]] = []
        ended = False

        def start() -> float:
            """One hop on the I/O pool: check, open the route, expect the reply, send."""
            route, seconds, send = broker._request_route(topic, body, timeout, headers, key,
                                                         priority)
            correlation = route.expect(arrived, spawn)
            with lock:
                if ended:  # the caller was cancelled meanwhile: nothing is sent
                    route.forget(correlation)
                    return seconds
                waiting.append((route, correlation))
            send(correlation)
            return seconds

        try:
            seconds = await self._run(start)
            try:
                reply = await asyncio.wait_for(answer, seconds)
            except asyncio.TimeoutError:
                which = waiting[0][1] if waiting else "?"
                raise Timeout(f"no reply within {seconds:g}s (request {which})") from None
        finally:
            with lock:
                ended = True
                for route, correlation in waiting:
                    route.forget(correlation)
        sub = reply._sub  # the reply route's (a Message names it only as its Source)
        assert isinstance(sub, Subscription)
        return AsyncMessage(reply, AsyncSubscription(sub, self._run))

    async def close(self) -> None:
        """Close the broker (its subscriptions first), then the I/O pool."""
        try:
            await self._run(self.broker.close)
        finally:
            self._run.shutdown()
            if self._requests is not None:
                self._requests.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncBroker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Async{self.broker!r}"


