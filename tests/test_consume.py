"""The production consume loop, sync and asyncio, on the embedded backends: concurrency,
per-key order, auto_extend (on a fake clock), graceful stop and its grace period, SIGTERM
in a real process, typed payloads, and the typed errors of bad arguments.

Speed (concurrency=8 against 1 on a 100 ms handler) is measured in bench/bench_consume.py;
here the loops are checked for what they do, not how fast."""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest

import mqabstract
from mqabstract import Backoff, FakeClock, Message, aio

REPO = Path(__file__).resolve().parent.parent


def memory_url() -> str:
    return f"memory://consume-{uuid.uuid4().hex}"


def arun(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), 60))


class Gauge:
    """How many handlers run at once, and the most seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


# -- concurrency ------------------------------------------------------------------------
def test_sync_concurrency_runs_n_handlers_at_once_never_more() -> None:
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#")
        mq.publish_batch([("t.a", {"n": i}) for i in range(40)])
        gauge = Gauge()

        def handler(msg: Message) -> None:
            gauge.enter()
            time.sleep(0.05)
            gauge.leave()

        stats = sub.consume(handler, concurrency=8, max_messages=40)
        assert stats.received == stats.acked == 40
        assert gauge.most == 8
        assert mq.stats("g").ready == 0


def test_async_concurrency_runs_n_handler_tasks_at_once_never_more() -> None:
    async def main() -> None:
        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("g", "t.#")
            await mq.publish_batch([("t.a", {"n": i}) for i in range(40)])
            gauge = Gauge()

            async def handler(msg: aio.AsyncMessage) -> None:
                gauge.enter()
                await asyncio.sleep(0.05)
                gauge.leave()

            stats = await sub.consume(handler, concurrency=8, max_messages=40)
            assert stats.received == stats.acked == 40
            assert gauge.most == 8

    arun(main)


def test_ordered_group_never_runs_two_of_one_key_at_once_and_keeps_their_order() -> None:
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", ordered=True)
        keys = ["a", "b", "c"]
        mq.publish_batch([mqabstract.OutgoingMessage("t.x", {"k": k, "n": n}, key=k)
                          for n in range(6) for k in keys])
        lock = threading.Lock()
        active: dict[str, int] = dict.fromkeys(keys, 0)
        seen: dict[str, list[int]] = {k: [] for k in keys}
        overlaps = []
        gauge = Gauge()

        def handler(msg: Message) -> None:
            key, n = msg.value["k"], msg.value["n"]
            gauge.enter()
            with lock:
                active[key] += 1
                if active[key] > 1:
                    overlaps.append(key)
                seen[key].append(n)
            time.sleep(0.02)
            with lock:
                active[key] -= 1
            gauge.leave()

        stats = sub.consume(handler, concurrency=8, max_messages=18)
        assert stats.acked == 18
        assert overlaps == []
        assert seen == {k: list(range(6)) for k in keys}
        assert gauge.most == 3  # one per key


# -- auto_extend (fake clock: no sleeping for leases) ------------------------------------
@pytest.mark.parametrize("api", ["sync", "async"])
def test_auto_extend_keeps_a_slow_handlers_message_past_its_lease(api: str) -> None:
    clock = FakeClock()
    mq = mqabstract.connect(memory_url(), clock=clock)
    sub = mq.subscribe("g", "t.#", lease=10)
    rival = mq.subscribe("g", "t.#", lease=10)
    mid = mq.publish("t.a", b"slow")
    started, release = threading.Event(), threading.Event()
    result: list[mqabstract.ConsumeStats] = []

    holding: list[Message | aio.AsyncMessage] = []

    def hold(msg: Message | aio.AsyncMessage) -> None:
        holding.append(msg)
        started.set()
        assert release.wait(30)

    if api == "sync":
        worker = threading.Thread(target=lambda: result.append(
            sub.consume(hold, max_messages=1, wait=0.05)))
    else:
        async def consume_async() -> None:
            async with await aio.connect(memory_url()) as amq:  # its own I/O pool
                asub = aio.AsyncSubscription(sub, amq._run)

                async def ahold(msg: aio.AsyncMessage) -> None:
                    await asyncio.to_thread(hold, msg)

                result.append(await asub.consume(ahold, max_messages=1, wait=0.05))

        worker = threading.Thread(target=lambda: asyncio.run(consume_async()))
    worker.start()
    try:
        assert started.wait(10)
        for _ in range(6):  # 36 s of fake time: 3.6 leases
            clock.advance(6)
            deadline = time.monotonic() + 5
            while holding[0].lease_remaining <= 4:
                assert time.monotonic() < deadline, "the lease was not renewed"
                time.sleep(0.005)
            assert rival.receive(1) == []  # never redelivered while the handler runs
        release.set()
        worker.join(10)
        [stats] = result
        assert stats.acked == 1 and stats.expired == 0 and stats.extended >= 6
        assert rival.receive(1) == [] and mq.stats("g").ready == 0
        clock.advance(60)
        assert rival.receive(1) == [], f"{mid} came back after its ack"
    finally:
        release.set()
        mq.close()


def test_without_auto_extend_the_slow_handlers_message_expires() -> None:
    clock = FakeClock()
    with mqabstract.connect(memory_url(), clock=clock) as mq:
        sub = mq.subscribe("g", "t.#", lease=10)
        mq.publish("t.a", b"slow")

        def slow(msg: Message) -> None:
            clock.advance(11)

        stats = sub.consume(slow, max_messages=1, auto_extend=False, wait=0.05)
        assert stats.expired == 1 and stats.acked == 0 and stats.extended == 0
        [again] = sub.receive(1)
        assert again.attempt == 2


# -- graceful stop ---------------------------------------------------------------------
@pytest.mark.parametrize("api", ["sync", "async"])
def test_stop_finishes_running_handlers_and_hands_back_the_rest(api: str) -> None:
    """Stop while 4 handlers run and 6 more messages are held: the 4 finish and are acked,
    the 6 are handed back at once (attempt stays counted, nothing waits for a lease)."""
    url = memory_url()
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe("g", "t.#", lease=300)
        ids = mq.publish_batch([("t.a", {"n": i}) for i in range(10)])
        started = threading.Semaphore(0)
        handled: list[str] = []

        def work(msg: Message | aio.AsyncMessage) -> None:
            started.release()
            time.sleep(0.3)
            handled.append(msg.id)

        if api == "sync":
            def stop_after_four() -> None:
                for _ in range(4):
                    started.acquire()
                sub.stop()

            threading.Thread(target=stop_after_four).start()
            stats = sub.consume(work, concurrency=4, batch=10, grace=10)
        else:
            async def main() -> mqabstract.ConsumeStats:
                async with await aio.connect(memory_url()) as amq:
                    asub = aio.AsyncSubscription(sub, amq._run)

                    async def awork(msg: aio.AsyncMessage) -> None:
                        await asyncio.to_thread(work, msg)

                    async def stop_after_four() -> None:
                        for _ in range(4):
                            await asyncio.to_thread(started.acquire)
                        asub.stop()

                    stopper = asyncio.create_task(stop_after_four())
                    stats = await asub.consume(awork, concurrency=4, batch=10, grace=10)
                    await stopper
                    return stats

            stats = arun(main)
        assert len(handled) == 4 and stats.acked == 4
        assert stats.released == 6 and stats.received == 10
        rest = sub.receive(10, 2)  # at once: 300 s leases were handed back
        assert sorted([m.id for m in rest] + handled) == sorted(ids)
        assert not set(handled) & {m.id for m in rest}


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_handler_outliving_grace_has_its_message_handed_back(api: str) -> None:
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", lease=300)
        mid = mq.publish("t.a", b"stuck")
        started, release = threading.Event(), threading.Event()

        def stuck(msg: Message | aio.AsyncMessage) -> None:
            started.set()
            release.wait(30)

        try:
            if api == "sync":
                threading.Thread(target=lambda: started.wait(10) and sub.stop()).start()
                stats = sub.consume(stuck, grace=0.2, concurrency=2)
            else:
                async def main() -> mqabstract.ConsumeStats:
                    async with await aio.connect(memory_url()) as amq:
                        asub = aio.AsyncSubscription(sub, amq._run)
                        cancelled = []

                        async def astuck(msg: aio.AsyncMessage) -> None:
                            started.set()
                            try:
                                await asyncio.sleep(30)
                            except asyncio.CancelledError:
                                cancelled.append(msg.id)
                                raise

                        async def stopper() -> None:
                            await asyncio.to_thread(started.wait, 10)
                            asub.stop()

                        task = asyncio.create_task(stopper())
                        stats = await asub.consume(astuck, grace=0.2)
                        await task
                        assert cancelled == [mid]  # the task was cancelled
                        return stats

                stats = arun(main)
            assert stats.released == 1 and stats.acked == 0
            [again] = sub.receive(1, 2)
            assert again.id == mid and again.attempt == 2
        finally:
            release.set()


SIGTERM_WORKER = """
import asyncio, sys, time
import mqabstract
from mqabstract import aio
url, api, log = sys.argv[1], sys.argv[2], sys.argv[3]

