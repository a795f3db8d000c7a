"""The lease watchdog: a small process per consuming process that cuts the connection
of a subscription frozen past its lease deadline (the broker then requeues its messages)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

log = logging.getLogger("mqabstract.rabbitmq")

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
# ``_Holdings.sync_locked`` in holdings.py): pika may run a few callbacks before it reads the
# closed socket.
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

