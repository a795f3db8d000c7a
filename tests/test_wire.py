"""The wire codec (mqabstract/wire.py), once, without a broker: envelope → headers →
fields round trips, plain clients' messages, records the drivers wrote before the codec
existed, and the one attempt rule of copies."""

from __future__ import annotations

import json
import math

import pytest

from mqabstract import wire
from mqabstract.model import Envelope

AT = 1700000000.123456  # not exact in binary: repr must round-trip it
DUE = 1700000060.1


def env(**kw: object) -> Envelope:
    base: dict[str, object] = dict(id="m-1", topic="orders.eu", body=b"x",
                                   headers={"user": "v", wire.EXPIRES_AT: "1700009999.5"},
                                   key="k-1", priority=0, deliver_at=None, published_at=AT)
    base.update(kw)
    return Envelope(**base)  # type: ignore[arg-type]


# -- values --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, written", [
    (0, "0"), (7, "7"), (AT, repr(AT)), (0.1, "0.1"), (1e300, "1e+300"), ("s", "s"),
])
def test_one_text_encoding_of_values(value: int | float | str, written: str) -> None:
    assert wire.value(value) == written
    if isinstance(value, float):
        assert float(written) == value  # exact


def test_none_means_absent() -> None:
    assert wire.to_text({wire.ATTEMPT: 3, wire.DELIVER_AT: None}) == {
        wire.ATTEMPT: "3", wire.DELIVER_AT: None}


@pytest.mark.parametrize("raw, text", [
    (b"caf\xc3\xa9", "café"), (b"\xff", "\ufffd"), ("s", "s"), (None, ""), (3, "3"),
    (1.5, "1.5"), (b"", ""),
])
def test_client_values_read_as_text(raw: object, text: str) -> None:
    """confluent-kafka / kafka-python hand back bytes (None for an empty value), pika str,
    bytes or numbers a plain publisher set."""
    assert wire.text(raw) == text
    headers, _ = wire.split([("h", raw)])
    assert headers == {"h": text}


# -- encode → split → read ----------------------------------------------------------------
@pytest.mark.parametrize("opts", [
    {}, {"id": False}, {"key": True}, {"topic": "orders.eu"}, {"deliver_at": DUE},
    {"id": False, "key": True, "deliver_at": None},
])
def test_encode_is_fields_as_text(opts: dict[str, object]) -> None:
    e = env(deliver_at=DUE - 1)
    typed = wire.fields(e, **opts)  # type: ignore[arg-type]
    assert wire.encode(e, **opts) == {**e.headers, **wire.to_text(typed)}  # type: ignore[arg-type]


def test_round_trip_through_text_headers() -> None:
    e = env(deliver_at=DUE)
    for as_bytes in (False, True):
        pairs = [(k, v.encode() if as_bytes else v)
                 for k, v in wire.encode(e, key=True, topic="orders.eu").items()]
        headers, meta = wire.split(pairs)
        assert headers == {"user": "v", wire.EXPIRES_AT: "1700009999.5"}  # carried stays
        assert wire.EXPIRES_AT in meta
        assert wire.read(meta) == wire.Fields(id="m-1", attempt=0, published_at=AT,
                                              deliver_at=DUE, key="k-1", topic="orders.eu")


def test_round_trip_through_the_packed_form() -> None:
    e = env(deliver_at=DUE)
    packed = json.loads(json.dumps(wire.pack(wire.fields(e, key=True))))
    assert packed == {"i": "m-1", "t": AT, "d": DUE, "k": "k-1"}
    assert wire.read(wire.unpack({"v": 1, "e": "b", "p": 4, **packed})) == wire.Fields(
        id="m-1", published_at=AT, deliver_at=DUE, key="k-1")


def test_envelope_without_delay_or_key_writes_neither() -> None:
    out = wire.encode(env(key=None), key=True)
    assert wire.KEY not in out and wire.DELIVER_AT not in out and wire.TOPIC not in out


