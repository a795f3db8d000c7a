"""Bookkeeping shared by the reliability tests: names, a delivery ledger, worker processes
and the JSON-lines report behind ``docs/reliability.md``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import mqabstract

from .history import (
    ACK_STARTED,
    ACKED,
    EXHAUSTED_PREFIXES,
    LEASE_EXPIRED,
    History,
    check,
)

WORKER = str(Path(__file__).with_name("worker.py"))
REPO = Path(__file__).resolve().parents[2]

#: Lease used by fault tests: whole seconds (SQS granularity), short so redelivery is quick.
LEASE = 2.0

#: Backend aliases that are another client on a broker kind: alias -> (kind, URL query).
CLIENT_ALIASES = {"kafka-python": ("kafka", "client=kafka-python")}


def kind(backend: str) -> str:
    """The broker kind behind a backend alias (``kafka-python`` runs on ``kafka``)."""
    return CLIENT_ALIASES[backend][0] if backend in CLIENT_ALIASES else backend


#: Options every fault scenario adds to a broker kind's URL. Kafka: a 2 s consumer session
#: (the driver's default is 6 s, Apache's default minimum): a frozen or killed member is
#: evicted, and its partitions move, a third as late, so the scenarios wait a third as long
#: for the same faults. The test brokers allow it (``group.min.session.timeout.ms=1000``,
#: scripts/brokerctl.py); the conformance suite keeps the driver's defaults.
KAFKA_SESSION = 2.0  # seconds; the heartbeat is a quarter of it (Kafka wants < a third)
FAULT_OPTIONS = {"kafka": f"session_timeout_ms={int(KAFKA_SESSION * 1000)}"
                          f"&heartbeat_interval_ms={int(KAFKA_SESSION * 250)}"}


def with_client(backend: str, url: str) -> str:
    """``url`` with the client the alias names (unchanged for plain kinds)."""
    if backend not in CLIENT_ALIASES:
        return url
    return url + ("&" if "?" in url else "?") + CLIENT_ALIASES[backend][1]


def fault_url(backend: str, url: str) -> str:
    """``url`` as the fault scenarios use it: the alias's client and ``FAULT_OPTIONS``."""
    url = with_client(backend, url)
    extra = FAULT_OPTIONS.get(kind(backend))
    return url + ("&" if "?" in url else "?") + extra if extra else url


def token(prefix: str = "r") -> str:
    """A short unique word for topic and group names (tests share brokers)."""
    return prefix + secrets.token_hex(4)


def digest(body: bytes) -> str:
    """Short fingerprint of a body: a duplicate must carry the same bytes as the original."""
    return hashlib.blake2b(body, digest_size=8).hexdigest()


