"""Request/reply on every backend: a request answered within its timeout, ``Timeout``
when nobody answers (and the unanswered request expires), a late reply dropped instead of
answering the next request, and replying to a message that asked for none refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

import mqabstract
from mqabstract import Feature

from .harness import Ctx


@pytest.fixture(autouse=True)
def _needs_request_reply(mq_ctx: Ctx) -> None:
    mq_ctx.require(Feature.REQUEST_REPLY)


@contextmanager
def responder(mq_ctx: Ctx, answer: Callable[[mqabstract.Message], object]
              ) -> Iterator[mqabstract.Subscription]:
    """A service on ``<token>.svc.#`` replying ``answer(msg)`` on its own connection."""
    service = mq_ctx.connect()
    sub = mq_ctx.subscribe("svc", mq_ctx.pattern("svc", "#"), broker=service)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for msg in sub.receive(10, 0.2):
                msg.reply(answer(msg))
                msg.ack()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sub
    finally:
        stop.set()
        thread.join(10)


def test_a_request_gets_its_reply(mq_ctx: Ctx) -> None:
    with responder(mq_ctx, lambda m: {"echo": m.value, "to": m.correlation_id}):
        for n in range(3):
            reply = mq_ctx.broker.request(mq_ctx.topic("svc", "echo"), {"n": n},
                                          timeout=mq_ctx.wait)
            assert reply.value["echo"] == {"n": n}
            assert reply.value["to"] == reply.correlation_id


def test_no_responder_is_a_timeout(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("svc", mq_ctx.pattern("svc", "#"))  # nobody answers
    with pytest.raises(mqabstract.Timeout):
        mq_ctx.broker.request(mq_ctx.topic("svc", "x"), b"anyone?", timeout=0.5)
    time.sleep(1.2)  # the request expires 1.1 x its timeout + 1 s after it was sent
    mq_ctx.expect_none(sub)  # expired: no stale work for a late responder


def test_a_late_reply_never_answers_the_next_request(mq_ctx: Ctx) -> None:
    slow = threading.Event()

    def answer(msg: mqabstract.Message) -> object:
        if msg.value == "first":
            slow.wait(10)  # replies after the requester gave up
        return msg.value

    with responder(mq_ctx, answer):
        with pytest.raises(mqabstract.Timeout):
            mq_ctx.broker.request(mq_ctx.topic("svc", "x"), "first", timeout=1.0)
        slow.set()
        reply = mq_ctx.broker.request(mq_ctx.topic("svc", "x"), "second", timeout=mq_ctx.wait)
        assert reply.value == "second"


def test_reply_to_a_message_that_asked_for_none_is_refused(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    mq_ctx.broker.publish(mq_ctx.topic("x"), b"not a request")
    [msg] = mq_ctx.drain(sub, 1, ack=False)
    assert msg.reply_to is None and msg.correlation_id is None
    with pytest.raises(mqabstract.InvalidArgument):
        msg.reply(b"to whom?")
    msg.ack()
    for bad in (0, -1, float("nan")):
        with pytest.raises(mqabstract.InvalidArgument):
            mq_ctx.broker.request(mq_ctx.topic("x"), b"x", timeout=bad)
    mq_ctx.expect_none(sub)


def test_wildcard_groups_do_not_see_replies(mq_ctx: Ctx) -> None:
    """A group whose pattern starts with a wildcard matches reply routes' topics too; a
    reply is for its requester only, so such a group never receives it."""
    with responder(mq_ctx, lambda m: m.value):
        first = mq_ctx.broker.request(mq_ctx.topic("svc", "x"), 1, timeout=mq_ctx.wait)
        assert first.topic.startswith("mq-reply.")  # the requester's route
        tap = mq_ctx.subscribe("tap", "*." + first.topic.split(".", 1)[1])
        reply = mq_ctx.broker.request(mq_ctx.topic("svc", "x"), 2, timeout=mq_ctx.wait)
        assert reply.value == 2
        mq_ctx.expect_none(tap)
        # Only replies are skipped: a plain message on such a topic is the group's.
        plain = mq_ctx.broker.publish(first.topic, b"not a reply")
        assert [m.id for m in mq_ctx.drain(tap, 1)] == [plain]
