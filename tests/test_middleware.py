"""The middleware chain over the memory reference: order, headers, failures, notices, and
the asyncio API entering scopes on the caller's task."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

import mqabstract
from mqabstract import FakeClock, Middleware, Publishing, aio


def memory_url() -> str:
    return f"memory://mw-{uuid.uuid4().hex}"


class Recorder(Middleware):
    """Records every hook call in ``log``; ``header`` is added to each publish."""

    def __init__(self, name: str, log: list[Any], header: tuple[str, str] | None = None,
                 fail: str | None = None) -> None:
        self.name, self.log, self.header, self.fail = name, log, header, fail

    @contextmanager
    def _scope(self, what: str, arg: Any) -> Iterator[None]:
        if self.fail == f"{what}-enter":
            raise RuntimeError(f"{self.name} refuses")
        self.log.append((self.name, what, "enter"))
        try:
            yield
        except Exception as exc:
            self.log.append((self.name, what, "error", type(exc).__name__))
            raise
        finally:
            self.log.append((self.name, what, "exit"))
            if self.fail == f"{what}-exit":
                raise RuntimeError(f"{self.name} breaks on exit")

    def publishing(self, pub: Publishing) -> Any:
        if self.header:
            pub.headers[self.header[0]] = self.header[1]
        self.log.append((self.name, "pub", pub.topic, pub.count))
        return self._scope("publish", pub)

    def handling(self, msg: mqabstract.Message) -> Any:
        return self._scope("handle", msg)

    def received(self, sub: mqabstract.Subscription, messages: Sequence[mqabstract.Message],
                 started_ns: int) -> None:
        assert started_ns > 0
        self.log.append((self.name, "received", len(messages)))

    def settled(self, sub: mqabstract.Subscription, op: str,
                messages: Sequence[mqabstract.Message], started_ns: int,
                error: mqabstract.MQError | None) -> None:
        self.log.append((self.name, "settled", op, len(messages), error is None))


def test_scopes_nest_in_order_and_add_headers_a_message_may_override() -> None:
    log: list[Any] = []
    outer = Recorder("a", log, header=("x-tenant", "from-a"))
    inner = Recorder("b", log, header=("x-trace", "from-b"))
    with mqabstract.connect(memory_url(), middleware=[outer, inner]) as mq:
        sub = mq.subscribe("g", "t.#")
        mq.publish("t.1", b"x", headers={"x-tenant": "own"})
        [msg] = sub.receive(1, 1)
        assert dict(msg.headers) == {"x-tenant": "own", "x-trace": "from-b"}
        msg.ack()
    assert [e for e in log if e[1] == "publish"] == [
        ("a", "publish", "enter"), ("b", "publish", "enter"),
        ("b", "publish", "exit"), ("a", "publish", "exit")]
    assert ("a", "pub", "t.1", 1) in log
    assert ("a", "settled", "ack", 1, True) in log and ("b", "received", 1) in log


def test_a_middleware_that_raises_on_entry_means_nothing_is_sent() -> None:
    log: list[Any] = []
    first = Recorder("a", log)
    with mqabstract.connect(memory_url(),
                            middleware=[first, Recorder("b", log, fail="publish-enter")]) as mq:
        sub = mq.subscribe("g", "t.#")
        for call in (lambda: mq.publish("t.1", b"x"),
                     lambda: mq.publish_batch([("t.1", b"x"), ("t.2", b"y")]),
                     lambda: mq.publish_columns("t.1", [b"x", b"y"])):
            with pytest.raises(mqabstract.MiddlewareError, match="b refuses"):
                call()
        assert sub.receive(10, 0.2) == []
    # the scope entered before the failing one saw the failure and exited
    assert ("a", "publish", "error", "MiddlewareError") in log
    assert log.count(("a", "publish", "exit")) == 3


def test_headers_a_middleware_adds_are_checked_with_the_message() -> None:
    bad = Recorder("a", [], header=("Bad Name!", "v"))
    with mqabstract.connect(memory_url(), middleware=[bad]) as mq:
        sub = mq.subscribe("g", "t.#")
        with pytest.raises(mqabstract.InvalidName):
            mq.publish("t.1", b"x")
        with pytest.raises(mqabstract.ValidationError):
            mq.publish_columns("t.1", [b"x"])
        assert sub.receive(10, 0.2) == []


def test_an_exit_that_raises_is_logged_and_the_publish_stands(
        caplog: pytest.LogCaptureFixture) -> None:
    with mqabstract.connect(memory_url(),
                            middleware=[Recorder("a", [], fail="publish-exit")]) as mq:
        sub = mq.subscribe("g", "t.#")
        with caplog.at_level(logging.ERROR, "mqabstract"):
            mid = mq.publish("t.1", b"x")
        assert [m.id for m in sub.receive(1, 1)] == [mid]
    assert "failed on exit" in caplog.text


def test_handling_sees_the_handlers_exception_and_a_failing_entry_retries() -> None:
    log: list[Any] = []
    with mqabstract.connect(memory_url(), middleware=[Recorder("a", log)]) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=3)
        mq.publish("t.1", b"boom")

        def handler(msg: mqabstract.Message) -> None:
            if msg.attempt == 1:
                raise ValueError("first time")

        stats = sub.consume(handler, max_messages=2, idle_timeout=3,
                            backoff=mqabstract.Backoff(initial=0.01, jitter=0))
        assert (stats.retried, stats.acked) == (1, 1), stats
    assert ("a", "handle", "error", "ValueError") in log
    assert ("a", "settled", "nack", 1, True) in log
    log.clear()
    with mqabstract.connect(memory_url(),
                            middleware=[Recorder("a", log, fail="handle-enter")]) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=1)
        mq.publish("t.1", b"x")
        stats = sub.consume(lambda m: None, max_messages=1, idle_timeout=3)
        assert (stats.failed, stats.dead_lettered) == (1, 1), stats
        [dead] = mq.dead_letters("g")
        assert "MiddlewareError" in dead.reason


def test_settle_notices_cover_every_outcome() -> None:
    log: list[Any] = []
    clock = FakeClock()
    with mqabstract.connect(memory_url(), clock=clock, middleware=[Recorder("a", log)]) as mq:
        sub = mq.subscribe("g", "t.#", lease=10, max_attempts=2)
        mq.publish_batch([("t.1", b"1"), ("t.2", b"2"), ("t.3", b"3"), ("t.4", b"4")])
        a, b, c, d = sub.receive(4, 1)
        sub.ack_many([a])
        b.nack()
        c.dead_letter("no")
        clock.advance(11)
        with pytest.raises(mqabstract.LeaseExpired):
            d.ack()
        [again] = sub.receive(1, 1)
        assert again.attempt == 2
        sub.close()  # hands it back
    settled = [e[2:4] for e in log if e[1] == "settled"]
    assert settled == [("ack", 1), ("nack", 1), ("dead_letter", 1), ("expired", 1),
                       ("release", 1)], settled


def test_only_middleware_instances_are_accepted() -> None:
    with pytest.raises(mqabstract.InvalidArgument, match="Middleware"):
        mqabstract.connect(memory_url(), middleware=[object()])  # type: ignore[list-item]


who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


class SeesCaller(Middleware):
    """Reads a context variable the caller's task set: scopes run on that task."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @contextmanager
    def _see(self, what: str) -> Iterator[None]:
        self.seen.append(f"{what}:{who.get()}")
        yield

    def publishing(self, pub: Publishing) -> Any:
        pub.headers["x-who"] = who.get()
        return self._see(f"publish{pub.count}")

    def handling(self, msg: mqabstract.Message) -> Any:
        return self._see("handle")


