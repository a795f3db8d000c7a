"""Bookkeeping shared by the reliability tests: names, a delivery ledger, worker processes
and the JSON-lines report behind ``docs/reliability.md``."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import mqabstract

WORKER = str(Path(__file__).with_name("worker.py"))
REPO = Path(__file__).resolve().parents[2]

#: Lease used by fault tests: whole seconds (SQS granularity), short so redelivery is quick.
LEASE = 2.0

#: Backend aliases that are another client on a broker kind: alias -> (kind, URL query).
CLIENT_ALIASES = {"kafka-python": ("kafka", "client=kafka-python")}


def kind(backend: str) -> str:
    """The broker kind behind a backend alias (``kafka-python`` runs on ``kafka``)."""
    return CLIENT_ALIASES[backend][0] if backend in CLIENT_ALIASES else backend


def with_client(backend: str, url: str) -> str:
    """``url`` with the client the alias names (unchanged for plain kinds)."""
    if backend not in CLIENT_ALIASES:
        return url
    return url + ("&" if "?" in url else "?") + CLIENT_ALIASES[backend][1]


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


@dataclass
class Ledger:
    """What was published, delivered, acked and dead-lettered in one scenario.

    ``expected`` maps every id whose publish returned (confirmed) to its body digest;
    ``maybe`` holds ids whose publish was in flight when the publisher died.
    """

    expected: dict[str, str] = field(default_factory=dict)
    maybe: dict[str, str] = field(default_factory=dict)
    deliveries: list[tuple[str, int, str]] = field(default_factory=list)
    acked: set[str] = field(default_factory=set)
    acking: set[str] = field(default_factory=set)
    dead: dict[str, int] = field(default_factory=dict)
    #: ids the dead-letter listing showed more than once (id → entries): written twice
    dead_twice: dict[str, int] = field(default_factory=dict)
    order: list[tuple[str, str]] = field(default_factory=list)  #: ("D"|"A", id) in time order

    def confirm(self, mid: str, body: bytes) -> None:
        self.expected[mid] = digest(body)

    def deliver(self, mid: str, attempt: int, body_digest: str) -> None:
        self.deliveries.append((mid, attempt, body_digest))
        self.order.append(("D", mid))

    def ack(self, mid: str) -> None:
        self.acked.add(mid)
        self.order.append(("A", mid))

    # -- analysis ---------------------------------------------------------------------
    def duplicates(self) -> int:
        """Deliveries beyond the first of each id (redeliveries of any cause)."""
        return len(self.deliveries) - len({m for m, _, _ in self.deliveries})

    def after_ack(self) -> int:
        """Deliveries of an id after an ack of it had returned (allowed: at-least-once)."""
        acked: set[str] = set()
        count = 0
        for kind, mid in self.order:
            if kind == "A":
                acked.add(mid)
            elif mid in acked:
                count += 1
        return count

    def problems(self) -> list[str]:
        """Every broken invariant, as readable lines (empty when all hold)."""
        out: list[str] = []
        known = {**self.maybe, **self.expected}
        lost = sorted(self._lost())
        if lost:
            out.append(f"{len(lost)} confirmed messages neither acked nor dead-lettered: "
                       f"{lost[:5]}")
        strangers = sorted({m for m, _, _ in self.deliveries} - set(known))
        if strangers:
            out.append(f"delivered ids never published: {strangers[:5]}")
        wrong = sorted({m for m, _, d in self.deliveries if m in known and d != known[m]})
        if wrong:
            out.append(f"ids delivered with other bytes than published: {wrong[:5]}")
        undelivered_acks = sorted(self.acked - {m for m, _, _ in self.deliveries})
        if undelivered_acks:
            out.append(f"acked ids that were never delivered: {undelivered_acks[:5]}")
        per_id: dict[str, list[int]] = defaultdict(list)
        for mid, attempt, _ in self.deliveries:
            per_id[mid].append(attempt)
        # A publish retried with the same id after a lost confirm is a second copy on the
        # broker; its deliveries start again at attempt 1. Within each copy attempts grow.
        bad_attempts = {m: a for m, a in per_id.items()
                        if a[0] < 1 or any(y <= x and y != 1 for x, y in itertools.pairwise(a))}
        if bad_attempts:
            sample = dict(list(bad_attempts.items())[:3])
            out.append(f"attempts not strictly increasing per id: {sample}")
        counts: dict[str, int] = defaultdict(int)
        for mid, _, _ in self.deliveries:
            counts[mid] += 1
        if self.dead_twice:
            sample = dict(list(self.dead_twice.items())[:4])
            out.append(f"dead-lettered more than once (id: entries listed): {sample}")
        early = {m: (n, counts[m]) for m, n in self.dead.items() if counts[m] < n}
        if early:
            sample = dict(list(early.items())[:4])
            out.append("dead-lettered with more attempts than deliveries "
                       f"(id: (attempts, deliveries seen)): {sample}")
        return out

    def _lost(self) -> set[str]:
        """Confirmed ids neither acked nor dead-lettered. An id whose consumer was killed
        inside ack() (ACKING printed, ACKED not) may well be acked on the broker and then
        never comes back: that is finished (in doubt), not lost."""
        return set(self.expected) - self.acked - set(self.dead) - self.acking

    def summary(self) -> dict[str, Any]:
        settled = self.acked | set(self.dead)
        return {
            "confirmed": len(self.expected),
            "in_flight": len(self.maybe),
            "delivered": len(self.deliveries),
            "unique": len({m for m, _, _ in self.deliveries}),
            "duplicates": self.duplicates(),
            "redelivered_after_ack": self.after_ack(),
            "acked": len(self.acked),
            "dead_lettered": len(self.dead),
            "lost": len(self._lost()),
            "ack_in_doubt": len((set(self.expected) & self.acking) - settled),
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
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def tell(self, line: str = "go") -> None:
        """Write a line to the worker's stdin (``hold`` waits for one before settling)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL (no cleanup of any kind in the child), then reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.finish(30)

    def finish(self, timeout: float) -> int:
        """Wait for the process to exit and its output to be read; return the exit code."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
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
    ack what it held."""
    holder: Worker | None = None
    try:
        holder = Worker("hold", url, group, pattern, str(lease), str(held_n))
        assert holder.wait_for("HELD", 1, 120), holder.stderr
        holder.freeze()
        frozen_at = time.monotonic()
        events = holder.events()
        started = next(float(e[1]) for e in events if e[0] == "RECVAT")
        held = {e[1]: int(e[2]) for e in events if e[0] == "RECV"}
        for mid, attempt in held.items():
            ledger.deliver(mid, attempt, digest(body_for(mid)))
        arrived: dict[str, tuple[float, int]] = {}
        with mq.subscribe(group, pattern, lease=lease, max_attempts=50) as sub:
            limit = time.monotonic() + lease + margin + 60
            while set(ledger.expected) - ledger.acked and time.monotonic() < limit:
                for msg in sub.receive(100, 0.2):
                    ledger.deliver(msg.id, msg.attempt, digest(msg.body))
                    if msg.id in held:
                        arrived.setdefault(msg.id, (time.monotonic(), msg.attempt))
                    msg.ack()
                    ledger.ack(msg.id)
            time.sleep(max(0.0, frozen_at + frozen_for - time.monotonic()))
            frozen_s = time.monotonic() - frozen_at
            holder.thaw()
            holder.tell()
            code = holder.finish(60)
        after = [e for e in holder.events() if e[0] in ("ACKED", "EXPIRED")]
        return Frozen(held, arrived, started, frozen_s, code, holder.stderr, after)
    finally:
        if holder is not None and holder.proc.poll() is None:
            holder.thaw()
            holder.kill()


