"""In-process reference backend (``memory://name``): the contract, every feature native.

It is a product, not a mock: thread-safe, blocking receive woken by publish (no polling),
and every operation O(1) or O(log n) in the number of queued messages:

* ready messages: one FIFO deque per priority level, popped highest first — O(1);
* delayed messages and leases: heaps with lazy deletion, compacted when stale entries
  outnumber live ones — O(log n) amortised;
* ordered groups: a FIFO per key; only the oldest unfinished message of a key is
  schedulable, so same-key messages go out in publish order, one at a time.

All connections to the same ``memory://name`` in one process share one hub (``memory://``
is the hub named ""). Nothing survives the process.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from mqabstract import wire
from mqabstract.capabilities import Capabilities
from mqabstract.clock import Clock, SystemClock
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.emulation import Routes, replay_headers
from mqabstract.errors import Closed, InvalidArgument, NotFound
from mqabstract.model import DeadLetter, Delivery, Envelope, GroupSpec, GroupStats, utc
from mqabstract.options import CLOCK, Option, parse_options
from mqabstract.url import BrokerURL

__all__ = ["MemoryDriver"]

_READY, _DELAYED, _LEASED, _WAITING, _DONE, _DEAD = range(6)
_LEVELS = 10


class _Entry:
    """One message's state in one group (the envelope itself is shared between groups)."""

    __slots__ = ("attempt", "due", "env", "lease_until", "seq", "state", "token")

    def __init__(self, env: Envelope, seq: int) -> None:
        self.env = env
        self.seq = seq
        self.attempt = 0  # deliveries so far
        self.state = _READY
        self.token = 0  # bumped on every lease; receipts carry it to detect staleness
        self.due = 0.0
        self.lease_until = 0.0


class _DeadRecord:
    __slots__ = ("at", "attempts", "entry", "reason")

    def __init__(self, entry: _Entry, reason: str, attempts: int, at: float) -> None:
        self.entry = entry
        self.reason = reason
        self.attempts = attempts
        self.at = at


class _Group:
    def __init__(self, spec: GroupSpec, lock: threading.Lock) -> None:
        self.spec = spec
        self.cond = threading.Condition(lock)
        self.ready: list[deque[_Entry]] = [deque() for _ in range(_LEVELS)]
        self.ready_count = 0
        self.delayed: list[tuple[float, int, _Entry]] = []
        self.delayed_live = 0
        self.leases: list[tuple[float, int, int, _Entry]] = []
        self.leased_live = 0
        self.key_waiting: dict[str, deque[_Entry]] = {}  # ordered groups: key -> queued behind head
        self.waiting_count = 0
        self.dead: dict[int, _DeadRecord] = {}
        self.deleted = False