# -- plain clients and bad input -----------------------------------------------------------
def test_plain_client_message_reads_as_defaults() -> None:
    headers, meta = wire.split([("trace", b"t1"), ("content-type", "text/plain")])
    assert headers == {"trace": "t1", "content-type": "text/plain"} and meta == {}
    f = wire.read(meta)
    assert f == wire.Fields() and (f.id, f.attempt, f.published_at, f.hops) == (None, 0,
                                                                                 None, 0)
    assert wire.read(wire.unpack({})) == wire.Fields()


def test_plain_client_writing_some_fields() -> None:
    """A plain producer sets what it knows (pika: numbers as numbers)."""
    _, meta = wire.split([(wire.ATTEMPT, 2), (wire.PUBLISHED_AT, 1700000000),
                          (wire.ID, "")])
    assert wire.read(meta) == wire.Fields(attempt=2, published_at=1700000000.0)


def test_broker_headers_are_skipped_before_decoding() -> None:
    pairs = [("x-death", [{"count": 1}]), ("x-delivery-count", 2), ("u", "v")]
    assert wire.split(pairs, frozenset({"x-death", "x-delivery-count"})) == ({"u": "v"}, {})


def test_other_mq_headers_are_not_the_users() -> None:
    headers, meta = wire.split([(wire.REASON, "r"), (wire.REPLY_TO, "a.b"), ("mq-future", "")])
    assert headers == {wire.REPLY_TO: "a.b"}
    assert set(meta) == {wire.REASON, wire.REPLY_TO, "mq-future"}


@pytest.mark.parametrize("bad", [b"two", b"", b"\xff", b"1e999999", None])
def test_a_malformed_field_reads_as_absent(bad: bytes | None) -> None:
    _, meta = wire.split([(wire.ID, b"m"), (wire.ATTEMPT, bad), (wire.PUBLISHED_AT, bad),
                          (wire.DELIVER_AT, b"5.0"), (wire.HOPS, bad)])
    f = wire.read(meta)
    assert (f.id, f.attempt, f.hops, f.deliver_at) == ("m", 0, 0, 5.0)
    assert f.published_at is None or math.isinf(f.published_at)  # "1e999999" is inf


@pytest.mark.parametrize("pairs", [
    [],
    [("u", b"1"), (wire.CORRELATION_ID, b"c"), (wire.REASON, b"r"), ("mq-other", b"x")],
    [(wire.ID, b"m"), (wire.ATTEMPT, b"2"), (wire.PUBLISHED_AT, b"1.5"),
     (wire.DELIVER_AT, b"2.5"), (wire.KEY, b"k"), (wire.TOPIC, b"t"), (wire.HOPS, b"3")],
    [(wire.ATTEMPT, b"two"), (wire.PUBLISHED_AT, b"1e999999"), (wire.HOPS, None)],
    [(wire.ID, b"first"), (wire.ID, b"second"), ("u", b"1"), ("u", b"2")],
    [(wire.ID, "str"), (wire.ATTEMPT, 3), (wire.PUBLISHED_AT, 1.5), ("u", None)],
    # the two headers every record carries (read straight), and that path's near misses
    [(wire.PUBLISHED_AT, b"1795814487.9900324"), (wire.ID, b"2712df98629e")],
    [(wire.PUBLISHED_AT, b"1.5"), (wire.ID, b"")],
    [(wire.PUBLISHED_AT, b" 1_0.5 "), (wire.ID, b"\xff")],
    [(wire.PUBLISHED_AT, b"bad"), (wire.ID, b"m")],
    [(wire.PUBLISHED_AT, b"\xff"), (wire.ID, b"m")],
    [(wire.PUBLISHED_AT, "\u0661.5".encode()), (wire.ID, b"m")],
    [(wire.PUBLISHED_AT, b"1e999999"), (wire.ID, b"m")],
    [(wire.PUBLISHED_AT, None), (wire.ID, b"m")],
    [(wire.ID, b"m"), (wire.PUBLISHED_AT, b"1.5")],
    [(wire.PUBLISHED_AT, "1.5"), (wire.ID, "m")],
    [(wire.PUBLISHED_AT, b"1.5"), ("u", b"m")],
    # the one header a record published on Kafka carries now, and near misses
    [(wire.ID, b"2712df98629e")],
    [(wire.ID, b"")],
    [(wire.ID, b"\xff")],
    [(wire.ID, "str")],
    [(wire.ID, None)],
    [("u", b"m")],
    [(wire.PUBLISHED_AT, b"1.5")],
])
def test_received_is_split_then_read(pairs: list[tuple[str, object]]) -> None:
    """The consumer's one-pass decoding gives what the two steps give, on every input."""
    for skip in ((), frozenset({"u", wire.ID})):
        headers, meta = wire.split(pairs, skip)
        for given in (pairs, tuple(pairs)):
            got = wire.received(given, skip)
            assert got == (headers, wire.read(meta))
            assert repr(got) == repr((headers, wire.read(meta)))  # (types too: 0 vs 0.0)