def test_asyncio_scopes_run_on_the_callers_task() -> None:
    mw = SeesCaller()

    async def main() -> None:
        async with await aio.connect(memory_url(), middleware=[mw]) as mq:
            sub = await mq.subscribe("g", "t.#")
            who.set("caller")
            await asyncio.gather(*(mq.publish("t.1", {"n": n}) for n in range(3)))
            await mq.publish_batch([("t.1", b"x"), ("t.2", b"y")])
            await mq.publish_columns("t.1", [b"z"])

            async def handler(msg: aio.AsyncMessage) -> None:
                assert msg.headers["x-who"] == "caller"

            stats = await sub.consume(handler, max_messages=6, idle_timeout=2)
            assert stats.acked == 6, stats
            # A reply is published from the I/O pool, in the replying task's context.
            responder = await mq.subscribe("svc", "svc.#")

            async def answer(msg: aio.AsyncMessage) -> None:
                who.set("responder")
                await msg.reply(b"ok")

            task = asyncio.create_task(responder.consume(answer, max_messages=1))
            assert (await mq.request("svc.x", b"?", timeout=10)).body == b"ok"
            await task

    asyncio.run(main())
    assert mw.seen.count("publish1:caller") == 5 and "publish2:caller" in mw.seen
    assert "publish1:responder" in mw.seen, mw.seen
    # handler tasks start from the context of the task that called consume
    assert mw.seen.count("handle:caller") == 7, mw.seen  # 6 + the responder's


