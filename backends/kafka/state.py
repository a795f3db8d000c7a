"""Per-partition bookkeeping of a subscription: offsets, checkpoints, fetched records.

Pure data and logic, no client: the subscription holds its lock around every use.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

from mqabstract.errors import Unsupported

from .client import TP

__all__ = ["CKPT_RANGES", "LEASE_STEPS", "Checkpoint", "Part", "Rec", "ranges"]

_CKPT = "mq1"  # without lease steps (written before they existed, or none to list)
_CKPT_STEPS = "mq2"  # with them
#: Characters of done-offset ranges in a checkpoint (Apache Kafka keeps commit metadata up
#: to offset.metadata.max.bytes, 4096 by default).
CKPT_RANGES = 3000
#: Most lease steps a partition keeps (``Part.lease``): beyond it, the two neighbouring
#: steps whose deadlines are closest become one (the earlier records are held as long as
#: the later ones: at most the gap between two receives, not the partition's newest lease).
LEASE_STEPS = 16


class Checkpoint(NamedTuple):
    """What the owner of a partition stores with its committed offset (commit metadata).

    ``mark``: records below it were handed to an application (by this owner or earlier
    ones). ``bump``: attempts the owner adds to records below the mark it inherited.
    ``deadline``: epoch seconds; no lease on a record below the mark runs past it.
    ``leases``: the same per range of offsets, as steps ``(end, deadline)`` in offset
    order: no lease on a record from the previous step's end (the first: any) up to
    ``end`` (exclusive) runs past ``deadline``. A new owner holds an inherited record
    until its own step's deadline, not the partition's newest lease: under a rebalance
    every second or so, each new owner inherited a later newest lease, and a killed
    holder's records waited for the churn to end (chaos[kafka-python], session 23).
    Empty in checkpoints written without them: ``deadline`` covers every record.
    ``done``: settled offsets above the committed one (acked, re-published, dead-lettered),
    as ranges; a subset when it does not fit (those are delivered again, with the bump).
    ``moving``: offsets whose copy with one attempt more may have been written to the
    retry topic (an expired lease or a nack, between the fencing commit and the commit that
    marks them done): a new owner gives them one attempt more again, so a holder that froze
    inside that window and woke to finish its write never repeats an attempt. Always kept
    whole (it holds the few records of one re-publish at a time).
    """

    mark: int = 0
    bump: int = 0
    deadline: float = 0.0
    done: tuple[tuple[int, int], ...] = ()
    moving: tuple[tuple[int, int], ...] = ()
    leases: tuple[tuple[int, float], ...] = ()

    def fit(self, limit: int = CKPT_RANGES) -> Checkpoint:
        """This checkpoint with as many ``done`` ranges as fit in ``limit`` characters
        (the first ones); ``moving`` offsets are never cut, lease steps become one (the
        latest deadline for all: never shorter) when they do not fit beside them."""
        ckpt = self
        if len(_text(self.moving)) + len(_steps_text(self.leases)) > limit and self.leases:
            latest = max(self.deadline, *(until for _, until in self.leases))
            ckpt = self._replace(leases=((self.leases[-1][0], latest),))
        return ckpt._fit_done(limit)

    def _fit_done(self, limit: int) -> Checkpoint:
        size = len(_text(self.moving)) + len(_steps_text(self.leases))
        kept = 0
        for a, b in self.done:
            size += len(str(a) if a == b else f"{a}-{b}") + 1
            if size > limit:
                break
            kept += 1
        return self if kept == len(self.done) else self._replace(done=self.done[:kept])

    def encode(self, limit: int = CKPT_RANGES) -> str:
        ckpt = self.fit(limit)
        tail = f"{ckpt.mark} {ckpt.bump} {int(ckpt.deadline * 1000)} {_text(ckpt.done)}"
        if ckpt.leases:
            return (f"{_CKPT_STEPS} {tail} {_text(ckpt.moving)} "
                    f"{_steps_text(ckpt.leases)}")
        return f"{_CKPT} {tail} {_text(ckpt.moving)}" if ckpt.moving else f"{_CKPT} {tail}"

    @classmethod
    def decode(cls, meta: str | None) -> Checkpoint:
        """The checkpoint in commit metadata; none for metadata of a plain client.
        ``Unsupported`` for a format of a later version: read as none, its records would
        be delivered again with attempts already given (a group must not mix versions
        that write different formats; one that reads this one fails instead)."""
        words = (meta or "").split(" ")
        if (words[0] not in (_CKPT, _CKPT_STEPS) and words[0][:2] == "mq"
                and words[0][2:].isdigit()):
            raise Unsupported(f"Kafka partition checkpoint {words[0]!r} was written by a "
                              "later version of mqabstract: upgrade this consumer")
        if not ((words[0] == _CKPT and len(words) in (5, 6))
                or (words[0] == _CKPT_STEPS and len(words) == 7)):
            return cls()  # none, or written by a plain client
        try:
            return cls(int(words[1]), int(words[2]), int(words[3]) / 1000,
                       _parse(words[4]), _parse(words[5]) if len(words) > 5 else (),
                       _parse_steps(words[6]) if len(words) == 7 else ())
        except ValueError:
            return cls()


def _text(runs: tuple[tuple[int, int], ...]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _parse(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in filter(None, text.split(",")):
        a, _, b = item.partition("-")
        out.append((int(a), int(b or a)))
    return tuple(out)


def _steps_text(steps: tuple[tuple[int, float], ...]) -> str:
    return ",".join(f"{end}:{int(deadline * 1000)}" for end, deadline in steps)


def _parse_steps(text: str) -> tuple[tuple[int, float], ...]:
    out = []
    for item in filter(None, text.split(",")):
        end, _, ms = item.partition(":")
        out.append((int(end), int(ms) / 1000))
    return tuple(out)


def ranges(offsets: Collection[int]) -> tuple[tuple[int, int], ...]:
    """Sorted offsets as inclusive (first, last) runs."""
    out: list[tuple[int, int]] = []
    for off in sorted(offsets):
        if out and off == out[-1][1] + 1:
            out[-1] = (out[-1][0], off)
        else:
            out.append((off, off))
    return tuple(out)


def _end(step: tuple[int, float]) -> int:
    return step[0]


class Part:
    """Offsets of one assigned partition: fetched, acked, committed, and its checkpoint."""

    __slots__ = ("bump", "committed", "confirmed", "done", "ends", "gen", "held",
                 "inherited", "mark", "meta", "moved", "moving", "next_fetch", "order",
                 "revoked_at", "sent_meta", "untils")

    def __init__(self, found: tuple[int, str] | None) -> None:
        committed = found[0] if found is not None else None
        metadata = found[1] if found is not None else None
        ckpt = Checkpoint.decode(metadata)
        self.order: deque[int] = deque()  # fetched offsets not yet committed, in order
        self.done: set[int] = set()
        self.committed = committed  # last offset sent in a commit
        self.confirmed = committed  # last commit the coordinator accepted
        self.meta = metadata  # sent with ``committed``
        self.sent_meta = self.meta  # as confirmed
        self.next_fetch: int | None = None
        self.mark = max(ckpt.mark, committed or 0)
        # Lease steps (``Checkpoint.leases``): ``ends[i]`` and ``untils[i]``, ours and the
        # inherited ones; ``held``: the inherited ones as they came (``hold_for``, and what
        # ``release`` keeps: leases of earlier owners are not ours to give up).
        self.ends: list[int] = []
        self.untils: list[float] = []
        self.held: tuple[tuple[int, float], ...] = ()
        self.revoked_at: tuple[int | None, str | None] | None = None
        # The group generation whose assignment gave us this partition (None: unknown).
        # Only a commit made in that generation proves we own it (see ``checkpoint``'s
        # callers): the coordinator checks commits against the member's current
        # generation, not against its assignment.
        self.gen: int | None = None
        self.moving: set[int] = set()  # see Checkpoint.moving (carried on to later owners)
        self.moved: frozenset[int] = frozenset()  # inherited moving offsets
        # Records below the inherited mark were handed to an application by earlier owners
        # that did not commit them: one attempt more than any of them gave (bump), not
        # before the last lease on them ends (hold), except those the checkpoint lists as
        # settled.
        if committed is not None and ckpt.mark > committed:
            self.inherited = ckpt.mark
            self.bump = ckpt.bump + 1
            # Without steps (a checkpoint of an older version) one step covers them all.
            self.held = (tuple((end, until) for end, until in ckpt.leases if end > committed)
                         or ((ckpt.mark, ckpt.deadline),))
            self.ends = [end for end, _ in self.held]
            self.untils = [until for _, until in self.held]
            for a, b in ckpt.done:
                if b >= committed:
                    self.done.update(range(max(a, committed), b + 1))
            for a, b in ckpt.moving:
                self.moving.update(range(max(a, committed), b + 1))
            self.moved = frozenset(self.moving)
        else:
            self.inherited = 0
            self.bump = 0

    def extra_attempts(self, offset: int) -> int:
        """Attempts to add to an inherited record below the mark (see ``__init__``)."""
        return self.bump + (offset in self.moved)

    @property
    def hold(self) -> float:
        """The latest lease an earlier owner gave on any inherited record (0: none)."""
        return max((until for _, until in self.held), default=0.0)

    def hold_for(self, offset: int) -> float:
        """Until when an inherited record below the mark waits: the last lease an earlier
        owner gave on its step (``Checkpoint.leases`` as inherited: not what this owner's
        settles and leases made of them since)."""
        held = self.held
        i = bisect_right(held, offset, key=_end)
        return held[i][1] if i < len(held) else 0.0

    def lease_of(self, offset: int) -> float:
        """The deadline the checkpoint records for ``offset``'s step (0: none)."""
        i = bisect_right(self.ends, offset)
        return self.untils[i] if i < len(self.ends) else 0.0

    def lease(self, offset: int, until: float) -> None:
        """``offset`` is handed out (or its lease extended) until ``until``: raise the mark
        and the deadline of its step (split off, so that its neighbours keep theirs)."""
        if offset >= self.mark:
            self.mark = offset + 1
        ends, untils = self.ends, self.untils
        if not ends or offset >= ends[-1]:
            last = ends[-1] if ends else None
            if last is not None and offset == last and untils[-1] == until:
                ends[-1] = offset + 1  # the next record of the same receive
                return
            if last is not None and offset > last:
                ends.append(offset)  # records between were handed off, not leased
                untils.append(0.0)
            ends.append(offset + 1)
            untils.append(until)
        else:
            i = bisect_right(ends, offset)
            if untils[i] >= until:
                return
            low = ends[i - 1] if i else None
            keep = untils[i]
            new_ends, new_untils = [], []
            if low is None or offset > low:
                new_ends.append(offset)
                new_untils.append(keep)
            new_ends.append(offset + 1)
            new_untils.append(until)
            if offset + 1 < ends[i]:
                new_ends.append(ends[i])
                new_untils.append(keep)
            ends[i:i + 1] = new_ends
            untils[i:i + 1] = new_untils
        while len(ends) > LEASE_STEPS:
            # The two neighbours whose deadlines are closest become one, with the later.
            j = min(range(len(ends) - 1), key=lambda k: abs(untils[k + 1] - untils[k]))
            untils[j + 1] = max(untils[j], untils[j + 1])
            del ends[j], untils[j]

    def lease_many(self, offsets: Iterable[int], until: float) -> None:
        """``lease(offset, until)`` for each of ``offsets`` in turn (one receive's records of
        this partition, in the order handed out). The next record of a run (its offset the
        last step's end, with the same deadline) only moves that end, as ``lease`` would,
        without a call: receive hands out records by the thousand."""
        ends, untils = self.ends, self.untils  # (changed in place only here)
        for offset in offsets:
            if ends and offset == ends[-1] and untils[-1] == until:
                if offset >= self.mark:
                    self.mark = offset + 1
                ends[-1] = offset + 1
            else:
                self.lease(offset, until)
                ends, untils = self.ends, self.untils

    def release(self) -> None:
        """Give our leases up (closing): a new owner waits only for those of earlier
        owners that it inherited from us, not for any we gave."""
        self.ends = [end for end, _ in self.held]
        self.untils = [until for _, until in self.held]

    def fetched(self, offset: int) -> None:
        self.order.append(offset)
        self.next_fetch = offset + 1

    def fetched_many(self, offsets: Sequence[int]) -> None:
        """``fetched`` for each of ``offsets`` (in order, at least one): one fetch's run."""
        self.order.extend(offsets)
        self.next_fetch = offsets[-1] + 1

    def commit_point(self) -> int | None:
        order, done = self.order, self.done
        while order and order[0] in done:
            done.discard(order.popleft())
        if order:
            return order[0]
        return self.next_fetch

    def checkpoint(self, limit: int = CKPT_RANGES, settle: Collection[int] = ()
                   ) -> tuple[int | None, str]:
        """(offset to commit, metadata). With ``settle``: as if those offsets were settled
        too, changing nothing (the checkpoint a transaction commits with their copies)."""
        point = self.commit_point()
        if settle:
            point = next((o for o in self.order if o not in self.done and o not in settle),
                         self.next_fetch)
        if point is None:
            point = self.committed
        done = [o for o in {*self.done, *settle} if point is None or o >= point]
        moving = self.moving
        if moving and point is not None:
            moving = {o for o in moving if o >= point}
            if not settle:
                self.moving = moving
        first = 0  # steps wholly below the point: their records are all settled
        if point is not None:
            first = bisect_right(self.ends, point)  # (ends are sorted)
            if first and not settle:
                del self.ends[:first], self.untils[:first]
                first = 0
        steps = tuple(zip(self.ends[first:], self.untils[first:], strict=True))
        ckpt = Checkpoint(self.mark, self.bump, max((u for _, u in steps), default=0.0),
                          ranges(done), ranges(moving), steps).fit(limit)
        if ckpt.moving:
            # A moved record the checkpoint lists as done is skipped by a new owner; one
            # whose done entry did not fit is delivered again, one attempt above its copy.
            ckpt = ckpt._replace(moving=ranges(
                [o for o in moving if not any(a <= o <= b for a, b in ckpt.done)]))
        return point, ckpt.encode(limit)


