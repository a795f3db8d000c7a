"""Request/reply over the memory reference: many threads sharing one reply route, the
route's lifetime, asyncio requests, and consume(reply=True)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import mqabstract
from mqabstract import aio


def memory_url() -> str:
    return f"memory://rr-{uuid.uuid4().hex}"


def serve(mq: mqabstract.Broker, stop: threading.Event) -> threading.Thread:
    sub = mq.subscribe("svc", "svc.#")

    def run() -> None:
        sub.consume(lambda m: {"n": m.value["n"], "square": m.value["n"] ** 2}, reply=True,
                    stop=stop, concurrency=4, wait=0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_concurrent_requests_each_get_their_own_reply() -> None:
    stop = threading.Event()
    with mqabstract.connect(memory_url()) as mq:
        worker = serve(mq, stop)
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(
                lambda n: mq.request("svc.square", {"n": n}, timeout=10).value, range(200)))
        stop.set()
        worker.join(5)
    assert replies == [{"n": n, "square": n * n} for n in range(200)]


def test_the_route_is_made_once_and_deleted_at_close() -> None:
    stop = threading.Event()
    url = memory_url()
    with mqabstract.connect(url) as mq:
        worker = serve(mq, stop)
        assert [g for g in mq.groups() if g.startswith("mq-reply-")] == []
        mq.request("svc.x", {"n": 1}, timeout=10)
        mq.request("svc.x", {"n": 2}, timeout=10)
        routes = [g for g in mq.groups() if g.startswith("mq-reply-")]
        assert len(routes) == 1
        with mqabstract.connect(url) as other:  # another broker object: its own route
            other.request("svc.x", {"n": 3}, timeout=10)
            assert len([g for g in other.groups() if g.startswith("mq-reply-")]) == 2
        assert [g for g in mq.groups() if g.startswith("mq-reply-")] == routes
        stop.set()
        worker.join(5)
    with mqabstract.connect(url) as mq:
        assert [g for g in mq.groups() if g.startswith("mq-reply-")] == []


def test_consume_reply_ignores_none_and_plain_messages() -> None:
    with mqabstract.connect(memory_url()) as mq:
        sub = mq.subscribe("svc", "svc.#")
        mq.publish("svc.x", b"not a request")
        stats = sub.consume(lambda m: "answer", reply=True, max_messages=1)
        assert stats.acked == 1 and stats.failed == 0  # nobody asked: no reply, no error
        with pytest.raises(mqabstract.InvalidArgument):
            sub.consume(lambda m: None, reply="yes", max_messages=1)  # type: ignore[arg-type]


def test_asyncio_request_and_reply() -> None:
    async def main() -> list[object]:
        async with await aio.connect(memory_url()) as mq:
            sub = await mq.subscribe("svc", "svc.#")

            async def answer(msg: aio.AsyncMessage) -> object:
                return {"echo": msg.value}

            task = asyncio.create_task(sub.consume(answer, reply=True))
            replies = [(await mq.request("svc.x", n, timeout=10)).value for n in range(5)]
            with pytest.raises(mqabstract.Timeout):
                await mq.request("nobody.x", 1, timeout=0.2)
            sub.stop()
            await task
            return replies

    assert asyncio.run(main()) == [{"echo": n} for n in range(5)]


def test_closing_the_broker_ends_waiting_asyncio_requests_at_once() -> None:
    async def main() -> tuple[type[BaseException], float]:
        amq = await aio.connect(memory_url())
        await amq.subscribe("svc", "svc.#")  # nobody answers
        waiting = asyncio.create_task(amq.request("svc.x", b"?", timeout=30))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await amq.close()
        try:
            await waiting
        except BaseException as exc:  # the type is the assertion
            return type(exc), time.monotonic() - started
        raise AssertionError("the request returned a reply from nobody")

    kind, took = asyncio.run(main())
    assert kind is mqabstract.Closed and took < 5, (kind, took)


def test_bad_input_leaves_no_route_and_replies_go_only_to_routes() -> None:
    with mqabstract.connect(memory_url()) as mq:
        for bad in ({"topic": "no spaces allowed"}, {"headers": {"mq-x": "1"}}):
            args = {"topic": "svc.x", **bad}
            with pytest.raises(mqabstract.ValidationError):
                mq.request(args.pop("topic"), b"x", timeout=1, **args)
        assert [g for g in mq.groups() if g.startswith("mq-reply-")] == []
        sub = mq.subscribe("svc", "svc.#")
        from mqabstract.model import Envelope  # a plain client naming any topic as route

        mq._driver.publish((Envelope("e1", "svc.x", b"x", {
            "mq-reply-to": "orders.eu", "mq-correlation-id": "c", "mq-expires-at": "nan"},
            None, 0, None, 0.0),))
        [msg] = sub.receive(1, 1.0)
        assert msg.expires_at is None  # an unreadable TTL: none
        with pytest.raises(mqabstract.InvalidArgument):
            msg.reply(b"x")


def test_asyncio_requests_wait_on_futures_not_threads() -> None:
    """Many asyncio requests at once share one reader thread; a cancelled one stops waiting
    at once (its reply is dropped), and sync requests on the same route still get theirs."""
    stop = threading.Event()

    async def main(mq: mqabstract.Broker) -> tuple[list[object], int, object]:
        amq = aio.AsyncBroker(mq, aio._Runner(4))
        before = {t.name for t in threading.enumerate()}
        seen: set[str] = set()
        cancelled = asyncio.create_task(amq.request("nobody.x", {"n": -1}, timeout=30))
        await asyncio.sleep(0.3)  # sent; waiting for a reply that never comes
        cancelled.cancel()

        async def one(n: int) -> object:
            seen.update(t.name for t in threading.enumerate())
            return (await amq.request("svc.x", {"n": n}, timeout=20)).value

        loop = asyncio.get_running_loop()
        sync = loop.run_in_executor(None, lambda: mq.request("svc.x", {"n": 7}, timeout=20))
        replies = await asyncio.gather(*(one(n) for n in range(300)))
        readers = len(seen - before)  # threads that came up while they waited
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        early = asyncio.create_task(amq.request("nobody.x", {"n": -2}, timeout=30))
        await asyncio.sleep(0)
        early.cancel()  # while its check-and-send runs on the I/O pool
        with pytest.raises(asyncio.CancelledError):
            await early
        await asyncio.sleep(0.3)  # that hop ends: it forgets its correlation id itself
        assert mq._route is not None and not mq._route._callbacks  # nobody left waiting
        return replies, readers, (await sync).value

    with mqabstract.connect(memory_url()) as mq:
        worker = serve(mq, stop)
        replies, readers, sync = asyncio.run(main(mq))
        stop.set()
        worker.join(5)
    assert replies == [{"n": n, "square": n * n} for n in range(300)]
    # 4 I/O threads, the reader, the default executor's for the sync request, the
    # responder's handler threads as they start: a few, not one per waiting request
    assert readers <= 16 and sync == {"n": 7, "square": 49}