class _Hub:
    """The shared state of one ``memory://name``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.groups: dict[str, _Group] = {}
        self.routes: Routes[_Group] = Routes()
        self.seq = itertools.count(1)
        clock.on_advance(self.wake_all)

    def wake_all(self) -> None:
        with self.lock:
            for g in self.groups.values():
                g.cond.notify_all()

    # -- scheduling (lock held) ---------------------------------------------------------
    def place(self, g: _Group, e: _Entry, now: float) -> None:
        """Make ``e`` ready now or at its due time."""
        if e.due > now:
            e.state = _DELAYED
            heapq.heappush(g.delayed, (e.due, next(self.seq), e))
            g.delayed_live += 1
            if g.delayed[0][2] is e:
                g.cond.notify_all()  # an earlier wake-up time for sleepers
        else:
            e.state = _READY
            g.ready[e.env.priority].append(e)
            g.ready_count += 1
            g.cond.notify()

    def enqueue(self, g: _Group, e: _Entry, now: float) -> None:
        key = e.env.key
        if g.spec.ordered and key is not None:
            waiting = g.key_waiting.get(key)
            if waiting is not None:  # an older message of this key is unfinished
                e.state = _WAITING
                waiting.append(e)
                g.waiting_count += 1
                return
            g.key_waiting[key] = deque()
        self.place(g, e, now)

    def finish(self, g: _Group, e: _Entry, now: float) -> None:
        """``e`` left the group (acked / dead): release the next message of its key."""
        key = e.env.key
        if not (g.spec.ordered and key is not None):
            return
        waiting = g.key_waiting.get(key)
        if waiting is None:
            return
        if waiting:
            nxt = waiting.popleft()
            g.waiting_count -= 1
            self.place(g, nxt, now)
        else:
            del g.key_waiting[key]

    def promote(self, g: _Group, now: float) -> None:
        """Move due delayed messages and expired leases to ready."""
        delayed = g.delayed
        while delayed and delayed[0][0] <= now:
            due, _, e = heapq.heappop(delayed)
            if e.state == _DELAYED and e.due == due:
                g.delayed_live -= 1
                e.state = _READY
                g.ready[e.env.priority].append(e)
                g.ready_count += 1
        leases = g.leases
        while leases and leases[0][0] <= now:
            until, _, token, e = heapq.heappop(leases)
            if e.state == _LEASED and e.token == token and e.lease_until == until:
                g.leased_live -= 1
                e.state = _READY
                g.ready[e.env.priority].append(e)
                g.ready_count += 1
        # Lazy deletion leaves stale heap entries; rebuild when they dominate.
        if len(leases) > 2 * g.leased_live + 1024:
            g.leases = [t for t in leases if t[3].state == _LEASED and t[3].token == t[2]
                        and t[3].lease_until == t[0]]
            heapq.heapify(g.leases)
        if len(delayed) > 2 * g.delayed_live + 1024:
            g.delayed = [t for t in delayed if t[2].state == _DELAYED and t[2].due == t[0]]
            heapq.heapify(g.delayed)

    def next_event(self, g: _Group) -> float | None:
        times = []
        if g.delayed:
            times.append(g.delayed[0][0])
        if g.leases:
            times.append(g.leases[0][0])
        return min(times) if times else None


_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()


class _MemorySubscription(DriverSubscription):
    def __init__(self, driver: MemoryDriver, group: _Group) -> None:
        self._driver = driver
        self._hub = driver._hub
        self._group = group
        self._closed = False

    def _live(self) -> _Group:
        if self._closed or self._driver._closed:
            raise Closed("subscription is closed")
        if self._group.deleted:
            raise NotFound(f"group {self._group.spec.name!r} was deleted")
        return self._group

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        hub = self._hub
        clock = hub.clock
        deadline = time.monotonic() + timeout
        with hub.lock:
            while True:
                g = self._live()
                now = clock.time()
                hub.promote(g, now)
                if g.ready_count:
                    return self._take(g, max_messages, now)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                nxt = hub.next_event(g)
                if nxt is not None:
                    remaining = min(remaining, max(0.0, nxt - now) + 0.0005)
                g.cond.wait(remaining)

    def _take(self, g: _Group, n: int, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        until = now + g.spec.lease
        seq = self._hub.seq
        for level in range(_LEVELS - 1, -1, -1):
            q = g.ready[level]
            while q and len(out) < n:
                e = q.popleft()
                g.ready_count -= 1
                e.state = _LEASED
                e.attempt += 1
                e.token = token = next(seq)
                e.lease_until = until
                heapq.heappush(g.leases, (until, token, token, e))
                g.leased_live += 1
                env = e.env
                out.append(Delivery(env.id, env.topic, env.body, env.headers, env.key,
                                    env.priority, e.attempt, env.published_at, (e, token)))
            if len(out) >= n:
                break
        if g.ready_count:
            g.cond.notify()  # let a competing consumer take the rest
        return out

    def _valid(self, receipt: tuple[_Entry, int]) -> _Entry | None:
        e, token = receipt
        if e.state == _LEASED and e.token == token:
            return e
        return None

    def ack(self, receipts: Sequence[Any]) -> None:
        hub = self._hub
        with hub.lock:
            g = self._live()
            now = hub.clock.time()
            for receipt in receipts:
                e = self._valid(receipt)
                if e is not None:
                    e.state = _DONE
                    g.leased_live -= 1
                    hub.finish(g, e, now)

    def nack(self, receipt: Any, delay: float) -> None:
        hub = self._hub
        with hub.lock:
            g = self._live()
            e = self._valid(receipt)
            if e is not None:
                g.leased_live -= 1
                now = hub.clock.time()
                e.due = now + delay if delay > 0 else 0.0
                hub.place(g, e, now)

    def extend(self, receipt: Any, seconds: float) -> None:
        hub = self._hub
        with hub.lock:
            g = self._live()
            e = self._valid(receipt)
            if e is not None:
                e.lease_until = until = hub.clock.time() + seconds
                heapq.heappush(g.leases, (until, next(hub.seq), e.token, e))

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        hub = self._hub
        with hub.lock:
            g = self._live()
            e = self._valid(receipt)
            if e is not None:
                e.state = _DEAD
                g.leased_live -= 1
                now = hub.clock.time()
                g.dead[e.seq] = _DeadRecord(e, reason, attempts, now)
                hub.finish(g, e, now)

    def close(self) -> None:
        self._closed = True


class MemoryDriver(Driver):
    """Driver for ``memory://name``; see the module docstring."""

    name = "memory"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "clock": CLOCK,
    }
    CAPABILITIES = Capabilities.all_native(
        max_body_bytes=16 * 1024 * 1024,
        max_headers=64,
        max_header_bytes=64 * 1024,
        max_delay=365 * 86400.0,
        max_batch=10_000,
        max_receive=1000,
        max_lease=12 * 3600.0,
        min_lease=0.01,
        shared_between_processes=False,
        durable=False,
        key_gate="broker",  # a FIFO per key, only its head deliverable
    )

    def __init__(self, hub: _Hub) -> None:
        self._hub = hub
        self.clock = hub.clock
        self._closed = False

    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> MemoryDriver:
        opts = parse_options(url, options, cls.OPTIONS, cls.name)
        clock = opts["clock"]
        name = "/".join(h for h, _ in url.hosts) + url.path
        with _hubs_lock:
            hub = _hubs.get(name)
            if hub is None:
                hub = _hubs[name] = _Hub(clock or SystemClock())
            elif clock is not None and hub.clock is not clock:
                raise InvalidArgument(
                    f"memory://{name} already runs on another clock; use a new hub name"
                )
        return cls(hub)

    @property
    def capabilities(self) -> Capabilities:
        return self.CAPABILITIES

    def _check(self) -> None:
        if self._closed:
            raise Closed("memory broker is closed")

    def _group(self, name: str) -> _Group:
        g = self._hub.groups.get(name)
        if g is None:
            raise NotFound(f"no group {name!r}")
        return g

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        hub = self._hub
        with hub.lock:
            self._check()
            now = hub.clock.time()
            seq = hub.seq
            groups_for = hub.routes.groups_for
            for env in envelopes:
                for g in groups_for(env.topic):
                    e = _Entry(env, next(seq))
                    if env.deliver_at is not None:
                        e.due = env.deliver_at
                    hub.enqueue(g, e, now)

    def declare(self, spec: GroupSpec) -> None:
        hub = self._hub
        with hub.lock:
            self._check()
            existing = hub.groups.get(spec.name)
            if existing is not None:
                if existing.spec.pattern != spec.pattern:
                    raise InvalidArgument(
                        f"group {spec.name!r} exists with pattern {existing.spec.pattern!r}"
                    )
                existing.spec = spec  # policy (lease, attempts) follows the latest declaration
                return
            g = _Group(spec, hub.lock)
            hub.routes.add(g, spec.pattern)
            hub.groups[spec.name] = g

    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        with self._hub.lock:
            self._check()
            return _MemorySubscription(self, self._group(spec.name))

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        with self._hub.lock:
            self._check()
            records = list(self._group(group).dead.values())[:limit]
        return [
            DeadLetter(r.entry.env.id, r.entry.env.topic, r.entry.env.body, r.entry.env.headers,
                       r.entry.env.key, r.entry.env.priority, utc(r.entry.env.published_at),
                       r.attempts, r.reason, utc(r.at))
            for r in records
        ]

    def _take_dead(self, g: _Group, ids: Collection[str] | None) -> list[_DeadRecord]:
        picked = [s for s, r in g.dead.items() if ids is None or r.entry.env.id in ids]
        return [g.dead.pop(s) for s in picked]

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        hub = self._hub
        with hub.lock:
            self._check()
            g = self._group(group)
            records = self._take_dead(g, ids)
            now = hub.clock.time()
            for r in records:
                env = r.entry.env
                if wire.EXPIRES_AT in env.headers:  # replayed: its TTL is over
                    env = dataclasses.replace(env, headers=replay_headers(env.headers))
                e = _Entry(env, next(hub.seq))  # a fresh start: attempt 1 next
                hub.enqueue(g, e, now)
            return len(records)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        with self._hub.lock:
            self._check()
            return len(self._take_dead(self._group(group), ids))

    def ping(self) -> None:
        """In process: nothing to reach (the hub's lock is the only round trip)."""
        with self._hub.lock:
            pass

    def stats(self, group: str) -> GroupStats:
        hub = self._hub
        with hub.lock:
            self._check()
            g = self._group(group)
            hub.promote(g, hub.clock.time())
            return GroupStats(group, g.ready_count + g.waiting_count, g.leased_live,
                              g.delayed_live, len(g.dead))

    def groups(self) -> list[str]:
        with self._hub.lock:
            self._check()
            return list(self._hub.groups)

    def delete_group(self, group: str) -> None:
        hub = self._hub
        with hub.lock:
            self._check()
            g = hub.groups.pop(group, None)
            if g is None:
                raise NotFound(f"no group {group!r}")
            g.deleted = True
            hub.routes.remove(g)
            g.cond.notify_all()

    def close(self) -> None:
        self._closed = True
        self._hub.wake_all()
