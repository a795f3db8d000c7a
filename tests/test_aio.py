"""The asyncio API (``mqabstract.aio``) over the embedded backends: same checks, errors and
lease rule as the sync API, the loop never blocked, cancellation safe."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import mqabstract
from mqabstract import Backoff, FakeClock, aio


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), 60))


def memory_url() -> str:
    return f"memory://aio-{uuid.uuid4().hex}"


def test_round_trip_async_for_and_context_managers() -> None:
    async def main() -> None:
        async with await aio.connect(memory_url()) as mq:
            assert mq.backend == "memory" and not mq.closed
            async with await mq.subscribe("g", "orders.#", lease=30) as sub:
                ids = [await mq.publish("orders.eu", {"n": i}, key="k") for i in range(3)]
                ids += await mq.publish_batch([("orders.us", b"b")])
                ids += await mq.publish_columns("orders.asia", [b"c1", b"c2"])
                got: list[aio.AsyncMessage] = []
                async for msg in sub:
                    got.append(msg)
                    await msg.ack()
                    if len(got) == len(ids):
                        sub.stop()
                assert sorted(m.id for m in got) == sorted(ids)
                assert [m.value for m in got[:3]] == [{"n": 0}, {"n": 1}, {"n": 2}]
                assert all(m.settled and m.attempt == 1 for m in got)
                assert await sub.receive(10, 0.05) == []
                assert (await mq.stats("g")).group == "g"
            assert sub.closed
        assert mq.closed

    run(main)


def test_typed_errors_before_anything_is_sent() -> None:
    async def main() -> None:
        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("g", "a.#")
            with pytest.raises(mqabstract.InvalidName):
                await mq.publish("bad topic!", b"x")
            with pytest.raises(mqabstract.InvalidArgument):
                await sub.receive(0)
            with pytest.raises(mqabstract.InvalidArgument):
                await sub.receive(1, wait="soon")  # type: ignore[arg-type]

            def not_async(msg: aio.AsyncMessage) -> None:
                return None

            with pytest.raises(mqabstract.InvalidArgument, match="coroutine"):
                await sub.consume(not_async)  # type: ignore[arg-type]
            with pytest.raises(mqabstract.InvalidArgument):
                await sub.consume(_noop, batch=0)
            assert await mq.publish("a.b", b"fine")  # nothing of the above was sent
            [msg] = await sub.receive(5, 1)
            assert msg.body == b"fine"
        with pytest.raises(mqabstract.InvalidArgument):
            await aio.connect(memory_url(), io_threads=0)

    run(main)


async def _noop(msg: aio.AsyncMessage) -> None:
    return None


async def heartbeat(gaps: list[float], stop: asyncio.Event) -> None:
    """Tick every 10 ms until ``stop``, recording the gaps between ticks: a loop blocked by
    broker I/O shows up as a long gap."""
    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


def test_loop_keeps_ticking_while_receives_wait(tmp_path: Path) -> None:
    """A heartbeat task keeps its 10 ms cadence while receives wait on an empty group."""

    async def main() -> None:
        async with await aio.connect(f"sqlite:///{tmp_path}/mq.db") as mq:
            subs = [await mq.subscribe("g", "a.#") for _ in range(3)]
            gaps: list[float] = []
            stop = asyncio.Event()
            beat = asyncio.create_task(heartbeat(gaps, stop))
            waited = await asyncio.gather(*(s.receive(1, 1.5) for s in subs))
            stop.set()
            await beat
            assert waited == [[], [], []]
            assert len(gaps) >= 50, len(gaps)
            assert max(gaps) < 0.25, max(gaps)

    run(main)


@pytest.mark.parametrize("how", ["receive", "receive_batch"])
def test_cancelled_receive_leaves_nothing_leased(how: str) -> None:
    """A message taken by the slice of a receive (or receive_batch) cancelled meanwhile is
    handed back at once, not held until its lease runs out."""

    async def main() -> None:
        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("g", "a.#", lease=300)
            receive = getattr(sub, how)
            waiting = asyncio.create_task(receive(1, 10))
            await asyncio.sleep(0.1)  # inside a slice on a pool thread
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            mid = await mq.publish("a.b", b"x")  # the cancelled slice may still take it
            [msg] = await receive(1, 3)  # far sooner than the 300 s lease
            assert msg.id == mid and msg.attempt <= 2
            await msg.ack()

    run(main)


def test_lease_rule_and_ack_many_through_asyncio() -> None:
    clock = FakeClock()

    async def main() -> None:
        async with await aio.connect(memory_url(), clock=clock) as mq:
            sub = await mq.subscribe("g", "a.#", lease=30)
            await mq.publish_batch([("a.b", b"1"), ("a.b", b"2"), ("a.b", b"3")])
            first, second, third = await sub.receive(3, 0)
            await sub.ack_many([first, second])
            assert first.settled and second.settled
            clock.advance(31)
            with pytest.raises(mqabstract.LeaseExpired):
                await third.ack()
            assert not third.settled
            [again] = await sub.receive(1, 0)
            assert (again.id, again.attempt) == (third.id, 2)
            await again.extend(60)
            clock.advance(45)
            await again.ack()  # still within the extended lease

    run(main)


def test_consume_with_coroutine_handler_retries_and_dead_letters() -> None:
    async def main() -> None:
        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("g", "a.#", max_attempts=2, lease=30)
            await mq.publish("a.ok", b"ok")
            await mq.publish("a.bad", b"bad")
            seen: list[tuple[bytes, int]] = []

            async def handler(msg: aio.AsyncMessage) -> None:
                seen.append((msg.body, msg.attempt))
                await asyncio.sleep(0)
                if msg.body == b"bad":
                    raise ValueError("no good")

            stats = await sub.consume(handler, idle_timeout=0.5, wait=0.1,
                                      backoff=Backoff(initial=0.01, jitter=0))
            assert (stats.received, stats.acked, stats.retried, stats.dead_lettered,
                    stats.failed) == (3, 1, 1, 1, 2)
            assert sorted(seen) == [(b"bad", 1), (b"bad", 2), (b"ok", 1)]
            [dead] = await mq.dead_letters("g")
            assert dead.reason == "ValueError: no good" and dead.attempts == 2

    run(main)


def test_loop_keeps_ticking_while_a_broker_stalls() -> None:
    """A broker that accepts the connection and then says nothing (a hung RabbitMQ): the
    connect waits out its timeout on an I/O thread, and fails with a typed error, while a
    heartbeat task on the loop keeps its cadence."""
    import socket

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    port = hole.getsockname()[1]

    async def main() -> None:
        gaps: list[float] = []
        stop = asyncio.Event()
        beat = asyncio.create_task(heartbeat(gaps, stop))
        start = time.monotonic()
        with pytest.raises(mqabstract.MQError) as err:
            await aio.connect(f"amqp://guest:guest@127.0.0.1:{port}/?connect_timeout=1.5")
        waited = time.monotonic() - start
        stop.set()
        await beat
        assert err.value.retryable, err.value
        assert "guest:guest" not in str(err.value)  # no secret in the error
        assert waited >= 1.0 and len(gaps) >= 50, (waited, len(gaps))
        assert max(gaps) < 0.25, max(gaps)

    try:
        run(main)
    finally:
        hole.close()


def test_concurrent_publishes_share_driver_calls_and_keep_their_own_outcome(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """100 publishes awaited together go out in a few driver calls; each caller gets its
    own id; a bad one among them fails alone, before anything of it is sent."""
    from mqabstract.broker import Broker

    calls: list[int] = []
    real = Broker._send_envelopes

    def counting(self: Broker, envelopes: Any) -> list[str]:
        calls.append(len(envelopes))
        return real(self, envelopes)

    async def main() -> None:
        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("g", "a.#")
            bodies: list[object] = [{"n": i} for i in range(100)]
            bodies[50] = object()  # not encodable
            results = await asyncio.gather(*(mq.publish("a.b", b) for b in bodies),
                                           return_exceptions=True)
            assert isinstance(results[50], mqabstract.EncodeError)
            ids = [r for i, r in enumerate(results) if i != 50]
            assert all(isinstance(r, str) for r in ids) and len(set(ids)) == 99
            assert len(calls) <= 3 and sum(calls) == 99, calls
            got = []
            while len(got) < 99:
                batch = await sub.receive(100, 2)
                assert batch
                got += batch
            assert sorted(m.id for m in got) == sorted(ids)  # type: ignore[type-var]
            assert {m.id: m.value["n"] for m in got} == {
                ids[i if i < 50 else i - 1]: i for i in range(100) if i != 50}
            await mq.close()
            with pytest.raises(mqabstract.Closed):
                await mq.publish("a.b", b"late")

    monkeypatch.setattr(Broker, "_send_envelopes", counting)
    run(main)
