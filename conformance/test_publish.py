"""Round trips, ids, headers, batches, limits and bad input."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

import mqabstract
from mqabstract import Feature, OutgoingMessage

from .harness import Ctx

#: "any index": the typed error's ``index`` is not checked.
_ANY: Any = object()

BODIES = {
    "binary": bytes(range(256)) * 4,
    "non-utf8": b"\xff\xfe\x00\x80 latin-1: \xe9",
    "empty": b"",
}


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_bytes_round_trip_byte_exact(mq_ctx: Ctx, kind: str) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    body = BODIES[kind]
    mid = mq_ctx.broker.publish(mq_ctx.topic("x"), body)
    [msg] = mq_ctx.drain(sub, 1)
    assert msg.body == body and isinstance(msg.body, bytes)
    assert msg.value == body
    assert msg.id == mid and msg.topic == mq_ctx.topic("x")
    assert msg.attempt == 1


def test_str_and_json_round_trip(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    text = "grüße, 世界 ✓ \U0001f600"
    doc = {"n": 1, "f": 1.5, "s": "é", "l": [1, None, True], "nested": {"k": []}}
    mq_ctx.broker.publish(mq_ctx.topic("s"), text)
    mq_ctx.broker.publish(mq_ctx.topic("j"), doc)
    mq_ctx.broker.publish(mq_ctx.topic("n"), 42)
    got = {m.topic.rsplit(".", 1)[1]: m for m in mq_ctx.drain(sub, 3)}
    assert got["s"].value == text and got["s"].body == text.encode()
    assert got["j"].value == doc and got["j"].headers["content-type"] == "application/json"
    assert got["n"].value == 42


def test_max_size_body(mq_ctx: Ctx) -> None:
    limit = mq_ctx.caps.max_body_bytes
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    period = bytes((i * 7) % 256 for i in range(256))  # every byte value, repeated
    body = (period * (limit // 256 + 1))[:limit]
    mq_ctx.broker.publish(mq_ctx.topic("big"), body)
    [msg] = mq_ctx.drain(sub, 1)
    assert len(msg.body) == limit and msg.body == body
    with pytest.raises(mqabstract.MessageTooLarge):
        mq_ctx.broker.publish(mq_ctx.topic("big"), body + b"x")
    mq_ctx.expect_none(sub)


def test_ids_kept_and_unique(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    given = f"order-{mq_ctx.token}:1/A"
    assert mq_ctx.broker.publish(mq_ctx.topic("a"), b"1", id=given) == given
    generated = {mq_ctx.broker.publish(mq_ctx.topic("a"), b"2") for _ in range(20)}
    assert len(generated) == 20
    got = mq_ctx.drain(sub, 21)
    assert {m.id for m in got} == generated | {given}


def test_headers_round_trip(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    headers = {"trace-id": "abc-123", "unicode": "ü→✓", "empty": "", "Case.Sensitive": "Yes"}
    n = mq_ctx.caps.max_headers
    many = {f"h{i}": str(i) for i in range(n)}
    mq_ctx.broker.publish(mq_ctx.topic("h"), b"x", headers=headers, key="k1")
    mq_ctx.broker.publish(mq_ctx.topic("many"), b"y", headers=many)
    got = {m.topic.rsplit(".", 1)[1]: m for m in mq_ctx.drain(sub, 2)}
    assert {k: v for k, v in got["h"].headers.items() if k != "content-type"} == headers
    assert got["h"].key == "k1"
    assert {k: v for k, v in got["many"].headers.items() if k != "content-type"} == many
    with pytest.raises(mqabstract.MessageTooLarge):
        mq_ctx.broker.publish(mq_ctx.topic("many"), b"y", headers={**many, "one": "more"})


def test_published_at_and_priority_default(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    before = datetime.now().astimezone()
    mq_ctx.broker.publish(mq_ctx.topic("t"), b"x")
    [msg] = mq_ctx.drain(sub, 1)
    assert abs((msg.published_at - before).total_seconds()) < 60
    assert msg.priority == 0 and msg.key is None


def test_batch_publish(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    n = min(3 * mq_ctx.caps.max_batch + 1, 250)
    batch = [OutgoingMessage(mq_ctx.topic("b"), f"m{i}".encode()) for i in range(n)]
    batch.append((mq_ctx.topic("t"), b"tuple"))  # type: ignore[arg-type]
    batch.append({"topic": mq_ctx.topic("d"), "body": {"as": "mapping"}})  # type: ignore[arg-type]
    ids = mq_ctx.broker.publish_batch(batch)
    assert len(ids) == n + 2 and len(set(ids)) == n + 2
    got = mq_ctx.drain(sub, n + 2)
    assert sorted(m.id for m in got) == sorted(ids)
    assert mq_ctx.broker.publish_batch([]) == []


def test_batch_with_bad_message_rejected_whole(mq_ctx: Ctx) -> None:
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    batch: list[OutgoingMessage] = [
        OutgoingMessage(mq_ctx.topic("ok"), b"fine") for _ in range(5)
    ]
    batch[3] = OutgoingMessage(mq_ctx.topic("ok"), b"bad", headers={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(mqabstract.ValidationError) as info:
        mq_ctx.broker.publish_batch(batch)
    assert info.value.index == 3 and "#3" in str(info.value)
    batch[3] = OutgoingMessage("bad topic!", b"x")
    with pytest.raises(mqabstract.InvalidName) as info2:
        mq_ctx.broker.publish_batch(batch)
    assert info2.value.index == 3
    mq_ctx.expect_none(sub)


def test_column_publish(mq_ctx: Ctx) -> None:
    """``publish_columns``: one topic, columns of bodies, ids, keys and headers (shared or
    per row) arrive as the same messages ``publish`` would make, in chunks of max_batch."""
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    topic = mq_ctx.topic("cols")
    n = min(2 * mq_ctx.caps.max_batch + 3, 120)
    ids = [f"col-{mq_ctx.token}-{i}" for i in range(n)]
    keys = [None if i % 3 == 0 else f"k{i % 4}" for i in range(n)]
    got_ids = mq_ctx.broker.publish_columns(topic, [f"r{i}".encode() for i in range(n)],
                                            ids=ids, keys=keys, headers={"src": "cols"})
    assert got_ids == ids
    texts = mq_ctx.broker.publish_columns(topic, ["é", "x"], headers={"all": "1"},
                                          row_headers=[{"row": "0"}, None])
    docs = mq_ctx.broker.publish_columns(topic, [{"a": 1}, b"raw"])
    assert len(set(texts + docs)) == 4
    got = {m.id: m for m in mq_ctx.drain(sub, n + 4)}
    assert set(got) == {*ids, *texts, *docs}
    for i, mid in enumerate(ids):
        m = got[mid]
        assert (m.topic, m.body, m.headers.get("src")) == (topic, f"r{i}".encode(), "cols")
        if mq_ctx.caps.supports(Feature.ORDERING) or keys[i] is None:
            assert m.key == keys[i]
    assert got[texts[0]].value == "é" and got[texts[0]].headers["row"] == "0"
    assert got[texts[1]].value == "x" and "row" not in got[texts[1]].headers
    assert got[texts[0]].headers["all"] == got[texts[1]].headers["all"] == "1"
    assert got[docs[0]].value == {"a": 1} and got[docs[1]].value == b"raw"
    assert mq_ctx.broker.publish_columns(topic, []) == []


BAD_COLUMNS = {
    "bad id": (dict(ids=["a", "b c", "d"]), mqabstract.InvalidArgument, 1),
    "key too long": (dict(keys=[None, None, "k" * 300]), mqabstract.InvalidArgument, 2),
    "control char key": (dict(keys=["a\x00", None, None]), mqabstract.InvalidArgument, 0),
    "bad header name": (dict(row_headers=[None, {"mq-id": "x"}, None]),
                        mqabstract.ValidationError, 1),
    "shared header": (dict(headers={"a b": "x"}), mqabstract.ValidationError, None),
    "unencodable body": (dict(bodies=[b"a", b"b", object()]), mqabstract.EncodeError, 2),
    "ids count": (dict(ids=["a"]), mqabstract.InvalidArgument, None),
}


def test_bad_column_rejected_whole(mq_ctx: Ctx) -> None:
    """Each bad column set of ``BAD_COLUMNS`` raises its typed error naming the bad row,
    and no row of it is sent (nor of a batch with one body over the limit).

    One subscription watches every case, each on its own topic (``c.<index in sorted
    order>``, the limit case last), so a row that got through names its case; one quiet
    period for all of them, not one per case."""
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    cases = sorted(BAD_COLUMNS)
    wrong: dict[str, str] = {}
    for n, case in enumerate(cases):
        change, error, index = BAD_COLUMNS[case]
        args: dict = {"bodies": [b"a", b"b", b"c"], **change}
        bodies = args.pop("bodies")
        wrong_case = _raised(error, index, mq_ctx.broker.publish_columns,
                             mq_ctx.topic("c", str(n)), bodies, **args)
        if wrong_case:
            wrong[case] = wrong_case
    big = b"x" * (mq_ctx.caps.max_body_bytes + 1)
    too_big = _raised(mqabstract.MessageTooLarge, 1, mq_ctx.broker.publish_columns,
                      mq_ctx.topic("c", str(len(cases))), [b"a", big])
    if too_big:
        wrong["body over the limit"] = too_big
    assert not wrong, wrong
    mq_ctx.expect_none(sub)  # a row that got through: its topic's last word is its case's index


def _raised(error: type[Exception], index: Any, call: Any, *args: Any, **kwargs: Any) -> str:
    """What is wrong with how ``call(*args, **kwargs)`` failed: "" when it raised
    ``error``, a non-retryable ``ValidationError`` with a message and (unless ``_ANY``)
    this ``index``."""
    try:
        call(*args, **kwargs)
    except error as exc:
        if not isinstance(exc, mqabstract.ValidationError):
            return f"{type(exc).__name__} is not a ValidationError"
        if exc.retryable or not str(exc):
            return f"{type(exc).__name__} retryable={exc.retryable}, message {str(exc)!r}"
        if index is not _ANY and getattr(exc, "index", _ANY) != index:
            return f"index {getattr(exc, 'index', None)!r}, expected {index!r}"
        return ""
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}, expected {error.__name__}"
    return f"accepted, expected {error.__name__}"


BAD_PUBLISHES = {
    "empty topic": (dict(topic=""), mqabstract.InvalidName),
    "topic with space": (dict(topic="a b"), mqabstract.InvalidName),
    "topic with wildcard": (dict(topic="a.*"), mqabstract.InvalidName),
    "topic empty word": (dict(topic="a..b"), mqabstract.InvalidName),
    "topic not str": (dict(topic=5), mqabstract.InvalidName),
    "unencodable body": (dict(body=object()), mqabstract.EncodeError),
    "set body": (dict(body={1, 2}), mqabstract.EncodeError),
    "nan body": (dict(body=float("nan")), mqabstract.EncodeError),
    "None body": (dict(body=None), mqabstract.EncodeError),
    "non-str header value": (dict(headers={"a": 1}), mqabstract.InvalidArgument),
    "non-str header name": (dict(headers={1: "a"}), mqabstract.InvalidName),
    "bad header name": (dict(headers={"a b": "x"}), mqabstract.InvalidName),
    "reserved header": (dict(headers={"mq-attempt": "9"}), mqabstract.InvalidName),
    "control char in header": (dict(headers={"a": "x\x00y"}), mqabstract.InvalidArgument),
    "priority 10": (dict(priority=10), mqabstract.InvalidArgument),
    "priority -1": (dict(priority=-1), mqabstract.InvalidArgument),
    "priority str": (dict(priority="high"), mqabstract.InvalidArgument),
    "negative delay": (dict(delay=-1), mqabstract.InvalidArgument),
    "nan delay": (dict(delay=float("nan")), mqabstract.InvalidArgument),
    "naive deliver_at": (dict(deliver_at=datetime(2030, 1, 1)), mqabstract.InvalidArgument),
    "delay and deliver_at": (
        dict(delay=1, deliver_at=datetime(2030, 1, 1).astimezone()),
        mqabstract.InvalidArgument,
    ),
    "id with space": (dict(id="a b"), mqabstract.InvalidArgument),
    "id too long": (dict(id="x" * 129), mqabstract.InvalidArgument),
    "key not str": (dict(key=5), mqabstract.InvalidArgument),
    "empty key": (dict(key=""), mqabstract.InvalidArgument),
}


def test_bad_input_rejected_before_send(mq_ctx: Ctx) -> None:
    """Each bad publish of ``BAD_PUBLISHES`` raises its typed, non-retryable
    ``ValidationError`` and sends nothing (one subscription and one quiet period for all
    the cases, each on its own topic ``bad.<index in sorted order>``; a bad topic is its
    own)."""
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    cases = sorted(BAD_PUBLISHES)
    wrong: dict[str, str] = {}
    for n, case in enumerate(cases):
        kwargs, error = BAD_PUBLISHES[case]
        args = {"topic": mq_ctx.topic("bad", str(n)), "body": b"x", **kwargs}
        topic, body = args.pop("topic"), args.pop("body")
        wrong_case = _raised(error, _ANY, mq_ctx.broker.publish, topic, body, **args)
        if wrong_case:
            wrong[case] = wrong_case
    assert not wrong, wrong
    mq_ctx.expect_none(sub)  # a publish that got through: its topic's last word is its case's index


def test_delay_beyond_backend_maximum_rejected(mq_ctx: Ctx) -> None:
    if not mq_ctx.caps.supports(Feature.DELAY):
        pytest.skip("delay UNSUPPORTED (checked by the truthfulness scenarios)")
    with pytest.raises(mqabstract.InvalidArgument, match="maximum"):
        mq_ctx.broker.publish(mq_ctx.topic("x"), b"x", delay=mq_ctx.caps.max_delay + 1)


def test_bad_group_and_pattern_names(mq_ctx: Ctx) -> None:
    for group in ("", "a b", "a/b", "x" * 300):
        with pytest.raises(mqabstract.InvalidName):
            mq_ctx.broker.subscribe(group, mq_ctx.pattern("#"))
    for pattern in ("", "a..b", "a.b*", "a.#x", "a b"):
        with pytest.raises(mqabstract.InvalidName):
            mq_ctx.broker.subscribe(mq_ctx.group("p"), pattern)
    for kw in ({"max_attempts": 0}, {"lease": 0}, {"lease": -1}, {"max_attempts": "3"}):
        with pytest.raises(mqabstract.InvalidArgument):
            mq_ctx.broker.subscribe(mq_ctx.group("k"), mq_ctx.pattern("#"), **kw)