def test_packed_values_of_the_wrong_type() -> None:
    f = wire.read(wire.unpack({"i": 12, "a": "3", "t": "1700000000.5", "d": [1], "k": 5}))
    assert f == wire.Fields(id="12", attempt=3, published_at=1700000000.5, key="5")


# -- the attempt rule of copies ------------------------------------------------------------
@pytest.mark.parametrize("delivered", [1, 2, 7])
def test_a_copy_after_delivery_n_writes_n(delivered: int) -> None:
    """mq-attempt counts deliveries so far; the copy's next delivery is n + 1."""
    changed = wire.to_text(wire.retry_fields(delivered, DUE))
    assert changed == {wire.ATTEMPT: str(delivered), wire.DELIVER_AT: repr(DUE)}
    f = wire.read({k: v for k, v in changed.items() if v is not None})
    assert f.attempt + 1 == delivered + 1 and f.deliver_at == DUE
    assert wire.retry_fields(delivered) == {wire.ATTEMPT: delivered, wire.DELIVER_AT: None}
    assert wire.unpack(wire.pack(wire.retry_fields(delivered, DUE))) == {
        wire.ATTEMPT: delivered, wire.DELIVER_AT: DUE}


# -- records the drivers wrote before the codec --------------------------------------------
def test_old_kafka_records_decode_the_same() -> None:
    """A retry copy as Kafka's ``_copy`` wrote it (delivery 2 nacked: attempt "2") and a
    published record (``publish``: mq-id, mq-published-at; the Kafka key native)."""
    copy = [("user", b"v"), (wire.EXPIRES_AT, b"1700009999.5"), (wire.ID, b"m-1"),
            (wire.PUBLISHED_AT, repr(AT).encode()), (wire.TOPIC, b"orders.eu"),
            (wire.KEY, b"k-1"), (wire.ATTEMPT, b"2"), (wire.HOPS, b"1"),
            (wire.DELIVER_AT, repr(DUE).encode())]
    headers, meta = wire.split(copy)
    assert headers == {"user": "v", wire.EXPIRES_AT: "1700009999.5"}
    assert wire.read(meta) == wire.Fields("m-1", 2, AT, DUE, "k-1", "orders.eu", 1)
    published = [("content-type", b"application/json"), (wire.ID, b"m-2"),
                 (wire.PUBLISHED_AT, b"1700000000.25"), ("empty", None)]
    headers, meta = wire.split(published)
    assert headers == {"content-type": "application/json", "empty": ""}
    assert wire.read(meta) == wire.Fields(id="m-2", published_at=1700000000.25)


def test_old_rabbitmq_headers_decode_the_same() -> None:
    """``_props`` wrote mq-published-at, mq-key, mq-deliver-at (the id is the AMQP
    message id); ``_retry_item`` added mq-topic and mq-attempt = attempt - 1."""
    props_headers = {"user": "v", wire.PUBLISHED_AT: repr(AT), wire.KEY: "k-1",
                     wire.DELIVER_AT: repr(DUE), wire.TOPIC: "orders.eu", wire.ATTEMPT: "1",
                     "x-delivery-count": 1, "x-death": [{"reason": "expired"}]}
    headers, meta = wire.split(props_headers.items(),
                               frozenset({"x-delivery-count", "x-death"}))
    assert headers == {"user": "v"}
    assert wire.read(meta) == wire.Fields(None, 1, AT, DUE, "k-1", "orders.eu")