def test_opentelemetry_settle_spans_when_asked_and_never_a_secret() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mqabstract.otel import OpenTelemetry

    spans = InMemorySpanExporter()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(spans))
    otel = OpenTelemetry(tracer_provider=tracing, gauges=False, settle_spans=True)
    url = f"memory://user:s3cret@mw-{uuid.uuid4().hex}"
    with mqabstract.connect(url, middleware=[otel]) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=2)
        mq.publish_batch([("t.1", b"a"), ("t.1", b"b")])
        first, second = sub.receive(2, 1)
        sub.ack_many([first, second])
        mq.publish("t.1", b"c")
        [third] = sub.receive(1, 1)
        third.nack()
    names = [s.name for s in spans.get_finished_spans()]
    assert names.count("ack g") == 1 and names.count("nack g") == 1, names
    [ack] = [s for s in spans.get_finished_spans() if s.name == "ack g"]
    assert ack.attributes["messaging.batch.message_count"] == 2
    everything = repr([(s.name, dict(s.attributes)) for s in spans.get_finished_spans()])
    assert "s3cret" not in everything and "user" not in everything


def test_opentelemetry_gauges_read_every_groups_stats() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from mqabstract.otel import OpenTelemetry

    reader = InMemoryMetricReader()
    otel = OpenTelemetry(meter_provider=MeterProvider([reader]))
    with mqabstract.connect(memory_url(), middleware=[otel]) as mq:
        mq.declare("g1", "t.#")
        mq.declare("g2", "t.a")
        mq.publish_batch([("t.a", b"1"), ("t.b", b"2"), ("t.b", b"3")])
        points = [(p.attributes["messaging.consumer.group.name"],
                   p.attributes["mqabstract.state"], p.value)
                  for rm in reader.get_metrics_data().resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics
                  if m.name == "mqabstract.group.messages" for p in m.data.data_points]
    assert ("g1", "ready", 3) in points and ("g2", "ready", 1) in points, points
    assert ("g1", "dead", 0) in points


def test_review_regressions_typed_errors_and_one_expiry_notice() -> None:
    log: list[Any] = []
    clock = FakeClock()
    with mqabstract.connect(memory_url(), clock=clock, middleware=[Recorder("a", log)]) as mq:
        with pytest.raises(mqabstract.InvalidName):  # an unhashable topic: typed, not raw
            mq.publish_batch([(["t"], b"x")])
        sub = mq.subscribe("g", "t.#", lease=10)
        mq.publish("t.1", b"x")
        [msg] = sub.receive(1, 1)
        clock.advance(11)
        for settle in (msg.ack, msg.ack, msg.nack):
            with pytest.raises(mqabstract.LeaseExpired):
                settle()
    assert [e for e in log if e[1] == "settled"] == [("a", "settled", "expired", 1, True)]
    with pytest.raises(mqabstract.InvalidArgument, match="list"):
        mqabstract.connect(memory_url(), middleware=Recorder("a", []))  # type: ignore[arg-type]

    class BadBind(Middleware):
        def bind(self, broker: mqabstract.Broker) -> None:
            raise ValueError("no")

    with pytest.raises(mqabstract.MiddlewareError, match="bind"):
        mqabstract.connect(memory_url(), middleware=[BadBind()])