def record(msg_id):
    with open(log, "a") as f:
        f.write(msg_id + "\\n")

if api == "sync":
    mq = mqabstract.connect(url)
    sub = mq.subscribe("g", "t.#", lease=300)
    def work(msg):
        sys.stdout.write("started\\n"); sys.stdout.flush()
        time.sleep(0.5)
        record(msg.id)
    stats = sub.consume(work, concurrency=3, batch=10, signals=True, grace=20)
    mq.close()
else:
    async def main():
        async with await aio.connect(url) as mq:
            sub = await mq.subscribe("g", "t.#", lease=300)
            async def work(msg):
                sys.stdout.write("started\\n"); sys.stdout.flush()
                await asyncio.sleep(0.5)
                record(msg.id)
            return await sub.consume(work, concurrency=3, batch=10, signals=True, grace=20)
    stats = asyncio.run(main())
print("stats", stats.acked, stats.released, flush=True)
"""


@pytest.mark.parametrize("api", ["sync", "async"])
def test_sigterm_loses_nothing_and_redelivers_only_the_unfinished(tmp_path: Path,
                                                                   api: str) -> None:
    """A worker process gets SIGTERM with handlers running: they finish and are acked, the
    rest is handed back; a new consumer then gets exactly the unhandled messages."""
    url = f"sqlite:///{tmp_path}/mq.db"
    with mqabstract.connect(url) as mq:
        mq.declare("g", "t.#", lease=300)
        ids = mq.publish_batch([("t.a", {"n": i}) for i in range(30)])
    log = tmp_path / "handled"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_WORKER, url, api, str(log)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        for _ in range(5):  # the first 3 handlers ran, the next 2 started
            assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    handled = log.read_text().split()
    acked, released = map(int, out.split("stats")[1].split())
    assert acked == len(handled) >= 5 and len(set(handled)) == len(handled)
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe("g", "t.#", lease=300)
        rest = sub.receive(30, 2)  # at once: the 300 s leases were handed back
        seen = (sorted(ids.index(h) for h in handled),
                [(ids.index(m.id), m.attempt) for m in rest if m.attempt > 1], out)
        assert len(rest) == 30 - len(handled), seen  # released + never received
        assert 1 <= released == sum(m.attempt == 2 for m in rest) <= 10, seen
        assert sorted(handled + [m.id for m in rest]) == sorted(ids)
        assert sub.receive(1) == []


# -- typed payloads --------------------------------------------------------------------
class Size(enum.Enum):
    S = "s"
    L = "l"


@dataclass
class Line:
    sku: str
    qty: int
    size: Size = Size.S


@dataclass
class Order:
    id: int
    placed: dt.datetime
    lines: list[Line]
    note: str | None = None
    tags: dict[str, float] = field(default_factory=dict)
    state: Literal["new", "paid"] = "new"


class PyOrder(pydantic.BaseModel):
    id: int
    placed: dt.datetime
    lines: list[dict[str, int]]


@pytest.mark.parametrize("model", [Order, PyOrder])
def test_models_round_trip_and_invalid_payloads_are_dead_lettered_not_retried(
        model: type) -> None:
    placed = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.timezone.utc)
    good = (Order(1, placed, [Line("a", 2, Size.L)], tags={"x": 1.5}) if model is Order
            else PyOrder(id=1, placed=placed, lines=[{"a": 2}]))
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", model=model, max_attempts=5)
        mq.publish("t.a", good)
        bad_id = mq.publish("t.a", {"id": "one", "placed": "yesterday", "lines": []})
        got: list[Any] = []
        stats = sub.consume(lambda m: got.append(m.value), max_messages=2)
        assert got == [good]
        assert stats.acked == 1 and stats.invalid == 1 and stats.dead_lettered == 1
        assert stats.retried == 0 and stats.failed == 0
        [dead] = mq.dead_letters("g")
        assert dead.id == bad_id and dead.attempts == 1
        assert dead.reason.startswith("invalid payload:") and "id" in dead.reason
        # receive() users see the typed error on .value
        mq.publish("t.a", {"id": 2})
        [msg] = sub.receive(1, 2)
        with pytest.raises(mqabstract.InvalidPayload):
            msg.value  # noqa: B018
        msg.ack()


@dataclass
class Shapes:
    pair: tuple[int, str]
    one: Literal[1]
    seq: Sequence[int]
    size: Size
    ratio: float


def test_dataclass_checks_reject_wrong_shapes() -> None:
    from mqabstract.typed import Model

    ok = {"pair": [5, "a"], "one": 1, "seq": [1], "size": "s", "ratio": 1}
    assert Model(Shapes).load(ok) == Shapes((5, "a"), 1, [1], Size.S, 1.0)
    for bad in [{**ok, "pair": ["a", 5]}, {**ok, "one": True}, {**ok, "seq": "abc"},
                {**ok, "size": True}, {**ok, "ratio": 10**400}]:
        with pytest.raises(mqabstract.InvalidPayload):  # (10**400: OverflowError inside)
            Model(Shapes).load(bad)

    load = Model(Order).load
    base = {"id": 1, "placed": "2026-11-23T12:00:00+00:00", "lines": []}
    assert load(base).lines == []
    for bad, why in [({**base, "id": True}, "Order.id"),
                     ({**base, "extra": 1}, "unknown fields"),
                     ({"id": 1, "lines": []}, "Order.placed: required"),
                     ({**base, "lines": [{"sku": "a", "qty": 1, "size": "xl"}]}, "size"),
                     ({**base, "state": "gone"}, "Order.state"),
                     ({**base, "tags": {"a": "b"}}, "Order.tags['a']"),
                     ([1], "an object")]:
        with pytest.raises(mqabstract.InvalidPayload, match=why.replace("[", r"\[")):
            load(bad)


# -- bad input: typed errors before anything is received or sent --------------------------
@dataclass
class Unserialisable:
    when: object


def test_bad_consume_arguments_are_typed_errors_before_anything_is_received() -> None:
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#")
        mq.publish("t.a", b"keep")

        async def coro(msg: Any) -> None:
            return None

        for kwargs in [{"concurrency": 0}, {"concurrency": "8"}, {"concurrency": True},
                       {"grace": -1}, {"auto_extend": "yes"}, {"signals": 1},
                       {"backoff": 3}]:
            with pytest.raises(mqabstract.InvalidArgument):
                sub.consume(lambda m: None, **kwargs)
        with pytest.raises(mqabstract.InvalidArgument, match="aio"):
            sub.consume(coro)  # type: ignore[arg-type]
        with pytest.raises(mqabstract.InvalidArgument, match="callable"):
            sub.consume("handler")  # type: ignore[arg-type]
        errors: list[BaseException] = []

        def off_main() -> None:
            try:
                sub.consume(lambda m: None, signals=True)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=off_main)
        t.start()
        t.join()
        assert isinstance(errors[0], mqabstract.InvalidArgument)
        with pytest.raises(mqabstract.InvalidArgument, match="model"):
            mq.subscribe("g2", "t.#", model=int)
        with pytest.raises(mqabstract.EncodeError, match="when"):
            mq.publish("t.a", Unserialisable(object()))
        with pytest.raises(mqabstract.EncodeError):
            mq.publish_batch([("t.a", b"ok"), ("t.a", Unserialisable([object()]))])
        [msg] = sub.receive(5, 1)  # only the first message: nothing else was sent
        assert msg.body == b"keep"


def test_bad_async_consume_arguments_are_typed_errors() -> None:
    async def main() -> None:
        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("g", "t.#")

            async def handler(msg: aio.AsyncMessage) -> None:
                return None

            with pytest.raises(mqabstract.InvalidArgument):
                await sub.consume(handler, concurrency=0)
            with pytest.raises(mqabstract.InvalidArgument, match="coroutine"):
                await sub.consume(lambda m: None)  # type: ignore[arg-type,return-value]
            with pytest.raises(mqabstract.InvalidArgument, match="model"):
                await mq.subscribe("g2", "t.#", model=dict)

    arun(main)


def test_handler_failures_still_retry_with_backoff_under_concurrency() -> None:
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=2)
        mq.publish_batch([("t.a", {"n": i}) for i in range(6)])

        def fail_odd(msg: Message) -> None:
            if msg.value["n"] % 2:
                raise ValueError("odd")

        stats = sub.consume(fail_odd, concurrency=3, max_messages=9, idle_timeout=3,
                            backoff=Backoff(initial=0, jitter=0))
        assert stats.acked == 3 and stats.failed == 6
        assert stats.retried == 3 and stats.dead_lettered == 3
        assert sorted(d.value["n"] for d in mq.dead_letters("g")) == [1, 3, 5]
        assert all(d.reason == "ValueError: odd" for d in mq.dead_letters("g"))