def test_old_sqs_packed_metadata_decodes_the_same() -> None:
    """``_to_wire`` packed {"v", "i", "t", "k", "p", "d", "e"}; a nack copy added "a"."""
    old = json.loads('{"v":1,"i":"m-1","t":1700000000.123456,"k":"k-1","p":3,'
                     '"d":1700000060.1,"e":"b","a":2}')
    assert wire.read(wire.unpack(old)) == wire.Fields("m-1", 2, AT, DUE, "k-1")
    e = env(deliver_at=DUE)
    assert {k: v for k, v in old.items() if k in "itkd"} == wire.pack(wire.fields(e, key=True))


# -- the drivers' copies follow the rule ---------------------------------------------------
@pytest.mark.parametrize("delivered", [1, 4])
def test_kafka_copy_decodes_to_the_next_attempt(delivered: int) -> None:
    pytest.importorskip("confluent_kafka")
    from types import SimpleNamespace

    from mqabstract.backends.kafka.client import TP
    from mqabstract.backends.kafka.state import Rec
    from mqabstract.backends.kafka.subscription import KafkaSubscription

    rec = Rec(TP("mq-retry.g", 0), 5, "orders.eu", b"x", {"user": "v"}, "k-1", "m-1", 0, AT)
    headers = KafkaSubscription._copy_headers(rec, wire.retry_fields(delivered))
    record = SimpleNamespace(headers=headers, key=b"k-1", offset=9, value=b"x",
                             timestamp=1)
    fake = SimpleNamespace(retry="mq-retry.g", declared_ms=0)
    [got] = KafkaSubscription._decode(fake, TP("mq-retry.g", 0), [record])  # type: ignore[arg-type]
    assert got is not None
    assert (got.n, got.id, got.key, got.topic, got.published_at, got.headers) == (
        delivered, "m-1", "k-1", "orders.eu", AT, {"user": "v"})  # attempt n + 1 next


@pytest.mark.parametrize(("headers", "redelivered", "so_far"), [
    ({}, False, 0), ({wire.ATTEMPT: "2"}, False, 2), ({wire.ATTEMPT: 2}, True, 3),
    ({wire.ATTEMPT: b"1", "x-delivery-count": 2}, True, 3)])
def test_rabbitmq_copy_decodes_to_the_next_attempt(headers: dict[str, object],
                                                   redelivered: bool, so_far: int) -> None:
    pika = pytest.importorskip("pika")
    from types import SimpleNamespace

    from mqabstract.backends.rabbitmq.driver import RabbitMQDriver
    from mqabstract.backends.rabbitmq.subscription import _Raw

    raw = _Raw(1, 1, redelivered, "orders.eu", pika.BasicProperties(headers=headers), b"x")
    assert (raw.so_far(), raw.attempt()) == (so_far, so_far + 1)
    fake = SimpleNamespace(_topic_of=lambda r: r.routing_key, _native_ttl=False)
    for delivered in (raw.so_far(), raw.attempt()):  # handed back / after this delivery
        item = RabbitMQDriver._retry_item(fake, raw, "q", delivered, None)  # type: ignore[arg-type]
        copy = _Raw(2, 1, False, "q", item.props, b"x")
        assert copy.attempt() == delivered + 1
        assert copy.decoded()[1].topic == "orders.eu"
        assert "x-delivery-count" not in item.props.headers


def test_sqs_copy_decodes_to_the_next_attempt() -> None:
    pytest.importorskip("boto3")
    from mqabstract.backends.sqs.wire import _to_wire

    w = _to_wire(env())
    assert w.fields() == wire.Fields(id="m-1", published_at=AT, key="k-1")
    assert w.headers() == {"user": "v", wire.EXPIRES_AT: "1700009999.5"}
    copy = w.with_meta(**wire.pack(wire.retry_fields(3, DUE)))
    assert (copy.fields().attempt, copy.fields().deliver_at) == (3, DUE)
