"""Body encoding round trips; never pickle."""

from __future__ import annotations

import pytest

from mqabstract import DecodeError, EncodeError, codec


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00\xff\xfe", bytes(range(256)), "", "ünïcødé ✓ \U0001f600", {"a": [1, 2.5, None]},
     [1, "x"], 0, -7, 3.25, True, False],
)
def test_round_trip(value: object) -> None:
    body, ctype = codec.encode(value)
    assert isinstance(body, bytes)
    assert codec.decode(body, ctype) == value


def test_bytes_like_pass_through_unchanged() -> None:
    assert codec.encode(bytearray(b"ab")) == (b"ab", None)
    assert codec.encode(memoryview(b"cd")) == (b"cd", None)
    assert codec.encode(b"\xff")[1] is None


def test_content_types() -> None:
    assert codec.encode("x")[1] == codec.TEXT
    assert codec.encode({"a": 1}) == (b'{"a":1}', codec.JSON)


@pytest.mark.parametrize(
    "value", [object(), {1, 2}, None, float("nan"), float("inf"), {"a": object()}, "\ud800"]
)
def test_unencodable_rejected(value: object) -> None:
    with pytest.raises(EncodeError):
        codec.encode(value)


def test_decode_errors_are_typed() -> None:
    with pytest.raises(DecodeError):
        codec.decode(b"{not json", codec.JSON)
    with pytest.raises(DecodeError):
        codec.decode(b"\xff", codec.TEXT)
    assert codec.decode(b"\xff", "application/octet-stream") == b"\xff"
    assert codec.decode(b'{"a":1}', "application/vnd.x+json") == {"a": 1}


def test_pickle_is_never_decoded() -> None:
    import pickle

    data = pickle.dumps({"x": 1})
    assert codec.decode(data, "application/python-pickle") == data
    assert codec.decode(data, None) == data


def test_deep_nesting_is_a_typed_error_everywhere() -> None:
    """A RecursionError must never escape: publish, publish_batch (with index), value."""
    import mqabstract

    deep: list[object] = []
    node = deep
    for _ in range(100_000):
        node.append([])
        node = node[0]  # type: ignore[assignment]
    with pytest.raises(EncodeError):
        codec.encode(deep)
    text = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(DecodeError):
        codec.decode(text, codec.JSON)
    with mqabstract.connect("memory://deep-nesting") as mq:
        sub = mq.subscribe("g", "t")
        with pytest.raises(EncodeError):
            mq.publish("t", deep)
        with pytest.raises(EncodeError) as info:
            mq.publish_batch([("t", b"ok"), ("t", deep)])
        assert info.value.index == 1
        assert sub.receive(1, 0) == []  # nothing half-published
        mq.publish("t", text, headers={"content-type": codec.JSON})
        [msg] = sub.receive(1, 0)
        with pytest.raises(DecodeError):
            _ = msg.value
        msg.ack()
