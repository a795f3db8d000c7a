"""What the driver and its subscriptions share: the pool (psycopg errors translated), the
schema's statements, the clock, and how idle receivers are woken (``Waker``, fed by this
process's writers, ``Listener``'s NOTIFYs and the fake clock)."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg.errors
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from mqabstract.clock import Clock
from mqabstract.emulation.wakeup import Waker
from mqabstract.errors import Closed, ConnectionFailed, InvalidURL, MQError, Timeout
from mqabstract.url import BrokerURL

from .rotation import ROTATE_EVERY, rotate
from .schema import Statements

__all__ = ["Conn", "Listener", "Store", "Watchdog", "translate"]

Conn = psycopg.Connection[tuple[Any, ...]]


@contextlib.contextmanager
def translate(what: str, where: str, password: str | None = None,
              connect_timeout: float | None = None, kind: str = "broker") -> Iterator[None]:
    """psycopg's (and its pool's) exceptions become ``mqabstract.errors`` naming ``where``
    (a redacted URL or a description), never ``password``: connection problems
    ``ConnectionFailed``, statement and lock timeouts ``Timeout``, any other server error
    a plain ``MQError``; the native exception is chained (``kind`` names what a closed
    pool belonged to). Shared by the driver, the outbox and the dedupe store."""
    try:
        yield
    except MQError:
        raise
    except PoolClosed as exc:
        raise Closed(f"postgresql {kind} {where} is closed") from exc
    except Exception as exc:
        text = str(exc).strip().replace(password or "\0", "***")
        head = f"postgresql {what} on {where}"
        if isinstance(exc, PoolTimeout):
            within = "" if connect_timeout is None else f" within {connect_timeout:g}s"
            raise ConnectionFailed(f"{head}: no connection{within}: {text}") from exc
        if isinstance(exc, (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)):
            raise Timeout(f"{head}: {text}") from exc
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
            raise ConnectionFailed(f"{head} failed: {text}") from exc
        if isinstance(exc, psycopg.Error):
            raise MQError(f"{head} failed: {type(exc).__name__}: {text}") from exc
        raise


class Listener:
    """One thread holding a ``LISTEN`` connection; a NOTIFY whose payload is a group id
    wakes that group's receivers. A lost connection is retried with backoff; once it
    listens again every receiver is woken (what was published meanwhile was not heard)."""

    def __init__(self, connect: Callable[[], Conn], channel: str, waker: Waker) -> None:
        self._connect, self._channel, self._waker = connect, channel, waker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mq-{channel}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    conn.execute(f"LISTEN {self._channel}")
                    self._waker.wake()
                    backoff = 0.05
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            if self._stop.is_set():
                                return
                            if note.payload.isdigit():
                                self._waker.wake((int(note.payload),))
            except psycopg.Error:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def stop(self, poke: Callable[[], None]) -> None:
        """Stop the thread; ``poke`` sends a NOTIFY that ends its wait at once."""
        self._stop.set()
        poke()
        self._thread.join(2.0)


class Watchdog:
    """A time limit on calls: psycopg sets none on a statement, and a frozen server (a paused
    container, a VM stall, a black hole on the path) answers nothing, not even a cancel
    request. A connection in use longer than ``limit`` has its socket shut down, so the call
    blocked on it fails at once (``ConnectionFailed``) and the pool drops the connection."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._cond = threading.Condition(threading.Lock())
        self._watched: dict[int, tuple[float, Conn, list[bool]]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False

    @contextlib.contextmanager
    def watch(self, conn: Conn, what: str) -> Iterator[None]:
        cut: list[bool] = []
        with self._cond:
            self._watched[id(conn)] = (time.monotonic() + self.limit, conn, cut)
            if self._thread is None and not self._stop:
                self._thread = threading.Thread(target=self._run, name="mq-watchdog",
                                                daemon=True)
                self._thread.start()
        try:
            yield
        except psycopg.Error as exc:
            if cut:
                raise ConnectionFailed(f"{what}: the server did not answer within "
                                       f"{self.limit:g}s") from exc
            raise
        finally:
            with self._cond:
                self._watched.pop(id(conn), None)

    def check(self) -> float:
        """Cut every connection past its limit; seconds until the next one's."""
        now = time.monotonic()
        with self._cond:
            late = [k for k, (t, _, _) in self._watched.items() if t <= now]
            cuts = [self._watched.pop(k) for k in late]
            soonest = min((t for t, _, _ in self._watched.values()), default=now + self.limit)
        for _, conn, cut in cuts:
            cut.append(True)
            with contextlib.suppress(OSError, psycopg.Error):
                sock = socket.socket(fileno=conn.pgconn.socket)
                try:  # shutdown, not close: the descriptor stays psycopg's
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.detach()
        return soonest - now

    def _run(self) -> None:
        while True:
            wait = self.check()
            with self._cond:
                if self._stop:
                    return
                self._cond.wait(max(0.01, wait))

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()


class Store:
    """A pool of autocommit connections to one schema, and its receivers' wake-ups."""

    def __init__(self, url: BrokerURL, schema: str, clock: Clock, *, connect_timeout: float,
                 poll_interval: float, pool_size: int, listen: bool) -> None:
        self.where = url.redacted()
        self._password = url.password
        if not url.hosts or not url.path or "/" in url.path:
            raise InvalidURL(f"postgresql URLs need a host and a database: "
                             f"postgresql://user:pass@host:5432/db, not {self.where}")
        # The password goes in the keywords, not in the conninfo the pool keeps and shows.
        self._conninfo = make_conninfo(host=",".join(h for h, _ in url.hosts),
                                       port=",".join(str(p or 5432) for _, p in url.hosts),
                                       dbname=url.path, user=url.username or "")
        self._kwargs: dict[str, Any] = {
            "autocommit": True, "password": url.password,
            "application_name": f"mqabstract:{schema}",  # seen in pg_stat_activity
            "connect_timeout": max(2, math.ceil(connect_timeout)),  # libpq: whole s, >= 2
            # Every statement finds its rows by an index; the planner, misled by a
            # partition's few live rows among many dead ones, would scan it whole. (JIT
            # off: that setting's cost penalty would make it compile every statement.)
            "options": "-c enable_seqscan=off -c jit=off",
        }
        self.sql, self.schema = Statements(schema), schema
        self._rotator: threading.Thread | None = None
        self._stop = threading.Event()
        self.drained: tuple[int, ...] = ()  # partitions the hot statements skip
        self.clock, self.poll_interval = clock, poll_interval
        self.connect_timeout = connect_timeout
        self.waker = Waker()
        self.watchdog = Watchdog(connect_timeout)
        self.closed = False
        self._listen = listen
        self._listener: Listener | None = None
        self._lock = threading.Lock()
        self._pool = ConnectionPool(self._conninfo, kwargs=self._kwargs, min_size=1,
                                    max_size=pool_size, open=False, timeout=connect_timeout,
                                    name=f"mqabstract-{schema}")
        clock.on_advance(self.waker.wake)  # FakeClock.advance wakes every receiver

    def open(self, prepare: Callable[[Conn], None]) -> None:
        """``prepare`` on a direct connection (a server that is down fails at once, where
        the pool would retry until its timeout), then fill the pool."""
        try:
            with self.translate("open"):
                with self.connect() as conn:
                    prepare(conn)
                self._pool.open(wait=True, timeout=self.connect_timeout)
        except BaseException:
            self._pool.close(timeout=0)
            raise

    def connect(self) -> Conn:
        """A new connection outside the pool (migration, the LISTEN connection)."""
        return psycopg.connect(self._conninfo, **self._kwargs)

    def translate(self, what: str) -> contextlib.AbstractContextManager[None]:
        """psycopg's exceptions become ``mqabstract.errors`` naming the redacted URL."""
        return translate(what, self.where, self._password, self.connect_timeout)

    @contextlib.contextmanager
    def conn(self, what: str) -> Iterator[Conn]:
        """A pooled connection (autocommit) with errors translated, cut after
        ``connect_timeout`` of use (``Watchdog``)."""
        self.check_open()
        with self.translate(what), self._pool.connection() as conn, \
                self.watchdog.watch(conn, f"postgresql {what} on {self.where}"):
            yield conn

    def check_open(self) -> None:
        if self.closed:
            raise Closed(f"postgresql broker {self.where} is closed")

    def now(self) -> float:
        return self.clock.time()

    def _rotate(self) -> None:
        """The partition ring's pass (``rotation.rotate``) twice per rotation period; a
        failed pass (a lost connection, anything else) is tried again on the next: the
        thread must not end while the Broker is open."""
        while not self._stop.wait(ROTATE_EVERY / 2):
            with contextlib.suppress(Exception), self.conn("rotate") as conn:
                self.drained = rotate(conn, self.schema)

    def notify(self, conn: Conn, gid: int) -> None:
        """Local receivers at once; other processes through NOTIFY (sent on commit)."""
        conn.execute(self.sql.notify, (str(gid),))
        self.waker.wake((gid,))

    def listen(self) -> None:
        """Start the rotation thread and the LISTEN thread (unless ``listen=false``) once."""
        with self._lock:
            if self._rotator is None and not self.closed:
                self._rotator = threading.Thread(target=self._rotate, daemon=True,
                                                 name=f"mq-rotate-{self.schema}")
                self._rotator.start()
            if self._listen and self._listener is None and not self.closed:
                self._listener = Listener(self.connect, self.sql.channel, self.waker)

    def _poke(self) -> None:
        with contextlib.suppress(psycopg.Error, PoolTimeout, PoolClosed), \
                self._pool.connection(timeout=1.0) as conn:
            conn.execute(self.sql.notify, ("stop",))  # no group id: listeners ignore it

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            listener, self._listener = self._listener, None
        self._stop.set()
        self.waker.wake()  # receivers notice the close
        if self._rotator is not None:  # a pass hung on a silent server: the watchdog
            self._rotator.join(self.connect_timeout)  # cuts it within connect_timeout
        self.watchdog.stop()
        if listener is not None:
            listener.stop(self._poke)
        with self.translate("close"):
            self._pool.close(timeout=self.connect_timeout)