def feed(ledger: Ledger, *workers: Worker) -> None:
    """Add consumer workers' RECV / ACKED lines to the ledger (after they exited), merged
    in time order when they ran at the same time (the lines carry time.monotonic())."""
    lines = [ev for w in workers for ev in w.events()]
    if len(workers) > 1:
        stamped = [ev for ev in lines if ev[0] in ("RECV", "ACKED")]
        lines = [ev for ev in lines if ev[0] not in ("RECV", "ACKED")]
        lines += sorted(stamped, key=lambda ev: float(ev[-1]))
    for ev in lines:
        if ev[0] == "RECV":
            ledger.deliver(ev[1], int(ev[2]), ev[3])
        elif ev[0] == "ACKED":
            ledger.ack(ev[1])
        elif ev[0] == "ACKING":
            ledger.acking.add(ev[1])


def drain(sub: mqabstract.Subscription, ledger: Ledger, quiet: float, limit: float,
          want: set[str] | None = None, errors: list[str] | None = None) -> None:
    """Receive and ack until ``want`` is finished and nothing came for ``quiet`` seconds.

    With *errors*, a retryable MQError of receive (a broker coming back) is recorded there
    and retried; any other error propagates.
    """
    deadline = time.monotonic() + limit
    last = time.monotonic()
    while time.monotonic() < deadline:
        done = want is None or want <= ledger.acked | set(ledger.dead)
        if done and time.monotonic() - last >= quiet:
            return
        try:
            got = sub.receive(20, 0.5)
        except mqabstract.MQError as exc:
            if errors is None or not exc.retryable:
                raise
            errors.append(type(exc).__name__)
            time.sleep(0.3)
            continue
        for msg in got:
            last = time.monotonic()
            ledger.deliver(msg.id, msg.attempt, digest(msg.body))
            try:
                msg.ack()
            except mqabstract.LeaseExpired:  # a slow broker: it comes back, attempt + 1
                continue
            ledger.ack(msg.id)


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
                self.stop.wait(0.2)
                continue  # same id again
            except Exception as exc:  # a raw client exception leaked: a bug
                self.untyped.append(f"{type(exc).__name__}: {exc}")
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
        held += sub.receive(6 - len(held), 1.0)
    for n, msg in enumerate(held):
        ledger.deliver(msg.id, msg.attempt, digest(msg.body))
        if n % 2 == 0:
            msg.ack()
            ledger.ack(msg.id)
    return held


def ack_stale(held: list[mqabstract.Message], errors: list[str]) -> None:
    """Ack receipts taken before a fault: accepted, or a typed error (recorded)."""
    for msg in held:
        try:
            msg.ack()
        except mqabstract.MQError as exc:
            errors.append(type(exc).__name__)


def collect_dead(broker: mqabstract.Broker, group: str, ledger: Ledger) -> None:
    """Record the group's dead letters (id → attempts) in the ledger, and each id listed
    more than once (at most one dead letter per id: the checker reports the others)."""
    if not broker.capabilities.supports(mqabstract.Feature.DEAD_LETTER):
        return
    listed: Counter[str] = Counter()
    for dl in broker.dead_letters(group, limit=10_000):
        listed[dl.id] += 1
        ledger.dead.setdefault(dl.id, dl.attempts)
    ledger.dead_twice.update({mid: n for mid, n in listed.items() if n > 1})


def spare_port(start: int, also: tuple[int, ...] = ()) -> int:
    """First port from ``start`` that is free on loopback (with ``port + a`` for each a)."""
    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    for port in range(start, start + 100):
        if free(port) and all(free(port + a) for a in also):
            return port
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
