"""RabbitMQ backend (``amqp://`` / ``amqps://``), built on pika.

Mapping (details and trade-offs in ``docs/backends/rabbitmq.md``):

* one durable topic exchange (option ``exchange``, default ``mqabstract``); routing key =
  topic. A group is a durable queue ``<exchange>.g.<group>`` bound with its pattern;
  consumers of a group compete on that queue. Quorum queues by default (exact redelivery
  counts), classic queues with ``x-max-priority`` for ``priority=True`` groups, and
  ``x-single-active-consumer`` for ``ordered=True`` groups.
* Publishing runs from the calling thread on a blocking connection of its own, with
  confirms tracked by delivery tag, so a batch is pipelined: one round trip, not one per
  message. Each subscription consumes on a ``SelectConnection`` of its own; all of them
  run on one I/O thread, which other threads reach through ``add_callback_threadsafe``.
* Redelivery (nack, lease expiry), delays and dead letters are "copy, confirm, then ack the
  original": the copy carries the attempt count in ``mq-attempt``, so counts are exact on
  every queue type; broker-side redelivery (a consumer's connection died) adds
  ``x-delivery-count`` (quorum) or the ``redelivered`` flag (classic: such a message is
  re-sent with its attempt written down before anyone gets it, so the next broker-side
  redelivery counts on from there). Copies go out on the subscription's own connection:
  when it dies, neither the copy nor the ack of its original went out.
* Delays use one wait queue per delay tier (queue TTL, dead-lettered to the exchange for a
  delayed publish, or to the group queue for ``nack(delay)``). A message that comes out of
  a tier before its ``mq-deliver-at`` is sent to the next tier by the consumer that sees
  it, so nothing is ever delivered early.
* Leases are kept by the driver: an unsettled message is copied back with attempt + 1 when
  its lease runs out. A dead consumer's messages are redelivered by the broker; a frozen
  one's (SIGSTOP, GC or VM stall) are taken back by a watchdog process that cuts its
  subscription connection half a second after the earliest lease deadline it holds, so
  they are deliverable again within ``RELEASE_MARGIN`` of that deadline.
* Declarations, dead-letter list/replay/purge and stats use a second, blocking connection.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import heapq
import itertools
import logging
import math
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pika
import pika.exceptions as pex
from pika import spec as amqp
from pika.adapters.select_connection import IOLoop

from mqabstract import wire
from mqabstract.capabilities import Capabilities, Feature, Support
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    MQError,
    NotFound,
    PublishError,
)
from mqabstract.model import DeadLetter, Delivery, Envelope, GroupSpec, GroupStats, utc
from mqabstract.options import Option, parse_options
from mqabstract.url import BrokerURL, redact

__all__ = ["RabbitMQDriver"]

log = logging.getLogger("mqabstract.rabbitmq")

# Delay tiers in milliseconds: a message waits in the largest tier not longer than what is
# left of its delay (the smallest tier when less is left), then is re-tiered if still early.
TIERS_MS = (
    10, 25, 50, 100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000,
    300_000, 600_000, 1_800_000, 3_600_000, 7_200_000, 21_600_000, 43_200_000, 86_400_000,
    259_200_000, 604_800_000, 2_592_000_000,
)
# Headers RabbitMQ adds; never shown to users and stripped from our copies.
_BROKER_HEADERS = frozenset({
    "x-death", "x-delivery-count", "x-first-death-exchange", "x-first-death-queue",
    "x-first-death-reason", "x-last-death-exchange", "x-last-death-queue",
    "x-last-death-reason",
})
# The wire schema (mqabstract/wire.py); H_ATTEMPT counts deliveries so far.
H_TOPIC, H_KEY, H_ATTEMPT = wire.TOPIC, wire.KEY, wire.ATTEMPT
H_PUBLISHED, H_DUE = wire.PUBLISHED_AT, wire.DELIVER_AT
H_REASON, H_DEAD_AT = wire.REASON, wire.DEAD_AT
CONTENT_TYPE = "content-type"
_MAX_NAME = 255  # AMQP short string
_TICK = 0.05  # lease / idle check period, seconds
_CONN_ERRORS = (
    pex.AMQPConnectionError, pex.ConnectionClosed, pex.StreamLostError,
    pex.ConnectionWrongStateError, pex.ChannelWrongStateError, OSError,
)


def _queue_name(*parts: str) -> str:
    """Join name parts; hash the tail when longer than AMQP's 255-byte limit."""
    name = ".".join(parts)
    if len(name.encode()) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    return name[: _MAX_NAME - 34] + "~" + digest


def _tier_for(seconds: float) -> int:
    """The largest tier (ms) not longer than ``seconds`` (the smallest if none is)."""
    ms = seconds * 1000.0
    best = TIERS_MS[0]
    for tier in TIERS_MS:
        if tier <= ms:
            best = tier
        else:
            break
    return best


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


# ----------------------------------------------------------------------------------------
# publishing primitives


@dataclass(slots=True)
class _Item:
    """One basic.publish: where, what, and whether "unroutable" is a failure."""

    exchange: str
    routing_key: str
    body: bytes
    props: pika.BasicProperties
    must_route: bool = False


class _Pending:
    """Confirmation state of one group of publishes; ``done`` runs once all are settled."""

    __slots__ = ("acked", "event", "failed", "left", "lock", "lost", "on_done", "returned")

    def __init__(self, n: int, on_done: Callable[[_Pending], None] | None = None) -> None:
        self.left = n
        self.acked: list[int] = []
        self.failed: dict[int, str] = {}
        self.lost: list[int] = []
        self.returned: list[int] = []
        self.event = threading.Event()
        self.on_done = on_done
        self.lock = threading.Lock()
        if n == 0:
            self._finish()

    def settle(self, j: int, outcome: str, why: str = "") -> None:
        with self.lock:
            if outcome == "ack":
                self.acked.append(j)
            elif outcome == "returned":
                self.returned.append(j)
            elif outcome == "lost":
                self.lost.append(j)
            else:
                self.failed[j] = why
            self.left -= 1
            finished = self.left == 0
        if finished:
            self._finish()

    def _finish(self) -> None:
        self.event.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # never let a callback kill the I/O loop
                log.exception("publish completion callback failed")


class _Confirms:
    """Publisher-confirm bookkeeping for one confirm-mode channel: delivery tag → (pending,
    index), and basic.return matching for publishes where "unroutable" is a failure."""

    def __init__(self) -> None:
        self.out: OrderedDict[int, tuple[_Pending, int, tuple[str, str, str] | None]] = (
            OrderedDict()
        )
        self.tag = 0
        self._returns: dict[tuple[str, str, str], deque[int]] = {}
        self._returned: set[int] = set()

    def reset(self) -> None:
        """A new channel: tags restart at 1; whatever was unconfirmed is lost."""
        out, self.out = self.out, OrderedDict()
        self.tag = 0
        self._returns.clear()
        self._returned.clear()
        for pend, j, _key in out.values():
            pend.settle(j, "lost")

    def send(self, publish: Callable[..., Any], items: Sequence[_Item], pend: _Pending,
             usable: Callable[[], bool]) -> None:
        """Publish ``items`` with ``publish``; an error on the wire marks the rest lost."""
        for j, item in enumerate(items):
            if not usable():
                pend.settle(j, "lost")
                continue
            # Register the tag first: a blocking publish may read its own ack while flushing.
            self.tag += 1
            tag = self.tag
            key = None
            if item.must_route:
                key = (item.exchange, item.routing_key, item.props.message_id or "")
                self._returns.setdefault(key, deque()).append(tag)
            self.out[tag] = (pend, j, key)
            try:
                publish(item.exchange, item.routing_key, item.body, item.props,
                        mandatory=item.must_route)
            except Exception as exc:  # channel/connection went away under us
                log.debug("publish failed on the wire: %s", exc)
                if self.out.pop(tag, None) is not None:
                    pend.settle(j, "lost")
                if key is not None and key in self._returns:
                    with contextlib.suppress(ValueError):
                        self._returns[key].remove(tag)

    def on_confirm(self, frame: Any) -> None:
        method = frame.method
        ok = isinstance(method, amqp.Basic.Ack)
        tag = method.delivery_tag
        settled: list[tuple[int, tuple[_Pending, int, Any]]] = []
        if method.multiple:
            while self.out:
                first = next(iter(self.out))
                if first > tag:
                    break
                settled.append(self.out.popitem(last=False))
        elif tag in self.out:
            settled.append((tag, self.out.pop(tag)))
        for t, (pend, j, key) in settled:
            if key is not None:
                waiting = self._returns.get(key)
                if waiting is not None:
                    with contextlib.suppress(ValueError):
                        waiting.remove(t)
                    if not waiting:
                        del self._returns[key]
            if t in self._returned:
                self._returned.discard(t)
                pend.settle(j, "returned")
            elif ok:
                pend.settle(j, "ack")
            else:
                pend.settle(j, "nack", "the broker refused the message (basic.nack)")

    def on_return(self, _ch: Any, method: Any, props: Any, _body: bytes) -> None:
        key = (method.exchange, method.routing_key, props.message_id or "")
        waiting = self._returns.get(key)
        if waiting:
            self._returned.add(waiting.popleft())
            if not waiting:
                del self._returns[key]