def test_span_exception_events_carry_no_chained_secret() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mqabstract.otel import OpenTelemetry

    spans = InMemorySpanExporter()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(spans))
    with mqabstract.connect(memory_url(), middleware=[
            OpenTelemetry(tracer_provider=tracing, gauges=False)]) as mq:
        sub = mq.subscribe("g", "t.#", max_attempts=1)
        mq.publish("t.1", b"x")

        def handler(msg: mqabstract.Message) -> None:
            try:
                raise ConnectionError("cannot reach amqp://admin:hunter2@rabbit:5672/")
            except ConnectionError as exc:
                raise ValueError("downstream failed") from exc

        sub.consume(handler, max_messages=1, idle_timeout=2)
    [process] = [s for s in spans.get_finished_spans() if s.name == "process g"]
    [event] = process.events
    assert event.attributes["exception.type"] == "ValueError"
    assert "hunter2" not in repr([(s.name, dict(s.attributes), [dict(e.attributes)
                                   for e in s.events]) for s in spans.get_finished_spans()])


class Deliveries(Middleware):
    """Tells the receives the application asked for from those of a consume loop."""

    def __init__(self) -> None:
        self.got: list[tuple[str, int]] = []

    def received(self, sub: mqabstract.Subscription, messages: Sequence[mqabstract.Message],
                 started_ns: int) -> None:
        self.got.append(("received", len(messages)))

    def delivered(self, sub: mqabstract.Subscription, messages: Sequence[mqabstract.Message],
                  started_ns: int) -> None:
        self.got.append(("delivered", len(messages)))


def test_consume_receives_are_deliveries_and_a_receive_batch_is_one_notice() -> None:
    mw, log = Deliveries(), []
    with mqabstract.connect(memory_url(), middleware=[mw, Recorder("r", log)]) as mq:
        sub = mq.subscribe("g", "t.#")
        mq.publish_columns("t.1", [b"x"] * 1500)
        batch = sub.receive_batch(1500, 1)  # two driver receives: 1,000 at most each
        assert len(batch) == 1500
        batch.ack()
        mq.publish_batch([("t.1", b"a"), ("t.1", b"b")])
        assert sub.consume(lambda m: None, max_messages=2, idle_timeout=2).acked == 2
        mq.publish("t.1", b"c")
        [msg] = sub.receive(1, 1)
        msg.ack()
    assert mw.got[0] == ("received", 1500) and mw.got[-1] == ("received", 1), mw.got
    assert {kind for kind, _ in mw.got[1:-1]} == {"delivered"}, mw.got
    assert sum(n for _, n in mw.got[1:-1]) == 2
    # a middleware that only has ``received`` hears of the consume loop's receives there
    told = [e[2] for e in log if e[1] == "received"]
    assert told[0] == 1500 and told[-1] == 1 and sum(told[1:-1]) == 2, told


def test_asyncio_consume_receives_are_deliveries() -> None:
    mw = Deliveries()

    async def main() -> None:
        async with await aio.connect(memory_url(), middleware=[mw]) as mq:
            sub = await mq.subscribe("g", "t.#")
            await mq.publish_columns("t.1", [b"x"] * 3)

            async def handler(msg: aio.AsyncMessage) -> None:
                pass

            assert (await sub.consume(handler, max_messages=3, idle_timeout=2)).acked == 3
            await mq.publish_columns("t.1", [b"y"] * 2)
            batch = await sub.receive_batch(2, 1)
            await batch.ack()

    asyncio.run(main())
    assert mw.got[-1] == ("received", 2), mw.got
    assert {kind for kind, _ in mw.got[:-1]} == {"delivered"}, mw.got
    assert sum(n for _, n in mw.got[:-1]) == 3
