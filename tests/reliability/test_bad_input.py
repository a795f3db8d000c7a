"""Bad-input sweep: fuzzed names, header values, keys, bodies, options and URLs through the
public API on every backend. Each input is either accepted and round-trips byte-exact, or
rejected with a typed ``ValidationError`` before anything is sent (checked: nothing
arrives). Errors never echo a URL's secret."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mqabstract
from mqabstract import OutgoingMessage, ValidationError
from tests.brokers import in_ci

from .support import Reporter, cleanup, kind, token

EXAMPLES = {"memory": 60, "sqlite": 40, "rabbitmq": 12, "kafka": 10, "sqs": 12, "postgresql": 40}
WAIT = {"memory": 2.0, "sqlite": 5.0, "rabbitmq": 10.0, "kafka": 20.0, "sqs": 10.0,
        "postgresql": 5.0}

#: Characters that make names interesting: valid ones, separators, wildcards, whitespace,
#: controls, non-ASCII, a surrogate.
_NAME_CHARS = st.sampled_from([*"aZ09_-.", "..", "*", "#", " ", "\t", "\x00", "/", "é", "ß",
                               "\u2028", "\ud800", ":", "%"])
_ANY_CHAR = st.characters(codec=None, exclude_categories=())
_PRINTABLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
_names = st.one_of(
    st.lists(_NAME_CHARS, max_size=12).map("".join),
    st.text(_ANY_CHAR, max_size=12),
    st.sampled_from(["mq-id", "MQ-x", "aws.x", "amazon.y", "content-type", "x" * 129, "a.b",
                     "a..b", ".a", "a."]),
)
_values = st.one_of(
    st.text(_ANY_CHAR, max_size=40),
    st.text(st.characters(min_codepoint=0, max_codepoint=0x9F), max_size=10),
    st.sampled_from(["", " ", "\ufffd", "\U0001f600", "\x7f", "\ud83d", "a" * 300]),
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6,
)
_bodies = st.one_of(st.binary(max_size=300), st.text(_ANY_CHAR, max_size=60), _json,
                    st.sampled_from([b"", "", b"\x00\xff\xfe", float("nan"), object()]))


@st.composite
def candidates(draw: st.DrawFn) -> dict[str, Any]:
    """A message with one fuzzed field (the others valid, so acceptance tests that field)."""
    field = draw(st.sampled_from(["topic", "header_name", "header_value", "key", "body",
                                  "body", "id"]))
    msg: dict[str, Any] = {"suffix": "ok", "headers": {"h": "v"}, "key": None, "body": b"b",
                           "id": None}
    if field == "topic":
        msg["suffix"] = draw(_names)
    elif field == "header_name":
        msg["headers"] = {draw(_names): "v"}
    elif field == "header_value":
        msg["headers"] = {"h": draw(_values)}
    elif field == "key":
        msg["key"] = draw(_values)
    elif field == "body":
        msg["body"] = draw(_bodies)
    else:
        msg["id"] = draw(st.one_of(_values, st.text(_PRINTABLE, max_size=130)))
    return msg


@pytest.fixture
def sink(rel_url: str) -> Iterator[tuple[mqabstract.Broker, mqabstract.Subscription, str]]:
    """A connection and a catch-all subscription under a unique prefix."""
    tok = token("b")
    with mqabstract.connect(rel_url) as mq:
        sub = mq.subscribe(f"rel-{tok}", f"rel.{tok}.#", lease=30.0)
        try:
            yield mq, sub, f"rel.{tok}"
        finally:
            sub.close()
            cleanup(mq, f"rel-{tok}")


def _outgoing(prefix: str, c: dict[str, Any]) -> OutgoingMessage:
    return OutgoingMessage(f"{prefix}.{c['suffix']}", c["body"], headers=c["headers"],
                           key=c["key"], id=c["id"])


def _same_json(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def test_bad_input_sweep(backend: str, sink: tuple[mqabstract.Broker, mqabstract.Subscription,
                                                    str], reporter: Reporter) -> None:
    mq, sub, prefix = sink
    counts = {"inputs": 0, "accepted": 0, "rejected": 0}
    sentinel = OutgoingMessage(prefix + ".x", b"", headers={"mq-bad": "x"})  # always invalid

    @settings(max_examples=EXAMPLES[kind(backend)], deadline=None, derandomize=in_ci(),
              database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(candidates(), min_size=1, max_size=4))
    def check(cands: list[dict[str, Any]]) -> None:
        accepted: list[tuple[OutgoingMessage, dict[str, Any]]] = []
        for c in cands:
            out = _outgoing(prefix, c)
            counts["inputs"] += 1
            # Probe validation without sending: a batch ending in an invalid message is
            # rejected whole, and the error's index says which message failed first.
            try:
                mq.publish_batch([out, sentinel])
                raise AssertionError("a batch with an invalid message was accepted")
            except ValidationError as exc:
                first_bad = exc.index
            if first_bad == 0:
                with pytest.raises(ValidationError):
                    mq.publish(out.topic, out.body, headers=out.headers, key=out.key,
                               id=out.id)
                counts["rejected"] += 1
            else:
                assert first_bad == 1
                accepted.append((out, c))
        if not accepted:
            return
        ids = mq.publish_batch([o for o, _ in accepted])
        counts["accepted"] += len(ids)
        expect = dict(zip(ids, accepted, strict=True))
        got: dict[str, mqabstract.Message] = {}
        deadline = time.monotonic() + WAIT[kind(backend)]
        while len(got) < len(expect) and time.monotonic() < deadline:
            for msg in sub.receive(10, 1.0):
                msg.ack()
                assert msg.id in expect, f"unexpected message {msg!r} (rejected input sent?)"
                got[msg.id] = msg
        missing = [expect[i][0] for i in expect if i not in got]
        assert not missing, f"accepted but never delivered: {missing}"
        for mid, msg in got.items():
            out, c = expect[mid]
            assert msg.topic == out.topic
            assert msg.key == out.key
            for name, value in (out.headers or {}).items():
                assert msg.headers.get(name) == value, (name, value, dict(msg.headers))
            assert set(msg.headers) <= {*(out.headers or {}), "content-type"}
            body = out.body
            if isinstance(body, bytes):
                assert msg.body == body
            elif isinstance(body, str):
                assert msg.body == body.encode()
            else:
                assert _same_json(msg.value, body), (msg.value, body)

    check()
    assert not sub.receive(10, 1.0), "something arrived that was never accepted"
    reporter.emit(scenario="bad input (Hypothesis)", backend=backend, lost=0, **counts)


# -- names of groups and patterns --------------------------------------------------------------
def test_bad_group_and_pattern_names(backend: str, rel_url: str) -> None:
    tok = token("n")
    with mqabstract.connect(rel_url) as mq:

        @settings(max_examples=EXAMPLES[kind(backend)] * 2, deadline=None, derandomize=in_ci(),
                  database=None, suppress_health_check=list(HealthCheck))
        @given(_names, _names)
        def check(group_suffix: str, pattern_suffix: str) -> None:
            group, pattern = f"rel-{tok}-{group_suffix}", f"rel.{tok}.{pattern_suffix}"
            for _ in range(3):  # a dropped connection is not what this test is about
                try:
                    mq.declare(group, pattern, lease=5.0)
                except ValidationError:
                    return
                except mqabstract.ConnectionFailed:
                    time.sleep(1.0)
                    continue
                break
            mq.delete_group(group)

        check()


# -- URLs and options --------------------------------------------------------------------------
_option_names = st.one_of(st.sampled_from(["lease", "prefetch", "partitions", "region",
                                           "busy_timeout", "connect_timeout", "nope"]),
                          st.text(_ANY_CHAR, max_size=8))
_option_values = st.one_of(st.sampled_from(["-1", "0", "1e309", "nan", "", "yes", "%00",
                                            "%ZZ", "1" * 30]),
                           st.text(_PRINTABLE, max_size=8))


def test_bad_urls_and_options(backend: str, rel_url: str) -> None:
    """Fuzzed query options on the backend's own URL, and a secret that must never show."""
    secret = "s3cr3t" + secrets.token_hex(4)
    sep = "&" if "?" in rel_url else "?"

    @settings(max_examples=EXAMPLES[kind(backend)], deadline=None, derandomize=in_ci(),
              database=None, suppress_health_check=list(HealthCheck))
    @given(_option_names, _option_values)
    def check(name: str, value: str) -> None:
        url = f"{rel_url}{sep}{name}={value}"
        try:
            mqabstract.connect(url).close()
        except mqabstract.MQError as exc:
            assert isinstance(exc, ValidationError | mqabstract.ConnectionFailed), repr(exc)
        except Exception as exc:  # a raw exception escaped the public API
            raise AssertionError(f"{url!r} raised untyped {type(exc).__name__}: {exc}") from exc

    check()
    with pytest.raises(ValidationError) as info:  # an unknown option that looks secret
        mqabstract.connect(f"{rel_url}{sep}secret_token={secret}")
    assert secret not in str(info.value) and secret not in repr(info.value)

    @settings(max_examples=EXAMPLES[kind(backend)], deadline=None, derandomize=in_ci(),
              database=None, suppress_health_check=list(HealthCheck))
    @given(st.text(_ANY_CHAR, min_size=1, max_size=30).filter(str.strip))
    def garbage(text: str) -> None:
        try:
            mqabstract.connect(text).close()
        except mqabstract.MQError as exc:
            assert isinstance(exc, ValidationError | mqabstract.ConnectionFailed), repr(exc)
        except Exception as exc:
            raise AssertionError(f"{text!r} raised untyped {type(exc).__name__}") from exc

    if backend == "memory":  # backend-independent: run once
        garbage()
