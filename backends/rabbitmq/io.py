"""The driver's native pika I/O: publisher confirms, the blocking publisher and admin
connections, and the I/O thread (``_Link``) that runs every subscription's connection
(each one's consumer link is ``consumer._Consumer``)."""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pika
import pika.exceptions as pex
from pika import spec as amqp
from pika.adapters.select_connection import IOLoop
from pika.adapters.utils.io_services_utils import _AsyncPlaintextTransport as _PLAIN

from mqabstract.errors import (
    ConnectionFailed,
    InvalidArgument,
    MQError,
    NotFound,
)
from mqabstract.url import redact

log = logging.getLogger("mqabstract.rabbitmq")

_TICK = 0.05  # lease / idle check period, seconds
_CONN_ERRORS = (
    pex.AMQPConnectionError, pex.ConnectionClosed, pex.StreamLostError,
    pex.ConnectionWrongStateError, pex.ChannelWrongStateError, OSError,
)



def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


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
    """Confirmation state of one group of publishes; ``done`` runs once all are settled.
    Besides acked, refused (``failed``) and returned, a publish can be ``lost`` (never
    handed to a channel: safe to send again) or in ``doubt`` (handed to a channel that went
    away before its confirm came: the broker may have stored it, so sending it again may
    make a second copy of the message).

    Settled by whichever thread reads the confirms (a publisher's caller or the I/O
    thread), under its own lock. Nobody blocks on it: the caller reads confirms itself
    (``_Publisher._wait``), the I/O thread hears of the end through ``on_done``."""

    __slots__ = ("acked", "doubt", "failed", "left", "lock", "lost", "on_done", "returned")

    def __init__(self, n: int, on_done: Callable[[_Pending], None] | None = None) -> None:
        self.left = n
        self.acked: list[int] = []
        self.failed: dict[int, str] = {}
        self.lost: list[int] = []
        self.doubt: list[int] = []
        self.returned: list[int] = []
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
            elif outcome == "doubt":
                self.doubt.append(j)
            else:
                self.failed[j] = why
            self.left -= 1
            finished = self.left == 0
        if finished:
            self._finish()

    def _finish(self) -> None:
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # never let a callback kill the I/O loop
                log.exception("publish completion callback failed")


class _Confirms:
    """Publisher-confirm bookkeeping for one confirm-mode channel: delivery tag → (pending,
    index), and basic.return matching for publishes where "unroutable" is a failure.

    Not thread-safe: used only by the thread that owns the channel (the ``_Publisher``
    lock holder, or the I/O thread for a subscription's copy channel). It never re-sends:
    on a new channel whatever was sent and not confirmed is settled "doubt" (the broker may
    have it), what could not be sent "lost", for the caller to decide."""

    def __init__(self) -> None:
        self.out: OrderedDict[int, tuple[_Pending, int, tuple[str, str, str] | None]] = (
            OrderedDict()
        )
        self.tag = 0
        self._returns: dict[tuple[str, str, str], deque[int]] = {}
        self._returned: set[int] = set()

    def reset(self) -> None:
        """A new channel: tags restart at 1; whatever was sent and not confirmed is in
        doubt (it may have reached the broker, only its confirm was lost)."""
        out, self.out = self.out, OrderedDict()
        self.tag = 0
        self._returns.clear()
        self._returned.clear()
        for pend, j, _key in out.values():
            pend.settle(j, "doubt")

    def send(self, publish: Callable[..., Any] | None, items: Sequence[_Item], pend: _Pending,
             usable: Callable[[], bool]) -> None:
        """Publish ``items`` with ``publish``; an error on the wire marks the rest lost (all
        of them when there is no channel to publish on: ``publish`` None, ``usable`` False)."""
        for j, item in enumerate(items):
            if publish is None or not usable():
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
            except Exception as exc:  # the channel or connection was closed: not sent
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


_CHUNK = 1 << 18  # bytes per send at most: a partial send re-buffers the rest as a copy


def _send_now(conn: pika.BlockingConnection) -> None:
    """Send what one publish buffered, joined into as few chunks as ``_CHUNK`` allows.

    pika writes each AMQP frame with its own ``send``: three per message (method, header,
    body), each a system call and a TCP segment the broker reads on its own; and it sends
    only once its I/O loop saw the socket writable, one more poll per publish. Joined, a
    lone publish is one ``send``, a batch a few; on a plain TCP connection they are written
    here at once, through the transport's own writable handler (which removes the write
    watch once the buffer is empty, and aborts the connection on an error as the loop
    would). Reads pika internals in place, as ``_check_idle`` reads its socket; a
    transport without them is left to pika's loop."""
    transport: Any = getattr(conn._impl, "_transport", None)
    bufs = getattr(transport, "_tx_buffers", None)
    if not isinstance(bufs, deque) or not bufs:
        return
    if len(bufs) > 1:
        chunks: list[bytes] = []
        part: list[bytes] = []
        size = 0
        for b in bufs:
            part.append(b)
            size += len(b)
            if size >= _CHUNK:
                chunks.append(b"".join(part))
                part, size = [], 0
        if part:
            chunks.append(b"".join(part))
        bufs.clear()
        bufs.extend(chunks)
    if type(transport) is _PLAIN:
        transport._on_socket_writable()


