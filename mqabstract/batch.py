"""``Batch``: messages received together, as columns and as one lease.

``Subscription.receive_batch`` is ``receive`` called until the batch is full or nothing
more is ready, so every rule of a single message (the lease rule, attempts, dead letters
after ``max_attempts``, TTL, replies skipped, ordered keys and the gatekeeper) holds for
each message of a batch unchanged. A batch adds columns for bulk readers (Arrow, Spark)
and settles of the whole batch, each a loop over the messages' own settles (acks in one
``ack_many`` driver call). Native fast paths (drivers returning columns) are later work.
Separate from ``subscription.py``: nothing here is needed by a single-message consumer;
it names its subscription only by what it uses of it (``_Receiver``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar, overload

from .capabilities import Feature
from .errors import AlreadySettled, InvalidArgument, LeaseExpired, MissingDependency, MQError
from .message import Message, Source, _ran_out

__all__ = ["AsyncBatch", "Batch"]

_M = TypeVar("_M")
#: What a whole-batch op may still settle: unsettled, or refused once for its lease (so
#: that the op raises ``LeaseExpired`` for it again, as a repeated single settle does).
_OPEN = (None, "expired")


class _Receiver(Source, Protocol):
    """The subscription as a batch uses it: a message's ``Source`` that also receives
    (``_take``: without telling middleware; ``_received`` tells it once for the batch)
    and hands messages back."""

    def _take(self, max_messages: int, wait: float) -> list[Message]: ...

    def _noticed(self) -> int: ...

    def _received(self, messages: list[Message], started: int) -> None: ...

    def _release(self, messages: Iterable[Message]) -> None: ...


def receive_batch(sub: _Receiver, max_messages: int, wait: float) -> Batch:
    """``Subscription.receive_batch``: one ``receive`` waiting up to ``wait`` for the first
    messages, then more without waiting while the batch is not full, the last receive
    brought some, and more than half the earliest lease is left. So a batch is handed
    over with half its lease left less the time of at most one receive (the last, started
    with more than half left: a slow broker call there shortens the batch's lease).

    A broker error from a later receive hands over what was collected (the next receive
    sees the error); any other error (an interrupt, a bug) hands it back for redelivery
    at once, since nobody gets the batch, and propagates. The first ``receive`` checks the
    arguments (and that the subscription is open) before anything is received. Middleware
    hears of one receive: the whole batch, from the start of the first."""
    started = sub._noticed()
    got = sub._take(max_messages, wait)
    if not got:
        return Batch(sub, got)
    monotonic = sub._broker._monotonic
    earliest = min(m._deadline for m in got)
    half = sub.spec.lease / 2
    try:
        while len(got) < max_messages and earliest - monotonic() > half:
            try:
                more = sub._take(max_messages - len(got), 0.0)
            except MQError:  # what we hold is handed over; the next receive sees the error
                break
            if not more:
                break
            got += more
            earliest = min(earliest, *(m._deadline for m in more))
    except BaseException:
        sub._release(got)
        raise
    sub._received(got, started)
    return Batch(sub, got)


class Batch(Sequence[Message]):
    """Messages received together by ``Subscription.receive_batch``, as columns and as one
    lease; empty (falsy) when nothing arrived.

    Columns (``ids``, ``topics``, ``keys``, ``bodies``, ``headers``, ``attempts``,
    ``published_at``) are new lists in receive order; ``to_arrow()`` is the same as a
    pyarrow table. Indexing and iteration give the ``Message`` objects, which may still be
    settled one by one.

    The batch's lease is its earliest message deadline (``lease_remaining``): a settle of
    the whole batch (``ack``, ``nack``, ``dead_letter``, ``extend``) before it reaches every
    message. Such a settle skips messages settled one by one, settles every other message,
    and then raises ``LeaseExpired`` (naming them in ``ids``) if some leases had run out:
    those come again with the next attempt. A broker error stops it with the rest
    unsettled; repeating the call settles them. Whole-batch settles run one at a time
    (across threads too): after one, the same one is a no-op and another raises
    ``AlreadySettled``. On an empty batch every settle is a no-op (arguments are still
    checked).
    """

    __slots__ = ("_done", "_lock", "_messages", "_sub")

    def __init__(self, sub: Source, messages: list[Message]) -> None:
        self._sub = sub
        self._messages = messages
        self._done: str | None = None  # the whole-batch settle that ran
        self._lock = threading.Lock()  # one whole-batch settle at a time

    # -- columns ---------------------------------------------------------------------------
    @property
    def ids(self) -> list[str]:
        return [m.id for m in self._messages]

    @property
    def topics(self) -> list[str]:
        return [m.topic for m in self._messages]

    @property
    def keys(self) -> list[str | None]:
        return [m.key for m in self._messages]

    @property
    def bodies(self) -> list[bytes]:
        return [m.body for m in self._messages]

    @property
    def headers(self) -> list[dict[str, str]]:
        """Each message's headers as a dict (``mq-*`` metadata left out, as on ``Message``)."""
        return [dict(m.headers) for m in self._messages]

    @property
    def attempts(self) -> list[int]:
        return [m.attempt for m in self._messages]

    @property
    def published_at(self) -> list[datetime]:
        """When each was published (UTC)."""
        return [m.published_at for m in self._messages]

    def to_arrow(self) -> Any:
        """The columns as a ``pyarrow.Table`` (``id``, ``topic``, ``key``, ``body``,
        ``headers`` as map<string, string>, ``attempt``, ``published_at`` UTC µs);
        ``MissingDependency`` without pyarrow (extra ``arrow``)."""
        try:
            import pyarrow as pa
        except ImportError as exc:
            raise MissingDependency("Batch.to_arrow needs pyarrow: "
                                    "pip install 'mqabstract[arrow]'") from exc
        return pa.table({
            "id": pa.array(self.ids, pa.string()),
            "topic": pa.array(self.topics, pa.string()),
            "key": pa.array(self.keys, pa.string()),
            "body": pa.array(self.bodies, pa.binary()),
            "headers": pa.array([list(m.headers.items()) for m in self._messages],
                                pa.map_(pa.string(), pa.string())),
            "attempt": pa.array(self.attempts, pa.int32()),
            "published_at": pa.array(self.published_at, pa.timestamp("us", tz="UTC")),
        })

    # -- the messages ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._messages)

    def __bool__(self) -> bool:
        return bool(self._messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._messages)

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        return self._messages[index]

    @property
    def settled(self) -> bool:
        """True once every message is acked, nacked or dead-lettered (an empty batch too)."""
        return all(m.settled for m in self._messages)

    @property
    def lease_remaining(self) -> float:
        """Seconds left of the batch's lease: the earliest deadline of its messages not yet
        settled nor refused for their lease (≤ 0 once passed; ``inf`` when none is left)."""
        now = self._sub._broker._monotonic()
        return min((m._deadline - now for m in self._messages if m._state is None),
                   default=math.inf)

    # -- whole-batch settles ---------------------------------------------------------------
    def ack(self) -> None:
        """Ack every message not settled yet, in one driver call (``ack_many``)."""
        self._settle("acked", self._ack_all)

    def nack(self, delay: float = 0.0) -> None:
        """Give every message not settled yet back for redelivery after ``delay`` seconds;
        one on its group's final attempt is dead-lettered instead, as by ``Message.nack``."""
        self._sub._check_nack(delay)
        seconds = float(delay)
        self._settle("nacked", _each(lambda m: m.nack(seconds)))

    def dead_letter(self, reason: str = "dead-lettered by consumer") -> None:
        """Move every message not settled yet to the group's dead-letter store, with
        ``reason``."""
        if not isinstance(reason, str):
            raise InvalidArgument("reason must be a str")
        self._sub._broker._require(Feature.DEAD_LETTER)
        self._settle("dead-lettered", _each(lambda m: m.dead_letter(reason)))

    def extend(self, seconds: float) -> None:
        """Renew the lease of every message not settled yet: ours for ``seconds`` from now
        (one driver call per message)."""
        value = self._sub._check_extend(seconds)
        self._settle(None, _each(lambda m: m.extend(value)))

    def _settle(self, op: str | None, settle: Callable[[list[Message]], None]) -> None:
        """A whole-batch settle: ``settle`` the messages not settled yet, in order (``op``:
        the batch's outcome; None for ``extend``), then raise ``LeaseExpired`` for those
        whose lease ran out. Nothing on an empty batch; ``AlreadySettled`` after another
        whole-batch settle. Under the batch's lock: of two at once on two threads, the
        second sees the first's outcome."""
        if not self._messages:
            return
        with self._lock:
            if self._done is not None and self._done != op:
                raise AlreadySettled(f"this batch was already {self._done}")
            todo = [m for m in self._messages if m._state in _OPEN]
            error: LeaseExpired | None = None
            try:
                settle(todo)
            except LeaseExpired as exc:  # the others are settled: still the batch's outcome
                error = exc
            if op is not None:
                self._done = op
        late = [m for m in todo if m._state == "expired"]
        if late:
            raise _ran_out(late) from error
        if error is not None:
            raise error

    def _ack_all(self, todo: list[Message]) -> None:
        while todo:
            try:
                self._sub.ack_many(todo)
                return
            except AlreadySettled:  # one was settled by another thread meanwhile: skip it
                todo = [m for m in todo if m._state in _OPEN]

    def __repr__(self) -> str:
        n = len(self._messages)
        return f"Batch({n} message{'' if n == 1 else 's'}, group={self._sub.spec.name!r})"


def _each(settle: Callable[[Message], None]) -> Callable[[list[Message]], None]:
    """A whole-batch settle made of ``settle`` on each message in turn: one whose lease ran
    out is counted afterwards (by its state), one settled meanwhile by another thread is
    skipped."""
    def run(todo: list[Message]) -> None:
        for msg in todo:
            try:
                settle(msg)
            except (LeaseExpired, AlreadySettled):
                continue
    return run


class AsyncBatch(Sequence[_M]):
    """``Batch`` for asyncio (``AsyncSubscription.receive_batch``): the same columns and
    rules; the whole-batch settles are coroutines and the messages are ``AsyncMessage``."""

    __slots__ = ("_run", "_wrap", "_wrapped", "batch")

    def __init__(self, batch: Batch, run: Callable[..., Awaitable[Any]],
                 wrap: Callable[[Message], _M]) -> None:
        self.batch = batch  #: the sync batch underneath (same state)
        self._run = run
        self._wrap = wrap
        self._wrapped: list[_M] | None = None

    ids = property(lambda self: self.batch.ids)
    topics = property(lambda self: self.batch.topics)
    keys = property(lambda self: self.batch.keys)
    bodies = property(lambda self: self.batch.bodies)
    headers = property(lambda self: self.batch.headers)
    attempts = property(lambda self: self.batch.attempts)
    published_at = property(lambda self: self.batch.published_at)
    settled = property(lambda self: self.batch.settled)
    lease_remaining = property(lambda self: self.batch.lease_remaining)

    def to_arrow(self) -> Any:
        """``Batch.to_arrow`` (no I/O: on the event loop)."""
        return self.batch.to_arrow()

    def _messages(self) -> list[_M]:
        if self._wrapped is None:
            self._wrapped = [self._wrap(m) for m in self.batch]
        return self._wrapped

    def __len__(self) -> int:
        return len(self.batch)

    def __bool__(self) -> bool:
        return bool(self.batch)

    def __iter__(self) -> Iterator[_M]:
        return iter(self._messages())

    @overload
    def __getitem__(self, index: int) -> _M: ...

    @overload
    def __getitem__(self, index: slice) -> list[_M]: ...

    def __getitem__(self, index: int | slice) -> _M | list[_M]:
        return self._messages()[index]

    async def ack(self) -> None:
        """``Batch.ack``: every message not settled yet, in one driver call."""
        await self._run(self.batch.ack)

    async def nack(self, delay: float = 0.0) -> None:
        """``Batch.nack``: back for redelivery after ``delay`` seconds."""
        await self._run(self.batch.nack, delay)

    async def dead_letter(self, reason: str = "dead-lettered by consumer") -> None:
        """``Batch.dead_letter``: to the group's dead-letter store with ``reason``."""
        await self._run(self.batch.dead_letter, reason)

    async def extend(self, seconds: float) -> None:
        """``Batch.extend``: ours for ``seconds`` from now."""
        await self._run(self.batch.extend, seconds)

    def __repr__(self) -> str:
        return f"Async{self.batch!r}"
