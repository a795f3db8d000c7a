"""One history checker for every fault scenario (DESIGN: "Reliability: one history checker").

A scenario records a :class:`History` of what it saw — publishes, deliveries, settles,
fault events, the broker's dead letters at the end and, for dedupe scenarios, the side
effects per id — and :func:`check` judges it against every rule, returning readable
violations (empty: all rules hold). Each rule is a function of its own (``RULES``), so each
can be tested alone (``tests/test_history.py``). A violation starts with ``[rule]``.

Times are ``time.monotonic()`` readings. On Linux that clock (CLOCK_MONOTONIC) is one
clock for the whole machine, so times printed by worker processes and times taken in the
test process are comparable. Comparisons of two times allow ``TOLERANCE`` (10 ms) for
timestamp granularity: a time printed by another process is taken a little before or after
the event it stands for (a ``print`` and a pipe in between).

Rules:

``lost``
    Every confirmed id is acked, dead-lettered, or its ack is in doubt (its holder was
    killed inside ``ack()``: started, never returned). Nothing is delivered that was never
    published, nor with other bytes than published; nothing is acked that was never
    delivered.
``attempts``
    Per id, attempts strictly increase in delivery order: the order in which the receive
    calls handed the deliveries over. The history knows each hand-over only to within its
    receive call, between the call's start (the lease origin) and its return (a call
    whose return is unknown: at its start). Where two calls do not overlap their order is
    known; where they do (a call that waited, as a long poll does, while another one
    returned at once from its buffer), either order is possible, and the attempts must fit
    one of them: in attempt order, each delivery handed over no earlier than the one
    before it, and one holder's in the order it received them (its calls run one after
    another; one call returns its messages in order). So one attempt twice is always a
    violation, and so are a lower attempt returned by a call that started after the call
    with the higher one had returned, and a lower attempt after a higher one to the same
    holder (two copies of one id in one receive call, as in the cut runs).
    (Ordering by the start alone, as before, took a waiting call's later hand-over for an
    earlier one: attempt 1 returned at once to w4, w4 killed, its message given back,
    counted, to w2's call that had been waiting since before, read as "2, then 1".) An id
    published more than once (a retry of a publish that failed or was never confirmed:
    each attempt is recorded, confirmed or maybe) is more than one message on the broker:
    its attempts may start again at 1 once per extra copy, and its deliveries are taken in
    receive-start order.
``second-holder``
    No second holder while an earlier holder's lease is valid, in delivery order (as for
    ``attempts``): a delivery must not be
    handed over before the previous delivery's lease deadline unless that previous
    delivery was settled (acked, nacked, dead-lettered) before, or its holder was gone by
    then (killed, or its session with the broker lost: a broker restart or a cut connection
    ends every lease it granted). A frozen holder is not gone: its lease stays valid until
    its deadline. The hand-over happened between the start of the receive call and its
    return, so "before the deadline" means: the receive call had returned before it (a
    call that started before the deadline and waited for the message, as a long poll
    does, is right); a delivery whose return time is unknown is judged by its start.
    Ids published more than once are not judged (two copies are two messages, each with
    its own lease).
``release``
    A frozen or killed holder's messages are delivered again in time: for every delivery
    whose holder was killed, or frozen across its lease deadline, before settling it, the
    next delivery of that id starts no later than ``max(lease deadline, first moment
    another consumer was receiving) + release_margin`` (the backend's declared
    ``Capabilities.release_margin``). "Receiving" is a recorded receive window of another
    holder (a receive call: from its start to its return; or a span in which it looped on
    receive), minus its freezes and anything after its death; the receive call of each
    delivery counts too. A consumer busy with its own batch is not receiving, and one that
    is killed or frozen within the margin after that moment does not count (it could not
    have been given the message: the clock starts with the next one). When the next
    recorded delivery skips attempts, a delivery nobody recorded came between (a receive
    call a kill cut short, or a late one): the release was in time if such a call started
    by the bound. When the clock
    starts is the backend's documented formula (``release_clock``): ``deadline`` as above;
    ``membership`` (Kafka: every member that joins, leaves, stops or wakes starts a
    rebalance that stops the group's deliveries, so the margin counts again from the last
    such event — kills, freezes, thaws and a consumer's first receive); ``unfrozen``
    (SQLite: a stopped process may hold the file's write lock, which nobody can take from
    it, so the clock does not run while any process is frozen).
``dead-letters``
    Dead letters caused by running out of attempts (lease expiries or nacks on the final
    attempt, or whatever reason the scenario marks as exhausted) carry exactly
    ``max_attempts``; no delivery carries more than ``max_attempts``; no dead letter
    records more attempts than deliveries were recorded; each id is dead-lettered at most
    once unless the check is told why the backend declares duplicates possible. Late
    deliveries (``History.late``: a receive call that returned after the lease ended; the
    portable layer hands them to nobody and settles none, as the lease rule says) count as
    deliveries, and one past ``max_attempts`` moves that id's dead letter to its attempt:
    nobody could dead-letter a delivery nobody was given. A receive call a kill cut short
    (``History.cut``) may have cost any message one delivery nobody read: each such call
    allows one more attempt than recorded, and no more.
``effects``
    Dedupe scenarios: each confirmed id's side effect happened exactly once, and none
    happened for an id never published.

Where a scenario cannot supply what a rule needs, it passes ``skip={rule: why}`` to
:func:`check`; a rule that lacks data and was not skipped reports that as a violation.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

#: Seconds of slack when comparing two recorded times (print and pipe latency, see above).
TOLERANCE = 0.010

#: Settle outcomes. ``ack-started``: an ack call began (pairs with a later ``acked`` or
#: ``lease-expired`` of the same holder, or stays open if the holder died inside it).
ACKED, NACKED, DEAD_LETTERED, LEASE_EXPIRED, ACK_STARTED = (
    "acked", "nacked", "dead-lettered", "lease-expired", "ack-started")
OUTCOMES = (ACKED, NACKED, DEAD_LETTERED, LEASE_EXPIRED, ACK_STARTED)
#: Outcomes that end a lease on the broker (a settle that took effect).
EFFECTIVE = (ACKED, NACKED, DEAD_LETTERED)

#: Reasons the portable layer writes when a message ran out of attempts
#: (mqabstract/subscription.py).
EXHAUSTED_PREFIXES = ("max attempts (", "nacked on final attempt (")

#: Fault kinds: a holder killed (SIGKILL, a crash), frozen (SIGSTOP; ``until`` None: never
#: woke within the history), or its broker session lost (broker restart, connection cut).
KILLED, FROZEN, SESSION_LOST = "killed", "frozen", "session-lost"


@dataclass(frozen=True)
class Publish:
    id: str
    digest: str
    confirmed: bool  #: the publish call returned; False: in flight or failed ("maybe")


@dataclass(frozen=True)
class Delivery:
    id: str
    attempt: int
    holder: str  #: who received it: a worker's "pid<N>", "here", a subscription's name
    start: float  #: start of the receive call that returned it (the lease origin)
    deadline: float  #: its lease deadline
    digest: str
    #: when that receive call had returned (at the latest: a later reading is fine; None:
    #: unknown, then ``start`` stands for it)
    returned: float | None = None
    seq: int = 0  #: recording order (breaks ties of equal starts)


@dataclass(frozen=True)
class Settle:
    id: str
    holder: str
    outcome: str
    t: float  #: when the settle call started (the earliest it can have taken effect)


@dataclass(frozen=True)
class Fault:
    holder: str
    kind: str
    at: float
    until: float | None = None  #: end of a freeze (None: frozen to the end)


@dataclass(frozen=True)
class Window:
    """A holder was receiving from ``start`` to ``end``: one receive call, or a span in
    which it looped on receive (where the calls themselves are not recorded)."""

    holder: str
    start: float
    end: float | None = None  #: None: to the end of the history


@dataclass(frozen=True)
class DeadLetter:
    id: str
    attempts: int
    reason: str
    exhausted: bool  #: dead-lettered for running out of attempts (not an explicit call)


@dataclass
class History:
    """What one scenario saw. ``max_attempts`` is the group's; ``effects`` (id → count) is
    set by dedupe scenarios only."""

    max_attempts: int | None = None
    publishes: list[Publish] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    settles: list[Settle] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    effects: dict[str, int] | None = None
    #: deliveries nobody saw: a receive call returned them after their lease had ended, so
    #: the portable layer handed them to no one (and could settle none), but the broker
    #: counted each (id, attempt, holder, when)
    late: list[tuple[str, int, str, float]] = field(default_factory=list)
    #: receive calls a kill cut short (holder, start, death): the broker may have counted a
    #: delivery of each message it was sending them, which no process ever read
    cut: list[tuple[str, float, float]] = field(default_factory=list)

    # -- recording ---------------------------------------------------------------------
    def publish(self, mid: str, digest: str, confirmed: bool = True) -> None:
        self.publishes.append(Publish(mid, digest, confirmed))

    def deliver(self, mid: str, attempt: int, holder: str, start: float, deadline: float,
                digest: str, returned: float | None = None) -> None:
        self.deliveries.append(Delivery(mid, attempt, holder, start, deadline, digest,
                                        returned, len(self.deliveries)))

    def cut_short(self, holder: str, start: float, died: float) -> None:
        """Record a receive call that ``holder`` was in when it was killed (see ``cut``)."""
        self.cut.append((holder, start, died))

    def unseen(self, mid: str, attempt: int, holder: str, t: float) -> None:
        """Record a delivery a late receive call dropped (see ``late``)."""
        self.late.append((mid, attempt, holder, t))

    def settle(self, mid: str, holder: str, outcome: str, t: float) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown settle outcome {outcome!r}")
        self.settles.append(Settle(mid, holder, outcome, t))

    def killed(self, holder: str, at: float) -> None:
        self.faults.append(Fault(holder, KILLED, at))

    def frozen(self, holder: str, at: float, until: float | None) -> None:
        self.faults.append(Fault(holder, FROZEN, at, until))

    def session_lost(self, holder: str, at: float) -> None:
        self.faults.append(Fault(holder, SESSION_LOST, at))

    def receiving(self, holder: str, start: float, end: float | None = None) -> None:
        self.windows.append(Window(holder, start, end))

    def dead_letter(self, mid: str, attempts: int, reason: str,
                    exhausted: bool | None = None) -> None:
        """Record one of the broker's dead letters; ``exhausted`` defaults to whether the
        reason is one the portable layer writes when attempts ran out."""
        if exhausted is None:
            exhausted = reason.startswith(EXHAUSTED_PREFIXES)
        self.dead_letters.append(DeadLetter(mid, attempts, reason, exhausted))

    def effect(self, mid: str, count: int = 1) -> None:
        if self.effects is None:
            self.effects = {}
        self.effects[mid] = self.effects.get(mid, 0) + count

    def to_json(self) -> dict[str, object]:
        """The whole history as JSON-able data (for a failed scenario's post-mortem)."""
        return dataclasses.asdict(self)

    # -- views -------------------------------------------------------------------------
    def confirmed(self) -> dict[str, str]:
        """Confirmed ids → body digest."""
        return {p.id: p.digest for p in self.publishes if p.confirmed}

    def copies(self) -> dict[str, int]:
        """Id → how many publishes of it were recorded (confirmed or maybe)."""
        out: dict[str, int] = defaultdict(int)
        for p in self.publishes:
            out[p.id] += 1
        return out

    def acked(self) -> set[str]:
        return {s.id for s in self.settles if s.outcome == ACKED}

    def by_id(self) -> dict[str, list[Delivery]]:
        """Each id's deliveries in delivery order (module docstring, ``attempts``): in
        attempt order where their receive calls allow that order, else (and for ids
        published more than once) ordered by the start of their receive call."""
        copies = self.copies()
        out: dict[str, list[Delivery]] = defaultdict(list)
        for d in sorted(self.deliveries, key=lambda d: (d.start, d.seq)):
            out[d.id].append(d)
        for mid, ds in out.items():
            if len(ds) > 1 and copies.get(mid, 0) <= 1:
                by_attempt = sorted(ds, key=lambda d: (d.attempt, d.start, d.seq))
                if by_attempt != ds and _fits_calls(by_attempt):
                    out[mid] = by_attempt
        return out

    def settles_of(self) -> dict[tuple[str, str], list[Settle]]:
        """(id, holder) → its settles in record order: the rules look settles up by both,
        and a scan of every settle per delivery made the checker quadratic (40 s of an
        8,000-message chaos run)."""
        out: dict[tuple[str, str], list[Settle]] = defaultdict(list)
        for s in self.settles:
            out[(s.id, s.holder)].append(s)
        return out

    def in_doubt(self) -> set[str]:
        """Ids whose ack started and never returned because the holder was killed first."""
        kills = self._deaths()
        index = self.settles_of()
        out: set[str] = set()
        for s in self.settles:
            if s.outcome != ACK_STARTED:
                continue
            ended = any(o.t >= s.t - TOLERANCE and o.outcome in (ACKED, LEASE_EXPIRED)
                        for o in index[(s.id, s.holder)])
            died = kills.get(s.holder)
            if not ended and died is not None and died >= s.t - TOLERANCE:
                out.add(s.id)
        return out

    def _deaths(self) -> dict[str, float]:
        """Holder → when it was killed (the first time)."""
        out: dict[str, float] = {}
        for f in self.faults:
            if f.kind == KILLED:
                out[f.holder] = min(f.at, out.get(f.holder, math.inf))
        return out

    def _gone(self) -> dict[str, list[float]]:
        """Holder → times its leases ended without a settle (killed, session lost)."""
        out: dict[str, list[float]] = defaultdict(list)
        for f in self.faults:
            if f.kind in (KILLED, SESSION_LOST):
                out[f.holder].append(f.at)
        return out


def _fits_calls(ds: list[Delivery]) -> bool:
    """Whether deliveries could have been handed over in this order: each one within its
    receive call (start .. return; start, if the return is unknown) and no earlier than
    the one before it, and one holder's in the order it received them (its calls one after
    another, a call's messages in the order it returned them)."""
    t = -math.inf
    last: dict[str, tuple[float, int]] = {}
    for d in ds:
        t = max(t, d.start)
        if t > (d.start if d.returned is None else d.returned) + TOLERANCE:
            return False
        if last.get(d.holder, (-math.inf, -1)) > (d.start, d.seq):
            return False
        last[d.holder] = (d.start, d.seq)
    return True


def _sample(items: Iterable[object], n: int = 5) -> str:
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(map(str, items[:n])) + more


def _t(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


# -- a. nothing confirmed is lost --------------------------------------------------------
def rule_lost(h: History) -> list[str]:
    out: list[str] = []
    confirmed = h.confirmed()
    digests: dict[str, set[str]] = defaultdict(set)
    for p in h.publishes:
        digests[p.id].add(p.digest)
    dead = {d.id for d in h.dead_letters}
    lost = sorted(set(confirmed) - h.acked() - dead - h.in_doubt())
    if lost:
        out.append(f"[lost] {len(lost)} confirmed ids neither acked, dead-lettered nor "
                   f"acked in doubt (holder killed inside ack): {_sample(lost)}")
    delivered = {d.id for d in h.deliveries}
    strangers = sorted(delivered - set(digests))
    if strangers:
        out.append(f"[lost] delivered ids never published: {_sample(strangers)}")
    wrong = sorted({d.id for d in h.deliveries if d.id in digests
                    and d.digest not in digests[d.id]})
    if wrong:
        out.append(f"[lost] ids delivered with other bytes than published: {_sample(wrong)}")
    ghost = sorted(h.acked() - delivered)
    if ghost:
        out.append(f"[lost] acked ids that were never delivered: {_sample(ghost)}")
    return out


# -- b. attempts strictly increase per id -------------------------------------------------
def rule_attempts(h: History) -> list[str]:
    copies = h.copies()
    bad: list[str] = []
    for mid, ds in h.by_id().items():
        restarts = max(0, copies.get(mid, 1) - 1)
        seq = [d.attempt for d in ds]
        broken = seq[0] < 1
        for prev, nxt in itertools.pairwise(ds):
            if nxt.attempt > prev.attempt:
                continue
            if nxt.attempt == 1 and restarts > 0:
                restarts -= 1  # the next copy of an id published again
                continue
            broken = True
        if broken:
            where = ", ".join(f"{d.attempt}@{d.start:.3f}..{_t(d.returned)}/{d.holder}"
                              for d in ds)
            bad.append(f"{mid} [{where}] ({copies.get(mid, 0)} publish(es))")
    if not bad:
        return []
    return [f"[attempts] attempts not strictly increasing per id in delivery order "
            f"(attempt@call start..return/holder, in that order): {_sample(bad, 4)}"]


# -- c. no second holder while a lease is valid -------------------------------------------
def rule_second_holder(h: History) -> list[str]:
    copies = h.copies()
    settles: dict[tuple[str, str], list[Settle]] = defaultdict(list)
    for s in h.settles:
        if s.outcome in EFFECTIVE:
            settles[(s.id, s.holder)].append(s)
    gone = h._gone()
    bad: list[str] = []
    for mid, ds in h.by_id().items():
        if copies.get(mid, 0) > 1:
            continue  # two copies, two leases: see the module docstring
        for prev, nxt in itertools.pairwise(ds):
            handed = nxt.returned if nxt.returned is not None else nxt.start
            if handed >= prev.deadline - TOLERANCE:
                continue
            handed += TOLERANCE
            settled = any(prev.start - TOLERANCE <= s.t <= handed
                          for s in settles[(mid, prev.holder)])
            ended = any(prev.start - TOLERANCE <= t <= handed for t in gone[prev.holder])
            if not (settled or ended):
                bad.append(f"{mid}: attempt {prev.attempt} held by {prev.holder} until "
                           f"{prev.deadline:.3f}, attempt {nxt.attempt} to {nxt.holder} "
                           f"by a receive call {nxt.start:.3f}..{_t(nxt.returned)}, "
                           f"{prev.deadline - handed + TOLERANCE:.3f}s early")
    if not bad:
        return []
    return [f"[second-holder] delivered again while an earlier holder's lease was valid and "
            f"unsettled: {_sample(bad, 4)}"]


# -- d. frozen or killed holders' messages come back in time -------------------------------
def _available(h: History, holder: str, t: float, margin: float) -> float | None:
    """Earliest time ``at`` >= t at which a holder other than ``holder`` was receiving and
    then stayed up (neither killed nor frozen) until ``at + margin``: a consumer that dies
    or stops within the margin could not have been given the message, so the clock starts
    again with the next one."""
    best: float | None = None
    deaths = h._deaths()
    freezes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for f in h.faults:
        if f.kind == FROZEN:
            freezes[f.holder].append((f.at, math.inf if f.until is None else f.until))
    spans = [(w.holder, w.start, math.inf if w.end is None else w.end) for w in h.windows]
    spans += [(d.holder, d.start, d.start if d.returned is None else d.returned)
              for d in h.deliveries]
    for who, a, b in spans:
        if who == holder or b < t:
            continue
        died = deaths.get(who, math.inf)
        pieces = [(a, min(b, died))]
        for f0, f1 in freezes[who]:  # minus its freezes
            pieces = [p for lo, hi in pieces for p in ((lo, min(hi, f0)), (max(lo, f1), hi))
                      if p[0] <= p[1]]
        for lo, hi in pieces:
            if hi < t:
                continue
            at = max(lo, t)
            if died <= at + margin or any(at < f0 <= at + margin for f0, _ in freezes[who]):
                continue  # gone again before the margin was over
            best = at if best is None else min(best, at)
    return best


def _released(h: History, d: Delivery,
              index: dict[tuple[str, str], list[Settle]] | None = None) -> str | None:
    """How ``d``'s holder lost it without settling it (None: it did not). ``index``:
    ``h.settles_of()``, built once by a caller that asks for many deliveries."""
    index = h.settles_of() if index is None else index
    own = [s.t for s in index.get((d.id, d.holder), ())
           if s.t >= d.start - TOLERANCE and s.outcome in (*EFFECTIVE, ACK_STARTED)]
    for f in sorted(h.faults, key=lambda f: f.at):
        if f.holder != d.holder or f.at < d.start - TOLERANCE:
            continue
        if any(t <= f.at for t in own):
            return None  # settled (or went into ack) before the fault
        if f.kind == KILLED:
            return f"killed at {f.at:.3f}"
        if f.kind == FROZEN and f.at < d.deadline and (f.until is None or f.until >= d.deadline):
            return f"frozen {f.at:.3f}..{_t(f.until)}"
    return None


#: When the release clock starts (rule ``release``); see the module docstring.
RELEASE_CLOCKS = ("deadline", "membership", "unfrozen")


def _membership_events(h: History) -> list[float]:
    """Times at which a group's membership may change: kills, freezes and thaws, and each
    holder's first receive (a consumer joining)."""
    times = [f.at for f in h.faults if f.kind in (KILLED, FROZEN)]
    times += [f.until for f in h.faults if f.kind == FROZEN and f.until is not None]
    first: dict[str, float] = {}
    for who, t in [(w.holder, w.start) for w in h.windows] + \
            [(d.holder, d.start) for d in h.deliveries]:
        first[who] = min(t, first.get(who, t))
    return sorted(times + list(first.values()))


def _clock_start(h: History, at: float, margin: float, clock: str,
                 events: list[float]) -> float:
    """When the release clock really starts for a message available from ``at``."""
    if clock == "membership":
        changed = True
        while changed:  # each change inside the margin restarts it
            later = [t for t in events if at < t <= at + margin]
            changed = bool(later)
            at = max(later) if later else at
    elif clock == "unfrozen":
        # Past every stop (of anyone) that covers the start. A stop that never ends is an
        # in-process consumer that hung (a thread: it holds no file lock), not a stopped
        # process, whose SIGCONT is always recorded.
        while True:
            covering = [f.until for f in h.faults if f.kind == FROZEN
                        and f.until is not None and f.at <= at < f.until]
            if not covering:
                break
            at = max(covering)  # strictly later: each stop covers the start once
    return at


def _unseen_in_time(h: History, d: Delivery, nxt: Delivery, bound: float) -> bool:
    """Whether a delivery nobody recorded, between ``d`` and ``nxt`` (their attempts leave a
    gap), may have come by ``bound``: a receive call of another holder that a kill cut short
    (open at ``d``'s deadline), or a late call that dropped one of the missing attempts, that
    started by then. That delivery was the release; ``nxt`` came after its lease."""
    if nxt.attempt <= d.attempt + 1:
        return False
    limit = bound + TOLERANCE
    if any(who != d.holder and start <= limit and died >= d.deadline - TOLERANCE
           for who, start, died in h.cut):
        return True
    return any(mid == d.id and d.attempt < attempt < nxt.attempt and t <= limit
               for mid, attempt, _, t in h.late)


def rule_release(h: History, margin: float, clock: str = "deadline") -> list[str]:
    if clock not in RELEASE_CLOCKS:
        raise ValueError(f"release clock {clock!r}: one of {RELEASE_CLOCKS}")
    events = _membership_events(h) if clock == "membership" else []
    bad: list[str] = []
    faulted = False
    index = h.settles_of()
    for mid, ds in h.by_id().items():
        for i, d in enumerate(ds):
            how = _released(h, d, index)
            if how is None or i + 1 == len(ds):
                continue  # not released by a fault, or never again ("lost" judges that)
            faulted = True
            nxt = ds[i + 1]
            avail = _available(h, d.holder, d.deadline, margin)
            if avail is None:
                continue  # nobody else was receiving (and stayed up) after the deadline
            start = _clock_start(h, avail, margin, clock, events)
            bound = start + margin
            if nxt.start > bound + TOLERANCE and not _unseen_in_time(h, d, nxt, bound):
                bad.append(f"{mid}: attempt {d.attempt} held by {d.holder} ({how}), lease "
                           f"deadline {d.deadline:.3f}, another consumer receiving from "
                           f"{avail:.3f}, {clock} clock from {start:.3f}; next delivery "
                           f"(attempt {nxt.attempt} to "
                           f"{nxt.holder}) received from {nxt.start:.3f}, "
                           f"{nxt.start - bound:.3f}s after deadline + margin {margin:g}s")
    out: list[str] = []
    if faulted and not h.windows:
        out.append("[release] not judged: faulted holders' messages came back but no receive "
                   "windows were recorded (record them, or skip the rule and say why)")
    if bad:
        out.append(f"[release] a frozen or killed holder's message came back later than "
                   f"lease + release margin: {_sample(bad, 4)}")
    return out


# -- e. dead letters -----------------------------------------------------------------------
def rule_dead_letters(h: History, duplicates_declared: str | None = None) -> list[str]:
    out: list[str] = []
    limit = h.max_attempts
    if limit is None:
        if h.dead_letters:
            out.append("[dead-letters] not judged: the history has no max_attempts")
        return out
    # A late receive may carry an id past max_attempts: nobody saw it, so nobody could
    # dead-letter it, and the next delivery is dead-lettered with the attempts counted.
    beyond: dict[str, int] = {}
    for mid, attempt, _, _ in h.late:
        if attempt > limit:
            beyond[mid] = max(beyond.get(mid, limit), attempt)
    # Each receive call a kill cut short may have cost any message one counted delivery.
    cut = len(h.cut)
    wrong = [f"{d.id}: {d.attempts} ({d.reason})" for d in h.dead_letters
             if d.exhausted and not 0 <= d.attempts - beyond.get(d.id, limit) <= cut]
    if wrong:
        out.append(f"[dead-letters] dead-lettered for running out of attempts with other "
                   f"than max_attempts={limit}: {_sample(wrong)}")
    over = sorted({f"{d.id}: attempt {d.attempt} to {d.holder}" for d in h.deliveries
                   if d.attempt > limit})
    if over:
        out.append(f"[dead-letters] delivered beyond max_attempts={limit} instead of "
                   f"dead-lettered: {_sample(over)}")
    seen = Counter(d.id for d in h.deliveries) + Counter(mid for mid, _, _, _ in h.late)
    early = [f"{d.id}: {d.attempts} attempts, {seen[d.id]} deliveries"
             + (f" (+{cut} receive calls cut short)" if cut else "")
             for d in h.dead_letters if d.exhausted and seen[d.id] + cut < d.attempts]
    if early:
        out.append(f"[dead-letters] dead-lettered with more attempts than deliveries seen: "
                   f"{_sample(early)}")
    count = Counter(d.id for d in h.dead_letters)
    twice = sorted(f"{m} x{n}" for m, n in count.items() if n > 1)
    if twice and duplicates_declared is None:
        out.append(f"[dead-letters] dead-lettered more than once: {_sample(twice)}")
    return out


# -- f. a dedupe consumer's effects once ----------------------------------------------------
def rule_effects(h: History) -> list[str]:
    if h.effects is None:
        return []
    out: list[str] = []
    confirmed = h.confirmed()
    missing = sorted(m for m in confirmed if h.effects.get(m, 0) == 0)
    twice = sorted(f"{m} x{n}" for m, n in h.effects.items() if n > 1)
    strangers = sorted(m for m, n in h.effects.items()
                       if n and m not in {p.id for p in h.publishes})
    if missing:
        out.append(f"[effects] {len(missing)} confirmed ids without a side effect: "
                   f"{_sample(missing)}")
    if twice:
        out.append(f"[effects] {len(twice)} side effects happened more than once: "
                   f"{_sample(twice)}")
    if strangers:
        out.append(f"[effects] side effects for ids never published: {_sample(strangers)}")
    return out


#: Rule name → the function judging it (``check`` passes each its parameters).
RULES: dict[str, Callable[..., list[str]]] = {
    "lost": rule_lost,
    "attempts": rule_attempts,
    "second-holder": rule_second_holder,
    "release": rule_release,
    "dead-letters": rule_dead_letters,
    "effects": rule_effects,
}


def check(history: History, *, release_margin: float | None = None,
          release_clock: str = "deadline",
          dead_letter_duplicates: str | None = None,
          skip: Mapping[str, str] | None = None) -> list[str]:
    """Every violated rule as readable lines (empty when all hold).

    ``release_margin``: the backend's ``Capabilities.release_margin`` (rule ``release``
    needs it when the history has kills or freezes); ``release_clock``: when its clock
    starts on this backend (``RELEASE_CLOCKS``). ``dead_letter_duplicates``: why the
    backend declares an id may be dead-lettered twice (then that is not a violation).
    ``skip``: rule → why this scenario cannot judge it (a reason is required).
    """
    skip = dict(skip or {})
    unknown = sorted(set(skip) - set(RULES))
    if unknown:
        raise ValueError(f"unknown rules {unknown}; rules are {list(RULES)}")
    blank = sorted(rule for rule, why in skip.items() if not why.strip())
    if blank:
        raise ValueError(f"skipping {blank} needs a reason")
    out: list[str] = []
    for name, rule in RULES.items():
        if name in skip:
            continue
        if name == "release":
            if release_margin is None:
                if any(f.kind in (KILLED, FROZEN) for f in history.faults):
                    out.append("[release] not judged: kills or freezes recorded but no "
                               "release_margin given")
                continue
            out += rule(history, release_margin, release_clock)
        elif name == "dead-letters":
            out += rule(history, dead_letter_duplicates)
        else:
            out += rule(history)
    return out