class Rec:
    """A fetched record on its way to the application."""

    __slots__ = ("body", "deadline", "due", "fencing", "headers", "hops", "id", "key", "n",
                 "offset", "part", "published_at", "since", "topic", "tp")

    body: bytes
    headers: dict[str, str]
    id: str
    key: str | None
    n: int
    published_at: float
    topic: str

    def __init__(self, tp: TP, offset: int, topic: str = "", body: bytes = b"",
                 headers: dict[str, str] | None = None, key: str | None = None, id: str = "",
                 n: int = 0, published_at: float = 0.0, due: float = 0.0,
                 hops: int = 0, since: float = 0.0) -> None:
        self.tp = tp
        self.offset = offset
        self.topic = topic
        self.body = body
        self.headers = headers if headers is not None else {}
        self.key = key
        self.id = id
        self.n = n
        self.published_at = published_at
        self.due = due
        self.hops = hops
        self.deadline = 0.0
        self.since = since  # (monotonic) ready since, for the idle hand-off
        self.fencing = 0  # extends whose fence is in flight (the lease is not expired)
        # The partition state it was fetched into (``SubscriptionState._owned``): a
        # record goes back to the buffers, or is leased again, only while that is still
        # the partition's, not after the partition was taken over afresh meanwhile.
        self.part: Part | None = None