def _noop() -> None:
    return None


def _merge(result: _Pending, pend: _Pending, todo: list[int]) -> list[int]:
    """Fold one attempt's outcome into ``result``; return the indexes to send again."""
    with pend.lock:
        for j in pend.acked:
            result.settle(todo[j], "ack")
        for j in pend.returned:
            result.settle(todo[j], "returned")
        for j, why in pend.failed.items():
            result.settle(todo[j], "nack", why)
        return [todo[j] for j in sorted(pend.lost)]


class _Publisher:
    """Publishes from the calling thread on a BlockingConnection of its own, so a single
    publish costs what raw pika's does (no hop to the I/O thread). Confirms are pipelined:
    confirm mode is switched on at the pika channel implementation (``_impl``), so
    BlockingChannel does not wait per message; acks arrive through ``process_data_events``.
    One caller at a time; a lost connection is re-opened and the unconfirmed re-sent."""

    def __init__(self, params: list[pika.ConnectionParameters], where: str) -> None:
        self.params = params
        self.where = where
        self.lock = threading.Lock()
        self.conn: pika.BlockingConnection | None = None
        self.ch: Any = None
        self.confirms = _Confirms()
        self.last_error = ""
        self._rr = 0

    def _open(self) -> None:
        params = self.params[self._rr % len(self.params)]
        self._rr += 1
        conn = pika.BlockingConnection(params)
        try:
            ch = conn.channel()
            ready: list[Any] = []
            self.confirms.reset()
            ch._impl.add_on_return_callback(self.confirms.on_return)
            ch._impl.confirm_delivery(self.confirms.on_confirm, callback=ready.append)
            limit = time.monotonic() + max(1.0, params.socket_timeout or 10.0)
            while not ready:
                if time.monotonic() >= limit:
                    raise pex.AMQPConnectionError("no answer to confirm.select")
                conn.process_data_events(time_limit=0.01)  # waits out its whole limit
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        self.conn, self.ch = conn, ch

    def _drop(self, exc: BaseException) -> None:
        self.last_error = redact(_describe(exc))
        conn, self.conn, self.ch = self.conn, None, None
        self.confirms.reset()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _usable(self) -> bool:
        return self.ch is not None and self.ch.is_open

    def _publish_fn(self, count: int) -> Callable[..., None]:
        """Buffer all but the last publish at the channel implementation; BlockingChannel's
        publish of the last one flushes them to the socket together."""
        ch = self.ch
        calls = itertools.count(1)

        def publish(exchange: str, routing_key: str, body: bytes, props: Any,
                    mandatory: bool = False) -> None:
            if next(calls) >= count:
                ch.basic_publish(exchange, routing_key, body, props, mandatory)
            else:
                ch._impl.basic_publish(exchange, routing_key, body, props, mandatory)

        return publish

    def _wait(self, pend: _Pending, deadline: float) -> None:
        """Process I/O until every confirm of ``pend`` arrived or ``deadline`` passed.

        Uses the loop BlockingChannel itself waits for a confirm with (``_flush_output``),
        plus a timer at the deadline so the poll cannot outlast it. ``process_data_events``
        would not do: impl-level confirm callbacks are not events it returns on."""
        conn = self.conn
        assert conn is not None
        ioloop = conn._impl.ioloop
        try:
            timer = ioloop.call_later(max(0.0, deadline - time.monotonic()), _noop)
        except ValueError as exc:  # pika closed the loop: the connection dropped mid-send
            raise pex.StreamLostError("connection lost before confirms arrived") from exc
        try:
            conn._flush_output(lambda: pend.left == 0 or time.monotonic() >= deadline)
        finally:
            with contextlib.suppress(ValueError):
                ioloop.remove_timeout(timer)

    def publish(self, items: Sequence[_Item], timeout: float) -> _Pending:
        """Publish and wait for confirms, re-sending across reconnects until ``timeout``."""
        deadline = time.monotonic() + timeout
        result = _Pending(len(items))
        todo = list(range(len(items)))
        failures = 0
        with self.lock:
            while todo and time.monotonic() < deadline:
                pend = _Pending(len(todo))
                try:
                    if self.conn is None or not self.conn.is_open or not self._usable():
                        self._open()
                except (*_CONN_ERRORS, pex.AMQPError) as exc:
                    self._drop(exc)
                    failures += 1
                    time.sleep(min(2.0, 0.05 * 2 ** min(failures, 6),
                                   max(0.0, deadline - time.monotonic())))
                    continue
                try:
                    batch = [items[i] for i in todo]
                    self.confirms.send(self._publish_fn(len(batch)), batch, pend,
                                       self._usable)
                    self._wait(pend, deadline)
                except (*_CONN_ERRORS, pex.AMQPError) as exc:
                    self._drop(exc)  # settles everything unconfirmed as lost
                if pend.left > 0:
                    break  # out of time with confirms outstanding
                todo = _merge(result, pend, todo)
        return result

    def close(self) -> None:
        with self.lock:
            conn, self.conn, self.ch = self.conn, None, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()


# ----------------------------------------------------------------------------------------
# the lease watchdog

# RabbitMQ 3.10 keeps an unacked message with its consumer until the consumer's channel or
# connection closes, and our leases are timers in the driver's I/O thread: a process that
# is frozen (SIGSTOP, a long GC or VM stall) keeps its messages until the AMQP heartbeat
# timeout (2-3 heartbeats after its last byte), however short the lease. A heartbeat
# derived from the lease cannot fix that: the broker counts from the moment of the freeze,
# not from the receive, so a holder frozen early would lose its messages before the
# deadline and one frozen late would keep them up to 3 heartbeats after it.
#
# Instead every process that consumes has one small watchdog process (stdlib only, its
# own session, so a stop signal for the application's process group does not reach it).
# Each subscription has a connection of its own, passes the watchdog a duplicate of its
# socket and keeps it told when it would release something by itself: its earliest lease
# deadline (reported by the receive or settle that changes it, under the subscription's
# lock), or, while it consumes holding no lease, now + _WATCH_LIVE (reported by the I/O
# thread's tick). When that time + _WATCH_GRACE passes without a newer report (the tick
# releases expired leases every _TICK), the watchdog shuts the socket down: the broker sees
# the connection close and requeues what it held. A woken process checks whether its
# socket was cut before it hands out anything it had buffered or settles anything (see
# ``_Sub._sync_locked``): pika may run a few callbacks before it reads the closed socket.
# The watchdog exits when the application's process does (a pipe reaches end of file).

_WATCH_GRACE = 0.5  # seconds past a reported deadline before the watchdog cuts the socket
_WATCH_LIVE = 1.0  # a consumer holding no lease reports now + this (its buffer's release)
_WATCH_STEP = 0.2  # later release times closer than this to the reported one wait a tick
_WATCH_SLACK = 0.25  # how late the watchdog may act on a report (its scheduling), seconds
_NO_SIGPIPE = getattr(socket, "MSG_NOSIGNAL", 0) | getattr(socket, "MSG_DONTWAIT", 0)
#: what the driver declares as Capabilities.release_margin with the watchdog: the grace,
#: plus the broker noticing the closed socket and requeueing (measured: under 0.2 s on a
#: busy 2-core machine), plus headroom for a loaded host scheduling the watchdog late
RELEASE_MARGIN = 1.5

_WATCHDOG_SRC = r"""
import os, select, socket, sys, time
ctl = socket.socket(fileno=int(sys.argv[1]))
ctl.setblocking(False)
life = int(sys.argv[2])
grace = float(sys.argv[3])
watched = {}
def drop(key, cut):
    entry = watched.pop(key, None)
    if entry is None:
        return
    if cut:
        try:
            entry[0].shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    entry[0].close()
while True:
    now = time.monotonic()
    for key, (_s, due) in list(watched.items()):
        if now >= due + grace:
            drop(key, True)
    wait = min((due + grace - now for _s, due in watched.values()), default=None)
    if wait is not None:
        wait = min(max(0.0, wait), 3600.0)
    try:
        ready = select.select([ctl, life], [], [], wait)[0]
    except InterruptedError:
        continue
    if life in ready and not os.read(life, 64):
        break
    if ctl in ready:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(ctl, 4096, 8)
            except (BlockingIOError, InterruptedError):
                break
            fds = list(fds)
            for line in data.decode("ascii", "replace").splitlines():
                words = line.split()
                if not words:
                    continue
                if words[0] == "W" and fds:
                    drop(words[1], False)
                    watched[words[1]] = [socket.socket(fileno=fds.pop(0)), float(words[2])]
                elif words[0] == "D" and words[1] in watched:
                    watched[words[1]][1] = float(words[2])
                elif words[0] == "X":
                    drop(words[1], False)
            for fd in fds:
                os.close(fd)
"""