def _merge(result: _Pending, pend: _Pending, todo: list[int]) -> list[int]:
    """Fold one attempt's outcome into ``result``; return the indexes to send again: those
    never sent. Those in doubt are not sent again (the broker may have them: a second copy
    of one id would count its attempts from 1 again); the caller hears of them."""
    with pend.lock:
        for j in pend.acked:
            result.settle(todo[j], "ack")
        for j in pend.returned:
            result.settle(todo[j], "returned")
        for j, why in pend.failed.items():
            result.settle(todo[j], "nack", why)
        for j in pend.doubt:
            result.settle(todo[j], "doubt")
        return [todo[j] for j in sorted(pend.lost)]


class _Publisher:
    """Publishes from the calling thread on a BlockingConnection of its own, so a single
    publish costs what raw pika's does (no hop to the I/O thread). Confirms are pipelined:
    confirm mode is switched on at the pika channel implementation (``_impl``), so
    BlockingChannel does not wait per message; acks arrive through ``process_data_events``.
    One caller at a time (``lock``, held for the whole publish); a lost connection is
    re-opened and what was never sent is sent until the timeout. What was sent and lost
    its confirm with the connection is in doubt and never re-sent here (the broker may
    have stored it: a second copy of one id would count its attempts from 1 again, one id
    delivered at attempt 2 and then 1); it is reported, and the caller decides. Refused
    (basic.nack) and returned messages are reported, never re-sent here either. Before
    sending on a connection that sat idle, it reads what the broker sent meanwhile, so a
    connection the broker closed (a restart) is replaced first and nothing is put in doubt
    by sending into it."""

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

    def _check_idle(self) -> None:
        """Read what arrived on the open connection since the last publish (a close from
        the broker, the end of the stream): raises if the connection is gone. One poll
        of the socket when nothing arrived."""
        conn = self.conn
        assert conn is not None
        sock = getattr(getattr(conn._impl, "_transport", None), "_sock", None)
        if sock is None:
            return
        try:
            readable = select.select([sock], [], [], 0)[0]
        except (OSError, ValueError):
            readable = [sock]
        if readable:
            conn.process_data_events(time_limit=0)

    def _publish_fn(self, count: int) -> Callable[..., None]:
        """Buffer every publish at the channel implementation; ``_wait`` flushes them to
        the socket together while it waits for their confirms (BlockingChannel's own
        publish would run the I/O loop once more per call)."""
        ch = self.ch
        assert ch is not None
        return ch._impl.basic_publish  # type: ignore[no-any-return]

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
        """Publish and wait for confirms; what was never sent is sent across reconnects
        until ``timeout``, what is in doubt is not (``_Pending.doubt``)."""
        deadline = time.monotonic() + timeout
        result = _Pending(len(items))
        todo = list(range(len(items)))
        failures = 0
        with self.lock:
            while todo and time.monotonic() < deadline:
                pend = _Pending(len(todo))
                if self.conn is not None and self.conn.is_open and self._usable():
                    try:
                        self._check_idle()
                    except (*_CONN_ERRORS, pex.AMQPError) as exc:
                        self._drop(exc)  # gone while idle: opened again at once
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
                    _send_now(self.conn)
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
# the I/O thread


class _Member(Protocol):
    """A subscription's consumer link (``consumer._Consumer``) as the I/O thread knows it:
    ticked every _TICK on this thread, closed (from another thread) with the driver. A
    protocol, so this module need not import the consumer's, which imports it."""

    def tick(self, now: float) -> None: ...

    def close(self) -> None: ...


class _Link:
    """The I/O thread: a pika IOLoop that runs every subscription's own ``SelectConnection``
    and a lease tick. Everything touching those pika objects runs on this thread; other
    threads hand it work with ``call``."""

    def __init__(self, params: list[pika.ConnectionParameters], where: str) -> None:
        self.params = params
        self.where = where
        self.ioloop = IOLoop()
        self.closing = False
        self.subs: set[_Member] = set()  # every open subscription's consumer link
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
                sub.tick(now)
            except Exception:
                log.exception("rabbitmq lease tick failed")
        if not self.closing:
            self.ioloop.call_later(_TICK, self._tick)


# ----------------------------------------------------------------------------------------
# blocking admin connection


class _Admin:
    """A BlockingConnection for declarations and queue inspection, one caller at a time
    (``lock``, from application threads). ``run`` runs an operation a second time only after
    the connection was lost; a broker error (channel closed) is translated, never retried."""

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