def body_for(mid: str, size: int = 64) -> bytes:
    """A body derived from the id, so a redelivery with other bytes is detectable."""
    seed = hashlib.sha256(mid.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Reporter:
    """Appends one JSON object per finished scenario to a file (if a path was given)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def emit(self, **row: Any) -> None:
        row.setdefault("ts", round(time.time(), 1))
        with self._lock:
            self.rows.append(row)
            if self.path:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row, sort_keys=True) + "\n")
        print("RELIABILITY", json.dumps(row, sort_keys=True))

    def close(self) -> None:
        pass


#: Where a backend's release clock does not start at the lease deadline (the formula each
#: backend's doc states; ``history.RELEASE_CLOCKS``): Kafka's group stops delivering for a
#: rebalance whenever a member joins, leaves, stops or wakes, and a stopped SQLite process
#: may hold the file's write lock.
RELEASE_CLOCK = {"kafka": "membership", "sqlite": "unfrozen"}


class _LateHere(mqabstract.Middleware):
    """Late deliveries in this process (see ``Ledger.connect``)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def settled(self, sub: object, op: str, messages: Sequence[mqabstract.Message],
                started_ns: int, error: object) -> None:
        if op == "expired":
            for msg in messages:
                if (msg.id, msg.attempt) not in self._ledger._handed:
                    self._ledger.history.unseen(msg.id, msg.attempt, "here", time.monotonic())


class Ledger:
    """The recording API of a scenario: it builds the scenario's :class:`History` (judged
    by ``history.check``) and keeps the views the tests steer by: ``expected`` (confirmed
    id → body digest), ``maybe`` (ids only published in flight or by a failed call),
    ``acked``, ``dead`` (id → attempts) and ``deliveries`` ((id, attempt, digest)).

    Deliveries carry their holder (``"here"`` for this process, ``"pid<N>"`` for a worker)
    and their lease origin (the start of the receive call that returned them) and deadline.
    """

    def __init__(self, max_attempts: int | None = None, backend: str | None = None) -> None:
        self.history = History(max_attempts=max_attempts)
        #: When the release clock starts on this backend (``history.RELEASE_CLOCKS``).
        self.release_clock = RELEASE_CLOCK.get(kind(backend), "deadline") if backend \
            else "deadline"
        self.expected: dict[str, str] = {}
        self.acked: set[str] = set()
        self._handed: set[tuple[str, int]] = set()  # (id, attempt) received in this process

    def connect(self, url: str) -> mqabstract.Broker:
        """``mqabstract.connect(url)`` whose receive calls that return after their lease
        (handing their messages to nobody) are recorded as late deliveries of ``"here"``,
        as workers print them (``LATE``): the broker counted each."""
        return mqabstract.connect(url, middleware=[_LateHere(self)])

    # -- recording ----------------------------------------------------------------------
    def confirm(self, mid: str, body: bytes) -> None:
        """A publish of ``mid`` returned."""
        self.expected[mid] = digest(body)
        self.history.publish(mid, digest(body))

    def in_flight(self, mid: str, body: bytes) -> None:
        """A publish of ``mid`` may have reached the broker (in flight when the publisher
        died, or it raised and was retried)."""
        self.history.publish(mid, digest(body), confirmed=False)

    def demote(self, mid: str) -> None:
        """A confirmed ``mid`` that a non-durable broker wiped: only "maybe" now."""
        self.expected.pop(mid, None)
        self.history.publishes = [replace(p, confirmed=False) if p.id == mid else p
                                  for p in self.history.publishes]

    def deliver(self, mid: str, attempt: int, body_digest: str, *, holder: str,
                start: float, deadline: float, returned: float | None = None) -> None:
        self.history.deliver(mid, attempt, holder, start, deadline, body_digest, returned)

    def received(self, msg: mqabstract.Message, sub: mqabstract.Subscription,
                 returned: float | None, holder: str = "here") -> None:
        """Record a message received in this process through ``sub``: its lease deadline
        (now + what is left of it) and origin (the deadline - the group's lease)."""
        deadline = time.monotonic() + msg.lease_remaining
        self._handed.add((msg.id, msg.attempt))
        self.deliver(msg.id, msg.attempt, digest(msg.body), holder=holder,
                     start=deadline - sub.spec.lease, deadline=deadline, returned=returned)

    def receive(self, sub: mqabstract.Subscription, max_messages: int, wait: float,
                holder: str = "here") -> list[mqabstract.Message]:
        """``sub.receive`` in this process, recorded: the call as a receive window of
        ``holder``, each message it returned as a delivery."""
        since = time.monotonic()
        got = sub.receive(max_messages, wait)
        returned = time.monotonic()
        self.history.receiving(holder, since, returned)
        for msg in got:
            self.received(msg, sub, returned, holder)
        return got

    def ack(self, mid: str, holder: str = "here", t: float | None = None) -> None:
        """An ack of ``mid`` that started at ``t`` (default: now) returned."""
        self.settle(mid, ACKED, holder, t)

    def settle(self, mid: str, outcome: str, holder: str = "here",
               t: float | None = None) -> None:
        self.history.settle(mid, holder, outcome, time.monotonic() if t is None else t)
        if outcome == ACKED:
            self.acked.add(mid)

    # -- views --------------------------------------------------------------------------
    @property
    def maybe(self) -> dict[str, str]:
        return {p.id: p.digest for p in self.history.publishes
                if not p.confirmed and p.id not in self.expected}

    @property
    def dead(self) -> dict[str, int]:
        return {d.id: d.attempts for d in self.history.dead_letters}

    @property
    def deliveries(self) -> list[tuple[str, int, str]]:
        return [(d.id, d.attempt, d.digest) for d in self.history.deliveries]

    # -- analysis ---------------------------------------------------------------------
    def duplicates(self) -> int:
        """Deliveries beyond the first of each id (redeliveries of any cause)."""
        return len(self.history.deliveries) - len({d.id for d in self.history.deliveries})

    def after_ack(self) -> int:
        """Deliveries of an id that started after an ack of it had started (allowed:
        at-least-once)."""
        first_ack: dict[str, float] = {}
        for s in self.history.settles:
            if s.outcome == ACKED:
                first_ack[s.id] = min(s.t, first_ack.get(s.id, s.t))
        return sum(1 for d in self.history.deliveries
                   if d.id in first_ack and d.start > first_ack[d.id])

    def problems(self, release_margin: float | None = None,
                 dead_letter_duplicates: str | None = None,
                 skip: dict[str, str] | None = None) -> list[str]:
        """Every broken rule of the history checker, as readable lines (empty: all hold).
        With ``$MQ_RELIABILITY_HISTORIES`` (a folder), the history and its verdict are
        also written there as JSON, one file per judged scenario."""
        found = check(self.history, release_margin=release_margin,
                      release_clock=self.release_clock,
                      dead_letter_duplicates=dead_letter_duplicates, skip=skip)
        folder = os.environ.get("MQ_RELIABILITY_HISTORIES")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            name = Path(folder) / f"history-{os.getpid()}-{secrets.token_hex(3)}.json"
            name.write_text(json.dumps({"violations": found, "release_margin": release_margin,
                                        "skip": skip, **self.history.to_json()}),
                            encoding="utf-8")
        return found

    def _lost(self) -> set[str]:
        """Confirmed ids neither acked nor dead-lettered nor acked in doubt (an id whose
        consumer was killed inside ack() may well be acked on the broker and then never
        comes back: that is finished, in doubt, not lost)."""
        return set(self.expected) - self.acked - set(self.dead) - self.history.in_doubt()

    def summary(self) -> dict[str, Any]:
        settled = self.acked | set(self.dead)
        return {
            "confirmed": len(self.expected),
            "in_flight": len(self.maybe),
            "delivered": len(self.history.deliveries),
            "unique": len({d.id for d in self.history.deliveries}),
            "duplicates": self.duplicates(),
            "redelivered_after_ack": self.after_ack(),
            "acked": len(self.acked),
            "dead_lettered": len(self.dead),
            "lost": len(self._lost()),
            "ack_in_doubt": len((set(self.expected) & self.history.in_doubt()) - settled),
        }


# -- worker processes ------------------------------------------------------------------
class Worker:
    """A ``worker.py`` subprocess whose flushed stdout lines are read on a thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p
        )
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        self.lines: list[str] = []
        self.holder = f"pid{self.proc.pid}"  #: its name in a History
        self.killed_at: float | None = None  #: when this process SIGKILLed it
        self.freezes: list[list[float | None]] = []  #: [SIGSTOP time, SIGCONT time or None]
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,),
                                        daemon=True)
        self._reader.start()
        self._err: list[str] = []
        self._err_reader = threading.Thread(target=self._drain_err, args=(self.proc.stderr,),
                                            daemon=True)
        self._err_reader.start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _drain_err(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self._err.append(line)
            del self._err[:-200]

    def wait_for(self, prefix: str, count: int = 1, timeout: float = 60.0) -> bool:
        """Block until ``count`` lines start with ``prefix`` (or the process ended)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if sum(1 for ln in self.lines if ln.startswith(prefix)) >= count:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    return False
                self._cond.wait(min(left, 0.2))

    def freeze(self) -> None:
        """SIGSTOP: the process holds everything it has and does nothing (a GC or VM stall)."""
        self.freezes.append([time.monotonic(), None])
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        if self.freezes and self.freezes[-1][1] is None:
            self.freezes[-1][1] = time.monotonic()

    def tell(self, line: str = "go") -> None:
        """Write a line to the worker's stdin (``hold`` waits for one before settling)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL (no cleanup of any kind in the child), then reap it."""
        if self.proc.poll() is None:
            self.killed_at = time.monotonic()
            os.kill(self.proc.pid, signal.SIGKILL)
        self.finish(30)

    def finish(self, timeout: float) -> int:
        """Wait for the process to exit and its output to be read; return the exit code."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.killed_at = time.monotonic()
            os.kill(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(30)
        self._reader.join(10)
        self._err_reader.join(10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self._err)[-3000:]

    def events(self) -> list[list[str]]:
        with self._cond:
            return [ln.split() for ln in self.lines]


@dataclass
class Frozen:
    """What ``freeze_a_holder`` saw: the frozen worker's held ids (id → attempt), when each
    came back to another consumer (id → (monotonic time, attempt)), when the holder's
    receive started, how long it stayed frozen, its exit code, stderr, and its settles after
    waking (ACKED / EXPIRED events)."""

    held: dict[str, int]
    arrived: dict[str, tuple[float, int]]
    started: float
    frozen_s: float
    code: int | None
    stderr: str
    after: list[list[str]]


def freeze_a_holder(mq: mqabstract.Broker, url: str, group: str, pattern: str, lease: float,
                    held_n: int, ledger: Ledger, margin: float, frozen_for: float = 0.0
                    ) -> Frozen:
    """A worker process receives ``held_n`` messages and is SIGSTOPped holding them; a
    consumer here drains the group (acking into ``ledger``) until every confirmed id is
    acked; the holder stays frozen at least ``frozen_for`` seconds, is woken and tries to
    ack what it held. The holder's deliveries, freeze and settles go to the history."""
    holder: Worker | None = None
    try:
        holder = Worker("hold", url, group, pattern, str(lease), str(held_n))
        assert holder.wait_for("HELD", 1, 120), holder.stderr
        holder.freeze()
        frozen_at = time.monotonic()
        events = holder.events()
        started = next(float(e[1]) for e in events if e[0] == "RECVAT")
        held = {e[1]: int(e[2]) for e in events if e[0] == "RECV"}
        arrived: dict[str, tuple[float, int]] = {}
        with mq.subscribe(group, pattern, lease=lease, max_attempts=50) as sub:
            limit = time.monotonic() + lease + margin + 60
            while set(ledger.expected) - ledger.acked and time.monotonic() < limit:
                got = ledger.receive(sub, 100, 0.2)
                for msg in got:
                    if msg.id in held:
                        arrived.setdefault(msg.id, (time.monotonic(), msg.attempt))
                at = time.monotonic()
                # One call for the batch: acking 30 one by one on moto under load outlasted
                # the 4 s lease (LeaseExpired in this drain, CI validation run).
                sub.ack_many(got)
                for msg in got:
                    ledger.ack(msg.id, t=at)
            time.sleep(max(0.0, frozen_at + frozen_for - time.monotonic()))
            frozen_s = time.monotonic() - frozen_at
            holder.thaw()
            holder.tell()
            code = holder.finish(60)
        feed(ledger, holder)
        after = [e for e in holder.events() if e[0] in ("ACKED", "EXPIRED")]
        return Frozen(held, arrived, started, frozen_s, code, holder.stderr, after)
    finally:
        if holder is not None and holder.proc.poll() is None:
            holder.thaw()
            holder.kill()


def run_replacing_killed(spawn: Callable[[], Worker], n: int, limit: float
                         ) -> tuple[list[Worker], list[Worker]]:
    """Run ``n`` workers until each exits by itself, replacing every one SIGKILLed (a worker
    that kills itself at a planned point) with a fresh ``spawn()``; another exit status
    fails. Returns (finished, killed); fails when some are still busy after ``limit`` s."""
    workers = [spawn() for _ in range(n)]
    finished: list[Worker] = []
    killed: list[Worker] = []
    deadline = time.monotonic() + limit
    while workers and time.monotonic() < deadline:
        time.sleep(0.1)
        for w in list(workers):
            code = w.proc.poll()
            if code is None:
                continue
            workers.remove(w)
            w.finish(30)
            if code == -9:
                killed.append(w)
                workers.append(spawn())
            else:
                assert code == 0, f"a consumer exited {code}: {w.stderr}"
                finished.append(w)
    for w in workers:  # over time: stop them, then report what was missing
        w.kill()
    assert not workers, f"consumers still busy after {limit:g} s ({len(killed)} killed)"
    return finished, killed


def feed(ledger: Ledger, *workers: Worker) -> None:
    """Add worker processes' lines to the ledger's history (after they exited): their
    deliveries (holder ``pid<N>``, lease origin and deadline), settles, the window in which
    each was receiving (its ``CALL`` lines: each receive call; without them ``READY`` to
    ``HELD`` / ``DONE`` / its death), and the kills (by this process, or its own ``KILL``
    line) and freezes done to it."""
    history = ledger.history
    for w in workers:
        who = w.holder
        began: float | None = None
        end: float | None = None
        died = w.killed_at
        calls = False
        calling: float | None = None  # a receive call that started and has not returned
        ack_from: dict[str, float] = {}
        for ev in w.events():
            tag = ev[0]
            if tag == "READY" and len(ev) > 2:
                began = float(ev[2])
            elif tag == "RECV":
                ledger.deliver(ev[1], int(ev[2]), ev[3], holder=who, start=float(ev[4]),
                               deadline=float(ev[5]),
                               returned=None if ev[6] == "-" else float(ev[6]))
            elif tag == "ACKING":
                ack_from[ev[1]] = float(ev[2])
                ledger.settle(ev[1], ACK_STARTED, who, float(ev[2]))
            elif tag == "ACKED":
                ledger.settle(ev[1], ACKED, who, ack_from.get(ev[1], float(ev[2])))
            elif tag == "EXPIRED":
                ledger.settle(ev[1], LEASE_EXPIRED, who, float(ev[2]))
            elif tag == "LATE":
                history.unseen(ev[1], int(ev[2]), who, float(ev[3]))
            elif tag == "CALLING":
                calling = float(ev[1])
            elif tag == "CALL":
                calls = True
                calling = None
                history.receiving(who, float(ev[1]), float(ev[2]))
            elif tag == "KILL":
                died = float(ev[1])
            elif tag in ("DONE", "HELD") and len(ev) > 1 and end is None:
                end = float(ev[1])  # (a holder stops receiving once it holds its messages)
        if died is not None:
            history.killed(who, died)
            end = died if end is None else min(end, died)
            if calling is not None:
                history.cut_short(who, calling, died)
        for t0, t1 in w.freezes:
            assert t0 is not None
            history.frozen(who, t0, t1)
        if began is not None and not calls:
            history.receiving(who, began, end)


def snapshot(sub: mqabstract.Subscription) -> str:
    """What a stuck subscription is doing: the stacks of the client's threads (``mqa-``)
    and the size or value of each field of the driver's subscription object. Printed by
    ``drain`` when its limit passes with messages missing, so a failure that does not
    reproduce on demand still says where the consumer stood (diagnostic only)."""
    import traceback

    lines: list[str] = []

    def fields(obj: object, prefix: str, depth: int) -> None:
        for name, value in sorted(vars(obj).items()):
            if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
                with contextlib.suppress(Exception):
                    shown = sorted(map(str, value)) if len(value) <= 8 else "…"
                    lines.append(f"  {prefix}{name}: {len(value)} {shown}")
                    continue
            if isinstance(value, (int, float, bool, str, type(None))):
                lines.append(f"  {prefix}{name}: {value!r}"[:200])
            elif depth and type(value).__module__.split(".")[0] in ("backends", "mqabstract") \
                    and hasattr(value, "__dict__"):
                fields(value, f"{prefix}{name}.", depth - 1)  # a driver's part (split class)

    inner = getattr(sub, "_inner", None)
    if inner is not None:
        fields(inner, "", 1)
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if names.get(ident, "").startswith("mqa"):
            stack = "".join(traceback.format_stack(frame, limit=6))
            lines.append(f"  thread {names[ident]}:\n{stack}")
    return "\n".join([f"subscription {type(inner).__name__}:", *lines])


def drain(sub: mqabstract.Subscription, ledger: Ledger, quiet: float, limit: float,
          want: set[str] | None = None, errors: list[str] | None = None,
          holder: str = "here") -> None:
    """Receive and ack until ``want`` is finished and nothing came for ``quiet`` seconds.

    With *errors*, a retryable MQError of receive (a broker coming back) is recorded there
    and retried; any other error propagates. Receive calls and deliveries are recorded as
    ``holder``'s.
    """
    deadline = time.monotonic() + limit
    last = time.monotonic()
    while True:
        done = want is None or want <= ledger.acked | set(ledger.dead)
        if done and time.monotonic() - last >= quiet:
            return
        if time.monotonic() >= deadline:
            if not done:
                print(f"drain: {len((want or set()) - ledger.acked - set(ledger.dead))} wanted ids "
                      f"missing after {limit}s\n{snapshot(sub)}")
            return
        try:
            got = ledger.receive(sub, 20, 0.5, holder)
        except mqabstract.MQError as exc:
            if errors is None or not exc.retryable:
                raise
            errors.append(type(exc).__name__)
            time.sleep(0.3)
            continue
        for msg in got:
            last = time.monotonic()
            at = time.monotonic()
            try:
                msg.ack()
            except mqabstract.LeaseExpired:  # a slow broker: it comes back, attempt + 1
                ledger.settle(msg.id, LEASE_EXPIRED, holder, at)
                continue
            ledger.ack(msg.id, holder, at)


class Publisher(threading.Thread):
    """Publishes one message at a time, retrying a failed publish with the same id (the
    documented recovery), and records which publishes returned and which errors it saw."""

    def __init__(self, mq: mqabstract.Broker, topic: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self.mq, self.topic, self.prefix = mq, topic, prefix
        self.stop = threading.Event()
        self.confirmed: list[tuple[str, float]] = []  # (id, monotonic time it returned)
        self.errors: list[str] = []
        self.untyped: list[str] = []
        self.retried: set[str] = set()
        #: one entry per publish call that raised: a copy of that id may be on the broker
        self.failed: list[str] = []
        self.last_error = ""

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            mid = f"{self.prefix}-{n}"
            try:
                self.mq.publish(self.topic, body_for(mid), id=mid)
            except mqabstract.MQError as exc:
                self.errors.append(type(exc).__name__)
                self.last_error = str(exc)[:300]
                self.retried.add(mid)
                self.failed.append(mid)
                self.stop.wait(0.2)
                continue  # same id again
            except Exception as exc:  # a raw client exception leaked: a bug
                self.untyped.append(f"{type(exc).__name__}: {exc}")
                self.failed.append(mid)
                self.stop.wait(0.2)
                continue
            self.confirmed.append((mid, time.monotonic()))
            n += 1
            self.stop.wait(0.05)


def hold_some(mq: mqabstract.Broker, sub: mqabstract.Subscription, topic: str, tok: str,
              ledger: Ledger) -> list[mqabstract.Message]:
    """Publish 20 messages (``<tok>-a<i>``), receive 6 and ack every other one: the
    consumer then holds 3 unacked leases across the fault that follows."""
    before = mq.publish_batch([mqabstract.OutgoingMessage(topic, body_for(f"{tok}-a{i}"),
                                                          id=f"{tok}-a{i}")
                               for i in range(20)])
    for mid in before:
        ledger.confirm(mid, body_for(mid))
    held: list[mqabstract.Message] = []
    deadline = time.monotonic() + 30
    while len(held) < 6 and time.monotonic() < deadline:
        held += ledger.receive(sub, 6 - len(held), 1.0)
    for n, msg in enumerate(held):
        if n % 2 == 0:
            at = time.monotonic()
            msg.ack()
            ledger.ack(msg.id, t=at)
    return held


def ack_stale(held: list[mqabstract.Message], errors: list[str],
              ledger: Ledger | None = None) -> None:
    """Ack receipts taken before a fault: accepted (recorded in ``ledger``), or a typed
    error (recorded in ``errors``)."""
    for msg in held:
        at = time.monotonic()
        try:
            msg.ack()
        except mqabstract.MQError as exc:
            errors.append(type(exc).__name__)
            if ledger is not None and isinstance(exc, mqabstract.LeaseExpired):
                ledger.settle(msg.id, LEASE_EXPIRED, "here", at)
        else:
            if ledger is not None:
                ledger.ack(msg.id, t=at)


def collect_dead(broker: mqabstract.Broker, group: str, ledger: Ledger,
                 exhausted_too: tuple[str, ...] = ()) -> None:
    """Record the group's dead letters (id, attempts, reason) in the ledger's history.
    A dead letter ran out of attempts when its reason is one the portable layer writes for
    lease expiries and final nacks, or one of ``exhausted_too`` (e.g. the error the consume
    loop dead-letters a failing handler's message with on its last attempt)."""
    if not broker.capabilities.supports(mqabstract.Feature.DEAD_LETTER):
        return
    for dl in broker.dead_letters(group, limit=10_000):
        ledger.history.dead_letter(
            dl.id, dl.attempts, dl.reason,
            dl.reason.startswith(EXHAUSTED_PREFIXES) or dl.reason in exhausted_too)


#: Ports this process reserved (``spare_port``): their lock files stay open (and locked)
#: until the process ends.
_RESERVED: list[IO[bytes]] = []


def spare_port(start: int, also: tuple[int, ...] = ()) -> int:
    """First port from ``start`` that is free on loopback (with ``port + a`` for each a)
    and that no other live process reserved through this function: a lock file per port,
    held until this process ends. Two scenario processes starting private brokers at once
    (``scripts/faults`` lanes) both found a port free before either bound it."""
    import fcntl

    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "mqabstract-ports"
    folder.mkdir(parents=True, exist_ok=True)

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    def reserve(port: int) -> IO[bytes] | None:
        fh = open(folder / f"{port}.lock", "ab")  # noqa: SIM115 (held for the process)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            return None
        return fh

    for port in range(start, start + 100):
        if not (free(port) and all(free(port + a) for a in also)):
            continue
        held = [reserve(p) for p in (port, *(port + a for a in also))]
        if all(h is not None for h in held):
            _RESERVED.extend(h for h in held if h is not None)
            return port
        for h in held:
            if h is not None:
                h.close()  # (closing the file releases its lock)
    raise RuntimeError(f"no free loopback port near {start}")


def seed_for(name: str) -> int:
    """Seed of a scenario's randomness: ``$MQ_RELIABILITY_SEED`` or fresh (reported)."""
    env = os.environ.get("MQ_RELIABILITY_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "big")


def cleanup(broker: mqabstract.Broker, *groups: str) -> None:
    """Best-effort removal of a scenario's groups (shared brokers stay shallow)."""
    for group in groups:
        with contextlib.suppress(Exception):  # cleanup must not mask the test's result
            broker.delete_group(group)