def _socket_cut(sock: Any) -> bool:
    """Whether our side of ``sock`` can no longer send: the watchdog shut it down (or the
    connection died). A zero-byte send on a duplicate descriptor: nothing goes out, and it
    works the same under TLS."""
    try:
        fd = sock.fileno()
        probe = socket.socket(fileno=os.dup(fd)) if fd >= 0 else None
    except OSError:
        return True
    if probe is None:
        return True
    try:
        probe.send(b"", _NO_SIGPIPE)
        return False
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    finally:
        probe.close()


class _Watchdog:
    """This process's watchdog (see above): spawned on first use, again after a fork or
    if it died. Sends never block: a report that cannot be sent now is sent on the next
    tick. Every method may be called from any thread."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _current: ClassVar[_Watchdog | None] = None
    _failed: ClassVar[bool] = False
    keys: ClassVar[Iterator[int]] = itertools.count(1)

    @staticmethod
    def available() -> bool:
        """Whether this platform can run the watchdog (Unix sockets passing descriptors)."""
        return bool(hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")
                    and os.name == "posix" and sys.executable)

    @classmethod
    def get(cls) -> _Watchdog | None:
        """The running watchdog, spawning it if needed; None if it cannot run."""
        with cls._lock:
            dog = cls._current
            if dog is not None and dog.alive:
                return dog
            if cls._failed or not cls.available():
                return None
            if dog is not None:
                dog.close()
            try:
                cls._current = dog = cls()
            except Exception as exc:
                cls._failed = True
                log.warning("rabbitmq: cannot start the lease watchdog (%s); frozen consumers "
                            "keep their messages until the heartbeat timeout", exc)
                return None
            return dog

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        life_r, life_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG_SRC, str(child.fileno()),
                 str(life_r), repr(_WATCH_GRACE)],
                pass_fds=(child.fileno(), life_r), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        except BaseException:
            parent.close()
            os.close(life_w)
            raise
        finally:
            child.close()
            os.close(life_r)
        parent.setblocking(False)
        self.ctl = parent
        self.life = life_w
        self.pid = os.getpid()
        self.alive = True

    def send(self, text: str, fd: int | None = None) -> bool:
        """Send one report; False if it could not go out now."""
        if not self.alive or self.pid != os.getpid():
            return False
        data = text.encode("ascii")
        try:
            if fd is None:
                self.ctl.send(data)
            else:
                socket.send_fds(self.ctl, [data], [fd])
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:  # the watchdog is gone: the next get() starts another
            log.warning("rabbitmq: the lease watchdog stopped (%s); restarting it", exc)
            self.alive = False
            return False

    def close(self) -> None:
        self.alive = False
        if self.pid != os.getpid():
            return
        with contextlib.suppress(OSError):
            os.close(self.life)
        self.ctl.close()
        with contextlib.suppress(Exception):
            self.proc.wait(1.0)

    @classmethod
    def _after_fork(cls) -> None:
        """In a forked child: let go of the parent's watchdog (it watches the parent)."""
        dog, cls._current = cls._current, None
        cls._lock = threading.Lock()
        if dog is not None:
            dog.alive = False
            dog.proc.returncode = 0  # not this process's child: never wait for it here
            with contextlib.suppress(OSError):
                os.close(dog.life)
            dog.ctl.close()

    @classmethod
    def _at_exit(cls) -> None:
        dog, cls._current = cls._current, None
        if dog is not None:
            dog.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Watchdog._after_fork)
atexit.register(_Watchdog._at_exit)


# ----------------------------------------------------------------------------------------
# the I/O thread


class _Link:
    """The I/O thread: a pika IOLoop that runs every subscription's own ``SelectConnection``
    and a lease tick. Everything touching those pika objects runs on this thread; other
    threads hand it work with ``call``."""

    def __init__(self, params: list[pika.ConnectionParameters], where: str) -> None:
        self.params = params
        self.where = where
        self.ioloop = IOLoop()
        self.closing = False
        self.subs: set[_Sub] = set()
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mqabstract-rabbitmq-io",
                                        daemon=True)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        self._thread.start()
        if not self._running.wait(timeout):
            self.stop()
            raise ConnectionFailed(f"rabbitmq at {self.where}: the I/O thread did not start "
                                   f"within {timeout:g}s")

    def _run(self) -> None:
        self.ioloop.call_later(_TICK, self._tick)
        self.ioloop.add_callback_threadsafe(self._running.set)
        try:
            self.ioloop.start()
        finally:
            with contextlib.suppress(Exception):
                self.ioloop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """End the I/O thread (idempotent); subscriptions close their connections first."""
        if self.closing and not self._thread.is_alive():
            return
        self.closing = True
        if self._thread.is_alive():
            self.call(self.ioloop.stop)
            self._thread.join(timeout)

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread (from any thread)."""
        self.ioloop.add_callback_threadsafe(fn)

    # -- periodic work ---------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        for sub in list(self.subs):
            try:
                sub._io_tick(now)
            except Exception:
                log.exception("rabbitmq lease tick failed")
        if not self.closing:
            self.ioloop.call_later(_TICK, self._tick)


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


# ----------------------------------------------------------------------------------------
# consumer side


class _Raw:
    """A message as the broker delivered it to our channel, before the user saw it."""

    __slots__ = ("body", "gen", "props", "redelivered", "routing_key", "tag")

    def __init__(self, gen: int, tag: int, redelivered: bool, routing_key: str,
                 props: Any, body: bytes) -> None:
        self.gen = gen
        self.tag = tag
        self.redelivered = redelivered
        self.routing_key = routing_key
        self.props = props
        self.body = body

    def attempt(self) -> int:
        headers = self.props.headers or {}
        base = int(_text(headers.get(H_ATTEMPT, 0))) + 1  # deliveries so far + this one
        count = headers.get("x-delivery-count")
        if count is not None:
            return base + int(count)
        return base + (1 if self.redelivered else 0)

    def due(self) -> float | None:
        headers = self.props.headers
        if headers and H_DUE in headers:
            return float(_text(headers[H_DUE]))
        return None


class _Receipt:
    """A leased message: our handle to settle it; stale once ``done`` (settled, expired, or
    its channel closed and the broker delivers it again)."""

    __slots__ = ("attempt", "deadline", "done", "extended", "raw")

    def __init__(self, raw: _Raw, attempt: int, deadline: float) -> None:
        self.raw = raw
        self.attempt = attempt
        self.deadline = deadline
        self.done = False
        self.extended = False


def _copy_props(props: Any, **headers: str | None) -> pika.BasicProperties:
    """The message's properties for a copy: broker headers stripped, ``headers`` applied
    (None removes one)."""
    new = dict(props.headers or {})
    for name in _BROKER_HEADERS:
        new.pop(name, None)
    for name, value in headers.items():
        name = name.replace("_", "-")
        if value is None:
            new.pop(name, None)
        else:
            new[name] = value
    return pika.BasicProperties(
        content_type=props.content_type,
        content_encoding=props.content_encoding,
        headers=new,
        delivery_mode=2,
        priority=props.priority,
        correlation_id=props.correlation_id,
        reply_to=props.reply_to,
        message_id=props.message_id or uuid.uuid4().hex,
        timestamp=props.timestamp,
        type=props.type,
        app_id=props.app_id,
    )


class _Sub(DriverSubscription):
    """One consumer on a group queue: a connection and channel of its own (closing it
    hands back exactly this subscription's messages), a local buffer ordered by priority,
    driver-kept leases that the lease watchdog backs up when this process freezes. Started
    lazily on the first ``receive`` and stopped (its unread buffer handed back) when nobody
    has called ``receive`` for a while, so an idle consumer never sits on messages that
    another one could take."""

    def __init__(self, driver: RabbitMQDriver, spec: GroupSpec) -> None:
        self._driver = driver
        self._link = driver._link
        self.spec = spec
        self.queue = driver._group_queue(spec.name)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._buf: list[tuple[int, int, _Raw]] = []  # (-priority, seq, raw)
        self._seq = itertools.count()
        self._leases: deque[_Receipt] = deque()
        self._extended: list[tuple[float, int, _Receipt]] = []
        self._acks: list[tuple[int, int]] = []
        self._want = False  # a consumer should be running
        self._conn: Any = None  # this subscription's SelectConnection, when there is one
        self._failures = 0
        self._retry: Any = None  # reconnect timer
        self._close_done: threading.Event | None = None
        self._lost_why = ""
        self._ch: Any = None
        self._ch_gen = 0
        self._ctag: str | None = None
        self._cancelling = False
        self._closed = False
        self._receiving = 0
        self._last_receive = time.monotonic()
        self._idle = min(1.0, max(0.2, spec.lease / 2))
        self._error: MQError | None = None
        # Copies of delivered messages whose original is not yet acked: while there are
        # any, the watchdog must not cut the connection (the broker would redeliver the
        # original with the same attempt as its copy).
        self._inflight = 0
        self._dog: _Watchdog | None = None
        self._dog_key: str | None = None
        self._dog_sent = math.nan  # the last release time reported to the watchdog
        self._sock: Any = None  # the watched socket
        self._cut_sock: Any = None  # a socket found cut, until its connection is replaced
        self._cut_gen = 0  # deliveries of channels up to this one are gone
        self._risk = math.nan  # until when the watchdog may (have) cut our socket
        self._pub_ch: Any = None  # confirm channel for the copies, on our own connection
        self._confirms = _Confirms()
        self._link.subs.add(self)

    # -- the watchdog (any thread; the ``_locked`` ones with self._lock held) --------------
    def _due_locked(self, now: float) -> tuple[float, bool]:
        """When this subscription would release something by itself if it were running, and
        whether that is a lease deadline: its earliest lease deadline; while it consumes (or
        buffers) holding no lease, now + _WATCH_LIVE; never while a copy of a delivered
        message is in flight."""
        if self._inflight > 0:
            return math.inf, False
        leases = self._leases
        while leases and (leases[0].done or leases[0].extended):
            leases.popleft()
        ext = self._extended
        while ext and (ext[0][2].done or ext[0][2].deadline != ext[0][0]):
            heapq.heappop(ext)
        due = leases[0].deadline if leases else math.inf
        if ext:
            due = min(due, ext[0][0])
        if due < math.inf:
            return due, True
        if self._want or self._buf or self._receiving:
            return now + _WATCH_LIVE, False
        return math.inf, False

    def _note_risk_locked(self, now: float) -> None:
        """Remember it when the reported release time + grace is (nearly) reached: the
        watchdog may cut the socket then, whatever we report next."""
        if self._dog_key is not None and now >= self._dog_sent + _WATCH_GRACE - _WATCH_STEP:
            until = self._dog_sent + _WATCH_GRACE + _WATCH_SLACK
            if not until <= self._risk:  # (also when _risk is nan)
                self._risk = until

    def _report_locked(self, now: float) -> None:
        dog, key = self._dog, self._dog_key
        if dog is None or key is None:
            return
        due, lease = self._due_locked(now)
        sent = self._dog_sent
        if due == sent or sent < due < sent + _WATCH_STEP:
            return  # a little later than reported: still after every deadline it guards
        if due < sent < math.inf and not lease:
            # Earlier, but not a lease deadline: the buffer of a consumer that holds no lease
            # may wait for the reported time (no later than a lease it just held). Saves two
            # reports per receive batch (a context switch each).
            return
        self._note_risk_locked(now)
        if dog.send(f"D {key} {due!r}"):
            self._dog_sent = due

    def _sync_locked(self) -> None:
        """Before handing out or settling anything: if the watchdog may have cut our socket
        (this process was frozen past a reported release time + grace), check the socket;
        if it was cut, drop what came on it now (pika may run other callbacks before it
        reads the closed socket), so nothing the broker took back is handed out again."""
        now = time.monotonic()
        self._note_risk_locked(now)
        if self._risk != self._risk:  # nan: no risk
            return
        if self._sock is not None and _socket_cut(self._sock):
            log.warning("rabbitmq consumer of group %r was frozen past its lease deadline: "
                        "the watchdog handed its messages back to the broker", self.spec.name)
            self._lost_why = "frozen past the lease deadline; the watchdog closed it"
            self._cut_sock = self._sock
            self._cut_gen = self._ch_gen
            self._dog = self._dog_key = None
            self._dog_sent = self._risk = math.nan
            self._forget_locked()
        elif now > self._risk:
            self._risk = math.nan

    def _io_watch(self) -> None:
        """(I/O thread) give the watchdog this connection's socket (again after a restart)."""
        conn = self._conn
        sock = getattr(getattr(conn, "_transport", None), "_sock", None)
        if conn is None or not conn.is_open or sock is None:
            return
        dog = _Watchdog.get()
        if dog is None:
            return
        key = str(next(_Watchdog.keys))
        with self._lock:
            if sock is self._cut_sock:
                return
            due = self._due_locked(time.monotonic())[0]
            if dog.send(f"W {key} {due!r}", sock.fileno()):
                self._dog, self._dog_key, self._dog_sent = dog, key, due
                self._sock, self._risk = sock, math.nan

    def _io_unwatch(self) -> None:
        with self._lock:
            dog, key = self._dog, self._dog_key
            self._dog = self._dog_key = None
            self._sock = self._cut_sock = None
            self._dog_sent = self._risk = math.nan
        if dog is not None and key is not None:
            dog.send(f"X {key}")

    def _release_done(self, count: int) -> None:
        with self._cond:
            self._inflight -= count
            self._report_locked(time.monotonic())
            self._cond.notify_all()

    # -- I/O thread ------------------------------------------------------------------------
    def _io_start(self) -> None:
        if self._closed:
            return
        self._want = True
        if self._cancelling:
            return  # restarted when the cancel completes
        conn = self._conn
        if conn is None:
            if self._retry is None:
                self._io_connect()
            return
        if not conn.is_open:
            return  # _io_conn_open continues
        if self._ch is None:
            self._ch = "opening"
            conn.channel(on_open_callback=self._io_channel_open)
        elif self._ch != "opening" and self._ctag is None:
            self._io_consume()

    def _io_connect(self) -> None:
        self._retry = None
        if self._closed or self._link.closing or self._conn is not None:
            return
        params = self._link.params[self._failures % len(self._link.params)]
        try:
            self._conn = pika.SelectConnection(
                params,
                on_open_callback=self._io_conn_open,
                on_open_error_callback=self._io_conn_failed,
                on_close_callback=self._io_conn_closed,
                custom_ioloop=self._link.ioloop,
            )
        except Exception as exc:
            self._lost_why = redact(_describe(exc))
            self._io_reconnect_later()

    def _io_reconnect_later(self) -> None:
        if self._closed or self._link.closing:
            return
        self._failures += 1
        pause = min(5.0, 0.1 * 2 ** min(self._failures, 6))
        self._retry = self._link.ioloop.call_later(pause, self._io_reconnect)

    def _io_reconnect(self) -> None:
        self._retry = None
        if self._want and not self._closed:
            self._io_connect()

    def _io_conn_open(self, conn: Any) -> None:
        if conn is not self._conn:
            return
        self._failures = 0
        if self._closed:
            with contextlib.suppress(Exception):
                conn.close()
            return
        self._io_watch()
        # Copies go out on this connection, so a copy whose original cannot be acked (the
        # connection died) was not sent either.
        conn.channel(on_open_callback=self._io_pub_open)
        if self._want:
            self._io_start()

    def _io_pub_open(self, ch: Any) -> None:
        if self._closed or self._conn is None or not self._conn.is_open:
            with contextlib.suppress(Exception):
                ch.close()
            return
        ch.add_on_close_callback(self._io_pub_closed)
        self._confirms.reset()
        ch.add_on_return_callback(self._confirms.on_return)
        ch.confirm_delivery(self._confirms.on_confirm,
                            callback=lambda _frame: setattr(self, "_pub_ch", ch))

    def _io_pub_closed(self, ch: Any, reason: BaseException) -> None:
        if self._pub_ch is ch or self._pub_ch is None:
            self._pub_ch = None
            self._confirms.reset()
        conn = self._conn
        if not self._closed and conn is not None and conn.is_open:
            log.warning("rabbitmq copy channel closed (%s); reopening",
                        redact(_describe(reason)))
            conn.channel(on_open_callback=self._io_pub_open)

    def _io_send(self, items: Sequence[_Item], pend: _Pending) -> None:
        """Publish ``items`` on our confirm channel; ``pend`` learns each one's fate."""
        ch = self._pub_ch
        self._confirms.send(
            ch.basic_publish if ch is not None else None, items, pend,
            lambda: self._pub_ch is ch and ch is not None and ch.is_open,
        )

    def _io_conn_failed(self, conn: Any, err: BaseException) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._lost_why = redact(_describe(err))
        log.warning("rabbitmq consumer of group %r cannot connect to %s (%s); retrying",
                    self.spec.name, self._link.where, self._lost_why)
        self._io_reconnect_later()

    def _io_conn_closed(self, conn: Any, reason: BaseException) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._lost_why = redact(_describe(reason))
        self._io_lost()
        self._io_unwatch()
        if self._closed:
            if self._close_done is not None:
                self._close_done.set()
            return
        log.warning("rabbitmq consumer connection of group %r to %s lost (%s); reconnecting",
                    self.spec.name, self._link.where, self._lost_why)
        self._io_reconnect_later()

    def _io_channel_open(self, ch: Any) -> None:
        if self._closed:
            ch.close()
            return
        self._ch = ch
        self._ch_gen = next(_CHANNEL_GEN)
        ch.add_on_close_callback(self._io_channel_closed)
        ch.basic_qos(prefetch_count=self._driver._prefetch)
        if self._want:
            self._io_consume()

    def _io_consume(self) -> None:
        ch = self._ch
        gen = self._ch_gen

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            raw = _Raw(gen, method.delivery_tag, method.redelivered, method.routing_key,
                       props, body)
            with self._cond:
                if gen <= self._cut_gen:
                    return  # read after the watchdog cut the socket: the broker has it
                heapq.heappush(self._buf, (-(props.priority or 0), next(self._seq), raw))
                self._cond.notify()

        self._ctag = ch.basic_consume(self.queue, on_message)

    def _io_channel_closed(self, ch: Any, reason: BaseException) -> None:
        if ch is not self._ch:
            return
        self._ch = None
        self._ctag = None
        self._cancelling = False
        self._lost_why = redact(_describe(reason))
        self._io_forget()
        if self._closed:
            return
        code = getattr(reason, "reply_code", 0)
        if code == 404:
            self._set_error(NotFound(f"group {self.spec.name!r} does not exist (its queue "
                                     "was deleted)"))
        elif code not in (0, 200, 320) and self._want:
            log.warning("rabbitmq consumer channel closed: %s", self._lost_why)
            self._link.ioloop.call_later(0.5, self._io_start)

    def _io_lost(self) -> None:
        self._ch = None
        self._ctag = None
        self._cancelling = False
        self._pub_ch = None
        self._confirms.reset()
        self._io_forget()

    def _io_forget(self) -> None:
        with self._cond:
            self._forget_locked()

    def _forget_locked(self) -> None:
        """The channel is gone: the broker redelivers everything it had given us, so the
        receipts are stale (settling one is a no-op, as after a lease expiry)."""
        self._buf.clear()
        for receipt in self._leases:
            receipt.done = True
        for _deadline, _seq, receipt in self._extended:
            receipt.done = True
        self._leases.clear()
        self._extended.clear()
        self._acks.clear()
        self._report_locked(time.monotonic())
        self._cond.notify_all()

    def _set_error(self, err: MQError) -> None:
        with self._cond:
            self._error = err
            self._cond.notify_all()

    def _usable_ch(self) -> Any:
        ch = self._ch
        conn = self._conn
        if (ch is None or ch == "opening" or not ch.is_open or conn is None
                or not conn.is_open):
            return None
        return ch

    def _io_flush_acks(self) -> None:
        with self._lock:
            acks, self._acks = self._acks, []
        ch = self._usable_ch()
        if ch is None:
            return
        gen = self._ch_gen
        try:
            for tag in sorted(tag for g, tag in acks if g == gen):
                ch.basic_ack(tag)
        except (*_CONN_ERRORS, pex.AMQPError) as exc:  # closing under us: redelivered anyway
            log.debug("rabbitmq: acks not sent: %s", exc)

    def _io_ack_raw(self, raws: Sequence[_Raw]) -> None:
        ch = self._usable_ch()
        if ch is None:
            return
        try:
            for raw in raws:
                if raw.gen == self._ch_gen:
                    ch.basic_ack(raw.tag)
        except (*_CONN_ERRORS, pex.AMQPError) as exc:
            log.debug("rabbitmq: acks not sent: %s", exc)

    def _io_requeue_raw(self, raws: Sequence[_Raw]) -> None:
        ch = self._usable_ch()
        if ch is None:
            return
        try:
            for raw in raws:
                if raw.gen == self._ch_gen:
                    ch.basic_nack(raw.tag, requeue=True)
        except (*_CONN_ERRORS, pex.AMQPError) as exc:
            log.debug("rabbitmq: requeue not sent: %s", exc)

    def _io_copy_then_ack(self, copies: list[tuple[_Raw, _Item]],
                          then: Callable[[], None] | None = None) -> None:
        """Publish each copy; ack its original once confirmed (requeue it if refused)."""
        if not copies:
            if then is not None:
                then()
            return

        def done(pend: _Pending) -> None:
            try:
                good = set(pend.acked) | set(pend.returned)
                self._io_ack_raw([copies[j][0] for j in sorted(good)])
                self._io_requeue_raw([copies[j][0] for j in range(len(copies))
                                      if j not in good])
            finally:
                if then is not None:
                    then()

        self._io_send([c[1] for c in copies], _Pending(len(copies), done))

    def _io_tick(self, now: float) -> None:
        expired: list[_Receipt] = []
        with self._lock:
            leases = self._leases
            while leases and (leases[0].done or leases[0].extended
                              or leases[0].deadline <= now):
                receipt = leases.popleft()
                if not receipt.done and not receipt.extended:
                    receipt.done = True
                    expired.append(receipt)
            ext = self._extended
            while ext and (ext[0][2].done or ext[0][0] <= now):
                deadline, _, receipt = heapq.heappop(ext)
                if not receipt.done and receipt.deadline == deadline:
                    receipt.done = True
                    expired.append(receipt)
            idle = (self._ctag is not None and not self._cancelling and self._receiving == 0
                    and now - self._last_receive > self._idle)
            self._inflight += len(expired)
            self._report_locked(now)
            watch = self._dog is None or not self._dog.alive
        if watch and self._conn is not None and self._conn.is_open:
            self._io_watch()
        if expired:
            self._io_copy_then_ack(
                [(r.raw, self._driver._retry_item(r.raw, self.queue, r.attempt + 1, 0.0))
                 for r in expired],
                lambda: self._release_done(len(expired)),
            )
        if idle:
            self._io_pause()

    def _io_pause(self, then: Callable[[], None] | None = None) -> None:
        """Stop consuming and hand the unread buffer back to the queue."""
        ch, ctag = self._ch, self._ctag
        self._want = False
        if ch is None or ch == "opening" or ctag is None or not ch.is_open:
            if then is not None:
                then()
            return
        self._cancelling = True

        def cancelled(_frame: Any) -> None:
            self._ctag = None
            self._cancelling = False
            with self._lock:
                buf, self._buf = self._buf, []
            raws = [raw for _, _, raw in sorted(buf) if raw.gen == self._ch_gen]

            def after() -> None:
                if self._want and not self._closed:
                    self._io_start()
                if then is not None:
                    then()

            self._io_copy_then_ack(
                [(raw, self._driver._retry_item(raw, self.queue, raw.attempt(), None))
                 for raw in raws],
                after,
            )

        ch.basic_cancel(ctag, callback=cancelled)

    def _io_close(self, done: threading.Event) -> None:
        def finish() -> None:
            self._io_flush_acks()
            self._want = False
            self._link.subs.discard(self)
            self._io_unwatch()
            if self._retry is not None:
                with contextlib.suppress(Exception):
                    self._link.ioloop.remove_timeout(self._retry)
                self._retry = None
            conn = self._conn
            if conn is not None and (conn.is_open or conn.is_opening):
                self._close_done = done
                try:
                    conn.close()  # pending acks go out first; _io_conn_closed sets done
                    return
                except Exception as exc:
                    log.debug("rabbitmq: closing a consumer connection: %s", exc)
            done.set()

        if self._cancelling:
            self._link.ioloop.call_later(0.05, lambda: self._io_close(done))
            return
        self._io_pause(finish)

    # -- caller threads --------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise Closed(f"subscription to group {self.spec.name!r} is closed")
        if self._error is not None:
            raise self._error
        self._driver._check()

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        self._check()
        # The lease starts with this call (the portable layer's deadline is no later).
        started = time.monotonic()
        lease_until = started + self.spec.lease
        if not self._want or self._ch is None:
            self._want = True
            self._link.call(self._io_start)
        deadline = started + timeout
        out: list[Delivery] = []
        while True:
            again: list[tuple[_Raw, float | None]] = []
            with self._cond:
                self._receiving += 1
                try:
                    self._sync_locked()
                    while not self._buf and self._error is None and not self._closed:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if self._error is not None:
                        raise self._error
                    if self._buf:
                        self._sync_locked()
                        # Hand nothing out while a copy is in flight (the watchdog is
                        # held off then): a holder frozen right after this receive must
                        # be cut at its lease deadline. One round trip, rarely.
                        settled = time.monotonic() + 1.0
                        while self._inflight > 0 and not self._closed:
                            left = settled - time.monotonic()
                            if left <= 0:
                                break
                            self._cond.wait(left)
                    now = time.time()
                    while self._buf and len(out) < max_messages:
                        raw = heapq.heappop(self._buf)[2]
                        if raw.gen != self._ch_gen or raw.gen <= self._cut_gen:
                            continue  # from a channel that is gone: it comes back anyway
                        due = raw.due()
                        if due is not None and due > now:
                            again.append((raw, due))
                            continue
                        headers = raw.props.headers or {}
                        if raw.redelivered and "x-delivery-count" not in headers:
                            # A classic queue redelivered it (its consumer's channel died)
                            # and only says "at least once more": re-send it with that
                            # attempt written down first, so the next redelivery counts
                            # on from there instead of repeating this attempt.
                            again.append((raw, None))
                            continue
                        attempt = raw.attempt()
                        receipt = _Receipt(raw, attempt, lease_until)
                        self._leases.append(receipt)
                        out.append(self._driver._delivery(raw, attempt, receipt))
                    self._inflight += len(again)
                    if out or again:
                        self._report_locked(time.monotonic())
                finally:
                    self._receiving -= 1
                    self._last_receive = time.monotonic()
            if again:
                self._recopy(again)
            if out or self._closed or deadline - time.monotonic() <= 0:
                return out

    def _recopy(self, items: list[tuple[_Raw, float | None]]) -> None:
        """Send messages back to the queue instead of delivering them: early ones (out of
        their wait tier too soon) to the next tier, classic redeliveries with their
        attempt written down."""
        copies = []
        try:
            for raw, due in items:
                copies.append((raw, self._driver._retry_item(raw, self.queue, raw.attempt(),
                                                             due)))
        finally:
            count = len(items)
            self._link.call(lambda: self._io_copy_then_ack(
                copies, lambda: self._release_done(count)))

    def _take(self, receipt: Any) -> _Receipt | None:
        """Mark a receipt settled; None when it is stale (its lease expired)."""
        if not isinstance(receipt, _Receipt):
            raise InvalidArgument("not a receipt of this backend")
        with self._lock:
            self._sync_locked()
            if receipt.done:
                return None
            receipt.done = True
            self._inflight += 1
            self._report_locked(time.monotonic())
            return receipt

    def ack(self, receipts: Sequence[Any]) -> None:
        self._check()
        with self._lock:
            self._sync_locked()
            first = not self._acks
            for receipt in receipts:
                if isinstance(receipt, _Receipt) and not receipt.done:
                    receipt.done = True
                    self._acks.append((receipt.raw.gen, receipt.raw.tag))
            schedule = first and bool(self._acks)
            self._report_locked(time.monotonic())
        if schedule:
            self._link.call(self._io_flush_acks)

    def _settle_by_copy(self, receipt: _Receipt, item: _Item, returned_ok: bool) -> _Pending:
        """Publish ``item`` for a taken receipt; once it is confirmed (or returned, if
        ``returned_ok``) ack the original. Ends the in-flight count ``_take`` started (on the
        I/O thread once the ack is written)."""
        raw = receipt.raw
        try:
            pend = self._driver._pub.publish([item], self._driver._publish_timeout)
        except BaseException:
            self._release_done(1)
            raise
        if pend.acked or (returned_ok and pend.returned):

            def ack_original() -> None:
                try:
                    self._io_ack_raw([raw])
                finally:
                    self._release_done(1)

            self._link.call(ack_original)
            return pend
        self._release_done(1)
        return pend

    def nack(self, receipt: Any, delay: float) -> None:
        self._check()
        taken = self._take(receipt)
        if taken is None:
            return
        due = time.time() + delay if delay > 0 else None
        try:
            item = self._driver._retry_item(taken.raw, self.queue, taken.attempt + 1, due)
        except BaseException:
            self._release_done(1)
            raise
        # returned: the group queue is gone, nothing to keep
        pend = self._settle_by_copy(taken, item, returned_ok=True)
        if pend.acked or pend.returned:
            return
        if pend.failed:
            raise MQError(f"rabbitmq: {next(iter(pend.failed.values()))}")
        raise ConnectionFailed(f"rabbitmq at {self._driver._where}: not confirmed in time "
                               f"({self._driver._pub.last_error or 'connection lost'})")

    def extend(self, receipt: Any, seconds: float) -> None:
        self._check()
        if not isinstance(receipt, _Receipt):
            raise InvalidArgument("not a receipt of this backend")
        with self._lock:
            self._sync_locked()
            if receipt.done:
                return
            receipt.extended = True
            receipt.deadline = time.monotonic() + seconds
            heapq.heappush(self._extended, (receipt.deadline, next(self._seq), receipt))
            self._report_locked(time.monotonic())

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        self._check()
        taken = self._take(receipt)
        if taken is None:
            return
        raw = taken.raw
        try:
            props = _copy_props(
                raw.props,
                **{H_TOPIC: self._driver._topic_of(raw), H_REASON: reason,
                   H_ATTEMPT: str(attempts), H_DEAD_AT: repr(time.time()), H_DUE: None},
            )
            item = _Item("", self._driver._dead_queue(self.spec.name), raw.body, props, True)
        except BaseException:
            self._release_done(1)
            raise
        pend = self._settle_by_copy(taken, item, returned_ok=False)
        if pend.returned:
            raise NotFound(f"dead-letter queue of group {self.spec.name!r} is missing")
        if pend.acked:
            return
        if pend.failed:
            raise MQError(f"rabbitmq: {next(iter(pend.failed.values()))}")
        raise ConnectionFailed(f"rabbitmq at {self._driver._where}: dead letter not confirmed "
                               f"({self._driver._pub.last_error or 'connection lost'})")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        done = threading.Event()
        if self._link._thread.is_alive() and not self._link.closing:
            self._link.call(lambda: self._io_close(done))
            done.wait(self._driver._publish_timeout)
        self._link.subs.discard(self)


_CHANNEL_GEN = itertools.count(1)


# ----------------------------------------------------------------------------------------
# blocking admin connection


class _Admin:
    """A BlockingConnection for declarations and queue inspection, one caller at a time."""

    def __init__(self, params: list[pika.ConnectionParameters], where: str) -> None:
        self.params = params
        self.where = where
        self.lock = threading.RLock()
        self.conn: pika.BlockingConnection | None = None
        self._ch: Any = None

    def connect(self) -> None:
        try:
            self.conn = pika.BlockingConnection(self.params)
        except Exception as exc:
            raise ConnectionFailed(
                f"cannot connect to RabbitMQ at {self.where}: {redact(_describe(exc))}"
            ) from exc
        self._ch = None

    @property
    def ch(self) -> Any:
        if self.conn is None or not self.conn.is_open:
            self.connect()
        if self._ch is None or not self._ch.is_open:
            assert self.conn is not None
            self._ch = self.conn.channel()
        return self._ch

    def reset_channel(self) -> None:
        self._ch = None

    def run(self, fn: Callable[[_Admin], Any], what: str) -> Any:
        with self.lock:
            for attempt in (1, 2):
                try:
                    return fn(self)
                except pex.ChannelClosedByBroker as exc:
                    self._ch = None
                    raise _channel_error(exc, what) from exc
                except _CONN_ERRORS as exc:
                    self.close()
                    if attempt == 2:
                        raise ConnectionFailed(
                            f"rabbitmq at {self.where}: {what} failed: {redact(_describe(exc))}"
                        ) from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        conn, self.conn, self._ch = self.conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


def _channel_error(exc: pex.ChannelClosedByBroker, what: str) -> MQError:
    text = redact(f"{what}: ({exc.reply_code}) {exc.reply_text}")
    if exc.reply_code == 404:
        return NotFound(text)
    if exc.reply_code == 406:
        return InvalidArgument(text)
    return MQError(f"rabbitmq: {text}")


# ----------------------------------------------------------------------------------------
# the driver


def _release_margin(heartbeat: int) -> float:
    """Capabilities.release_margin: with the lease watchdog, RELEASE_MARGIN; without it (no
    Unix sockets passing descriptors, e.g. Windows) the broker's heartbeat timeout, which
    ends 2-3 heartbeats after the frozen holder's last byte (and never, with heartbeats off)."""
    if _Watchdog.available():
        return RELEASE_MARGIN
    return 3.0 * heartbeat + 1.0 if heartbeat > 0 else math.inf


def _rabbitmq_capabilities(max_body: int, release_margin: float) -> Capabilities:
    """What the driver declares; the body limit and, where the lease watchdog cannot run,
    the release margin (from the heartbeat) depend on options."""
    f = Feature
    return Capabilities(
        features={
            f.WILDCARDS: Support.NATIVE,
            f.FANOUT: Support.NATIVE,
            f.COMPETING: Support.NATIVE,
            f.LEASE_EXTEND: Support.EMULATED,
            f.NACK_DELAY: Support.EMULATED,
            f.DELAY: Support.EMULATED,
            f.PRIORITY: Support.NATIVE,
            f.ORDERING: Support.NATIVE,
            f.DEAD_LETTER: Support.EMULATED,
            f.BATCH: Support.NATIVE,
        },
        max_body_bytes=max_body,
        max_headers=64,
        max_header_bytes=16 * 1024,
        max_delay=365 * 86400.0,
        max_batch=1000,
        max_priority=9,
        max_lease=12 * 3600.0,
        min_lease=0.5,  # leases are timers in the driver's I/O thread
        release_margin=release_margin,  # the lease watchdog (or the heartbeat timeout)
        max_receive=1000,
        notes={
            f.LEASE_EXTEND: "leases are kept by the driver (RabbitMQ has no visibility "
                            "timeout): an expired message is copied back with attempt+1; "
                            "a watchdog process takes them back from a frozen consumer",
            f.NACK_DELAY: "per-tier wait queues with TTL dead-lettering to the group",
            f.DELAY: "per-tier wait queues with TTL dead-lettering to the exchange; "
                     "re-tiered until due, never early",
            f.PRIORITY: "groups declared priority=True use classic queues with "
                        "x-max-priority (no quorum replication, redelivery counted "
                        "from the redelivered flag); other groups are FIFO quorum queues",
            f.ORDERING: "groups declared ordered=True use x-single-active-consumer",
            f.DEAD_LETTER: "a classic dead-letter queue per group, filled by the driver",
            f.BATCH: "publisher confirms pipelined on one channel",
        },
    )


class RabbitMQDriver(Driver):
    """RabbitMQ through pika: topic exchange, a queue per group, emulated leases/delays."""

    name: ClassVar[str] = "rabbitmq"

    OPTIONS: ClassVar[dict[str, Option]] = {
        "exchange": Option(str, "mqabstract", "topic exchange; also the prefix of queue names"),
        "prefetch": Option(int, 100, "unacked messages the broker may push to one consumer"),
        "queue_type": Option(str, "auto", "auto (quorum, classic for priority groups), "
                             "quorum or classic"),
        "heartbeat": Option(int, 30, "AMQP heartbeat, seconds"),
        "connect_timeout": Option(float, 10.0, "seconds to establish a connection"),
        "publish_timeout": Option(float, 30.0, "seconds a publish may wait for confirms, "
                                  "reconnects included"),
        "max_body_bytes": Option(int, 128 * 1024 * 1024 - 64 * 1024,
                                 "largest body accepted (RabbitMQ's max_message_size minus "
                                 "room for properties)"),
        "verify": Option(bool, True, "amqps: verify the server certificate"),
        "ca_file": Option(str, None, "amqps: CA bundle to verify the server with"),
    }
    CAPABILITIES = _rabbitmq_capabilities(OPTIONS["max_body_bytes"].default,
                                          _release_margin(OPTIONS["heartbeat"].default))

    def __init__(self, url: BrokerURL, opts: Mapping[str, Any]) -> None:
        self._url = url
        self._where = url.redacted()
        self._exchange: str = opts["exchange"]
        self._prefetch: int = opts["prefetch"]
        self._queue_type: str = opts["queue_type"]
        self._publish_timeout: float = opts["publish_timeout"]
        self._closed = False
        self._declared: set[tuple[str, str]] = set()
        self._tiers: set[tuple[str, int]] = set()
        params = self._params(url, opts)
        # The blocking connections only talk when called, so they cannot answer heartbeats
        # while idle: they run without, and a dead one is found (and re-opened) on next use.
        quiet = [copy.copy(p) for p in params]
        for p in quiet:
            p.heartbeat = 0
        self._admin = _Admin(quiet, self._where)
        self._link = _Link(params, self._where)
        self._pub = _Publisher(quiet, self._where)
        self._caps = _rabbitmq_capabilities(opts["max_body_bytes"],
                                            _release_margin(opts["heartbeat"]))

    # -- opening ---------------------------------------------------------------------------
    @staticmethod
    def _params(url: BrokerURL, opts: Mapping[str, Any]) -> list[pika.ConnectionParameters]:
        hosts = url.hosts or (("127.0.0.1", None),)
        tls = url.scheme == "amqps"
        ssl_options = None
        if tls:
            context = ssl.create_default_context(cafile=opts["ca_file"])
            if not opts["verify"]:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
        vhost = url.path or "/"
        creds = pika.PlainCredentials(url.username or "guest", url.password or "guest")
        timeout = opts["connect_timeout"]
        out = []
        for host, port in hosts:
            if tls:
                ssl_options = pika.SSLOptions(context, host)
            out.append(pika.ConnectionParameters(
                host=host, port=port or (5671 if tls else 5672), virtual_host=vhost,
                credentials=creds, heartbeat=opts["heartbeat"], ssl_options=ssl_options,
                connection_attempts=1, socket_timeout=timeout, stack_timeout=timeout,
                blocked_connection_timeout=opts["publish_timeout"],
                client_properties={"connection_name": "mqabstract"},
            ))
        return out

    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> RabbitMQDriver:
        opts = parse_options(url, options, cls.OPTIONS, cls.name)
        if opts["queue_type"] not in ("auto", "quorum", "classic"):
            raise InvalidArgument("queue_type must be auto, quorum or classic")
        if opts["prefetch"] < 1:
            raise InvalidArgument("prefetch must be ≥ 1")
        if not opts["exchange"] or len(opts["exchange"]) > 100:
            raise InvalidArgument("exchange must be 1-100 characters")
        for name in ("connect_timeout", "publish_timeout"):
            if not 0 < opts[name] < 1e6:  # also rejects nan; pika needs a positive timeout
                raise InvalidArgument(f"{name} must be > 0 and < 1e6 seconds")
        if not 0 <= opts["heartbeat"] <= 65535:
            raise InvalidArgument("heartbeat must be 0 (off) to 65535 seconds")
        driver = cls(url, opts)
        driver._admin.run(
            lambda a: a.ch.exchange_declare(driver._exchange, "topic", durable=True),
            "declaring the exchange",
        )
        try:
            driver._link.start(opts["connect_timeout"])
        except BaseException:
            driver._admin.close()
            raise
        try:
            driver._pub._open()  # no other thread knows the driver yet: no lock needed
        except Exception as exc:
            driver.close()
            raise ConnectionFailed(f"cannot connect to RabbitMQ at {driver._where}: "
                                   f"{redact(_describe(exc))}") from exc
        return driver

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _check(self) -> None:
        if self._closed:
            raise Closed(f"broker {self._where} is closed")

    # -- naming ----------------------------------------------------------------------------
    def _group_queue(self, group: str) -> str:
        return _queue_name(self._exchange, "g", group)

    def _dead_queue(self, group: str) -> str:
        return _queue_name(self._exchange, "dlq", group)

    def _tier_name(self, family: str, ms: int) -> str:
        return _queue_name(self._exchange, "wait", family, str(ms))

    def _queue_args(self, spec: GroupSpec) -> dict[str, Any]:
        kind = self._queue_type
        if kind == "auto":
            kind = "classic" if spec.priority else "quorum"
        args: dict[str, Any] = {}
        if kind == "quorum":
            args["x-queue-type"] = "quorum"
        else:
            args["x-max-priority"] = 9
        if spec.ordered:
            args["x-single-active-consumer"] = True
        return args

    # -- message mapping -------------------------------------------------------------------
    def _props(self, env: Envelope, due: float | None) -> pika.BasicProperties:
        headers: dict[str, Any] = {}
        content_type = None
        for name, value in env.headers.items():
            if name == CONTENT_TYPE:
                content_type = value
            else:
                headers[name] = value
        # No mq-topic here: the routing key is the topic until the driver copies the
        # message to a queue by name, and the copy then records it.
        headers[H_PUBLISHED] = repr(env.published_at)
        if env.key is not None:
            headers[H_KEY] = env.key
        if due is not None:
            headers[H_DUE] = repr(due)
        return pika.BasicProperties(
            content_type=content_type,
            headers=headers,
            delivery_mode=2,
            priority=env.priority,
            message_id=env.id,
            timestamp=int(env.published_at),
        )

    def _topic_of(self, raw: _Raw) -> str:
        headers = raw.props.headers or {}
        return _text(headers[H_TOPIC]) if H_TOPIC in headers else raw.routing_key

    def _delivery(self, raw: _Raw, attempt: int, receipt: _Receipt) -> Delivery:
        props = raw.props
        headers: dict[str, str] = {}
        key = None
        published = None
        for name, value in (props.headers or {}).items():
            if name.startswith("mq-"):
                if name == H_KEY:
                    key = _text(value)
                elif name == H_PUBLISHED:
                    published = float(_text(value))
                continue
            if name in _BROKER_HEADERS:
                continue
            headers[name] = _text(value)
        if props.content_type:
            headers[CONTENT_TYPE] = props.content_type
        if published is None:
            published = float(props.timestamp) if props.timestamp else time.time()
        if not props.message_id:  # a foreign publisher sent no id: pin one to this copy
            props.message_id = uuid.uuid4().hex
        return Delivery(
            id=props.message_id,
            topic=self._topic_of(raw),
            body=raw.body,
            headers=headers,
            key=key,
            priority=props.priority or 0,
            attempt=attempt,
            published_at=published,
            receipt=receipt,
        )

    def _retry_item(self, raw: _Raw, queue: str, attempt: int, due: float | None) -> _Item:
        """A copy of ``raw`` for ``queue`` with ``attempt``; through a wait tier if ``due``
        is in the future (then ``due`` is also written down so early arrivals are caught)."""
        props = _copy_props(raw.props, **{H_TOPIC: self._topic_of(raw),
                                          H_ATTEMPT: str(attempt - 1),  # so far
                                          H_DUE: repr(due) if due is not None else None})
        if due is not None:
            left = due - time.time()
            if left > 0:
                tier = self._ensure_tier("q", _tier_for(left))
                return _Item(tier, queue, raw.body, props, True)
        return _Item("", queue, raw.body, props, True)

    # -- delay tiers -----------------------------------------------------------------------
    def _ensure_tier(self, family: str, ms: int) -> str:
        """Declare (once) the fanout exchange + TTL queue of one tier; return the exchange.

        Family ``t`` dead-letters to the topic exchange (routing key = topic), family ``q``
        to the default exchange (routing key = the group's queue name)."""
        name = self._tier_name(family, ms)
        if (family, ms) in self._tiers:
            return name
        target = self._exchange if family == "t" else ""

        def declare(a: _Admin) -> None:
            ch = a.ch
            ch.exchange_declare(name, "fanout", durable=True)
            ch.queue_declare(name, durable=True, arguments={
                "x-message-ttl": ms, "x-dead-letter-exchange": target,
            })
            ch.queue_bind(name, name)

        self._admin.run(declare, f"declaring delay tier {ms} ms")
        self._tiers.add((family, ms))
        return name

    # -- publishing ------------------------------------------------------------------------
    def _items(self, envelopes: Sequence[Envelope]) -> list[_Item]:
        now = time.time()
        items = []
        for env in envelopes:
            due = env.deliver_at if env.deliver_at is not None and env.deliver_at > now else None
            props = self._props(env, due)
            if due is None:
                items.append(_Item(self._exchange, env.topic, env.body, props))
            else:
                tier = self._ensure_tier("t", _tier_for(due - now))
                items.append(_Item(tier, env.topic, env.body, props, True))
        return items

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        self._check()
        items = self._items(envelopes)
        pend = self._pub.publish(items, self._publish_timeout)
        if pend.returned:  # a wait tier vanished (deleted behind our back): declare, resend
            self._tiers.clear()
            again = self._items([envelopes[i] for i in pend.returned])
            retry = self._pub.publish(again, self._publish_timeout)
            with pend.lock:
                for j in retry.acked:
                    pend.acked.append(pend.returned[j])
                returned, pend.returned = pend.returned, []
                for j in retry.returned:
                    pend.failed[returned[j]] = "the delay tier queue is missing"
                for j, why in retry.failed.items():
                    pend.failed[returned[j]] = why
        acked = set(pend.acked)
        if len(acked) == len(envelopes):
            return
        failed: dict[int, MQError] = {}
        why = self._pub.last_error or "connection lost"
        for i in range(len(envelopes)):
            if i in acked:
                continue
            if i in pend.failed:
                failed[i] = MQError(f"rabbitmq: {pend.failed[i]}")
            else:
                failed[i] = ConnectionFailed(
                    f"rabbitmq at {self._where}: not confirmed within "
                    f"{self._publish_timeout:g}s ({why})")
        if len(envelopes) == 1:
            raise failed[0]
        raise PublishError(
            f"{len(failed)} of {len(envelopes)} messages not confirmed by {self._where}",
            published=[envelopes[i].id for i in sorted(acked)],
            failed=failed,
        )

    # -- groups ----------------------------------------------------------------------------
    def declare(self, spec: GroupSpec) -> None:
        self._check()
        if (spec.name, spec.pattern) in self._declared:
            return
        queue = self._group_queue(spec.name)
        args = self._queue_args(spec)

        def declare(a: _Admin) -> None:
            try:
                a.ch.queue_declare(queue, durable=True, arguments=args)
            except pex.ChannelClosedByBroker as exc:
                if exc.reply_code != 406:
                    raise
                # Declared before with other hints (queue type): keep the existing queue.
                a.reset_channel()
                a.ch.queue_declare(queue, passive=True)
            a.ch.queue_declare(self._dead_queue(spec.name), durable=True)
            a.ch.queue_bind(queue, self._exchange, routing_key=spec.pattern)

        self._admin.run(declare, f"declaring group {spec.name!r}")
        self._declared.add((spec.name, spec.pattern))

    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        self._check()
        return _Sub(self, spec)

    # -- dead letters ----------------------------------------------------------------------
    def _drain_dead(self, a: _Admin, group: str, limit: int | None) -> list[tuple[Any, Any, bytes]]:
        """basic.get up to ``limit`` dead letters (unacked, in order)."""
        ch = a.ch
        queue = self._dead_queue(group)
        ch.queue_declare(queue, passive=True)
        got = []
        while limit is None or len(got) < limit:
            method, props, body = ch.basic_get(queue, auto_ack=False)
            if method is None:
                break
            got.append((method, props, body))
        return got

    def _dead_letter(self, props: Any, body: bytes, routing_key: str) -> DeadLetter:
        headers = {k: v for k, v in (props.headers or {}).items()}
        user = {}
        for name, value in headers.items():
            if not name.startswith("mq-") and name not in _BROKER_HEADERS:
                user[name] = _text(value)
        if props.content_type:
            user[CONTENT_TYPE] = props.content_type
        published = headers.get(H_PUBLISHED)
        dead_at = headers.get(H_DEAD_AT)
        return DeadLetter(
            id=props.message_id or "",
            topic=_text(headers.get(H_TOPIC, routing_key)),
            body=body,
            headers=user,
            key=_text(headers[H_KEY]) if H_KEY in headers else None,
            priority=props.priority or 0,
            published_at=utc(float(_text(published)) if published is not None
                             else float(props.timestamp or 0)),
            attempts=int(_text(headers.get(H_ATTEMPT, 0))),
            reason=_text(headers.get(H_REASON, "")),
            dead_lettered_at=utc(float(_text(dead_at))) if dead_at is not None else None,
        )

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        self._check()

        def run(a: _Admin) -> list[DeadLetter]:
            got = self._drain_dead(a, group, limit)
            if got:
                a.ch.basic_nack(got[-1][0].delivery_tag, multiple=True, requeue=True)
            return [self._dead_letter(p, b, m.routing_key) for m, p, b in got]

        return self._admin.run(run, f"listing dead letters of {group!r}")  # type: ignore[no-any-return]

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        self._check()
        queue = self._group_queue(group)

        def run(a: _Admin) -> int:
            a.ch.queue_declare(queue, passive=True)
            got = self._drain_dead(a, group, None)
            picked = [g for g in got if ids is None or g[1].message_id in ids]
            items = []
            for _m, props, body in picked:
                fresh = _copy_props(props, **{H_ATTEMPT: None, H_REASON: None,
                                              H_DEAD_AT: None, H_DUE: None})
                items.append(_Item("", queue, body, fresh, True))
            pend = self._pub.publish(items, self._publish_timeout) if items else None
            moved = set(pend.acked) if pend is not None else set()
            ch = a.ch
            keep = {id(g) for j, g in enumerate(picked) if j in moved}
            for g in got:
                if id(g) in keep:
                    ch.basic_ack(g[0].delivery_tag)
                else:
                    ch.basic_nack(g[0].delivery_tag, requeue=True)
            if pend is not None and len(moved) < len(items):
                raise ConnectionFailed(f"rabbitmq at {self._where}: replayed {len(moved)} of "
                                       f"{len(items)} dead letters; retry for the rest")
            return len(moved)

        return self._admin.run(run, f"replaying dead letters of {group!r}")  # type: ignore[no-any-return]

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        self._check()
        queue = self._dead_queue(group)

        def run(a: _Admin) -> int:
            if ids is None:
                a.ch.queue_declare(queue, passive=True)
                return int(a.ch.queue_purge(queue).method.message_count)
            got = self._drain_dead(a, group, None)
            count = 0
            for method, props, _body in got:
                if props.message_id in ids:
                    a.ch.basic_ack(method.delivery_tag)
                    count += 1
                else:
                    a.ch.basic_nack(method.delivery_tag, requeue=True)
            return count

        return self._admin.run(run, f"purging dead letters of {group!r}")  # type: ignore[no-any-return]

    def stats(self, group: str) -> GroupStats:
        self._check()

        def run(a: _Admin) -> GroupStats:
            ready = a.ch.queue_declare(self._group_queue(group), passive=True)
            dead = a.ch.queue_declare(self._dead_queue(group), passive=True)
            return GroupStats(group, ready.method.message_count, None, None,
                              dead.method.message_count)

        return self._admin.run(run, f"stats of group {group!r}")  # type: ignore[no-any-return]

    def delete_group(self, group: str) -> None:
        self._check()

        def run(a: _Admin) -> None:
            a.ch.queue_declare(self._group_queue(group), passive=True)
            a.ch.queue_delete(self._group_queue(group))
            a.ch.queue_delete(self._dead_queue(group))

        try:
            self._admin.run(run, f"deleting group {group!r}")
        finally:
            self._declared = {d for d in self._declared if d[0] != group}

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self._link.subs):
            with contextlib.suppress(Exception):
                sub.close()
        self._link.stop()
        self._pub.close()
        self._admin.close()
