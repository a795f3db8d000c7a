"""Capability truthfulness: what is declared UNSUPPORTED raises, limits are real."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import mqabstract
from mqabstract import Capabilities, Feature, Support

from .harness import Ctx


def _message(ctx: Ctx) -> mqabstract.Message:
    sub = ctx.subscribe("probe", ctx.pattern("#"))
    ctx.broker.publish(ctx.topic("probe"), b"x")
    [msg] = ctx.drain(sub, 1, ack=False)
    return msg


# One call per feature that must raise Unsupported when the feature is UNSUPPORTED.
PROBES: dict[Feature, Callable[[Ctx], object]] = {
    Feature.WILDCARDS: lambda c: c.subscribe("w", c.pattern("*")),
    Feature.DELAY: lambda c: c.broker.publish(c.topic("d"), b"x", delay=1),
    Feature.PRIORITY: lambda c: c.broker.publish(c.topic("p"), b"x", priority=5),
    Feature.ORDERING: lambda c: c.subscribe("o", c.pattern("#"), ordered=True),
    Feature.NACK_DELAY: lambda c: _message(c).nack(delay=1),
    Feature.LEASE_EXTEND: lambda c: _message(c).extend(5),
    Feature.DEAD_LETTER: lambda c: c.broker.dead_letters(c.declare("dl", c.pattern("#"))),
}


def test_capabilities_declare_every_feature(mq_ctx: Ctx) -> None:
    caps = mq_ctx.caps
    assert isinstance(caps, Capabilities)
    assert set(caps.features) == set(Feature)
    assert all(isinstance(s, Support) for s in caps.features.values())
    assert caps.max_body_bytes > 0 and caps.max_batch > 0 and caps.max_receive > 0
    assert 0 <= caps.max_priority <= 9
    if caps.supports(Feature.PRIORITY):
        assert caps.max_priority == 9, "priority support means the contract's 0-9"


@pytest.mark.parametrize("feature", sorted(PROBES, key=lambda f: f.value), ids=lambda f: f.value)
def test_feature_probe_matches_declaration(mq_ctx: Ctx, feature: Feature) -> None:
    """UNSUPPORTED raises ``Unsupported``; NATIVE / EMULATED must not."""
    if mq_ctx.caps.supports(feature):
        PROBES[feature](mq_ctx)  # must simply work
        return
    with pytest.raises(mqabstract.Unsupported) as info:
        PROBES[feature](mq_ctx)
    assert not info.value.retryable and mq_ctx.broker.backend in str(info.value)


def test_limits_are_enforced_before_send(mq_ctx: Ctx) -> None:
    caps = mq_ctx.caps
    sub = mq_ctx.subscribe("g", mq_ctx.pattern("#"))
    with pytest.raises(mqabstract.MessageTooLarge):
        mq_ctx.broker.publish(mq_ctx.topic("x"), b"\0" * (caps.max_body_bytes + 1))
    too_many = {f"h{i}": "v" for i in range(caps.max_headers + 1)}
    with pytest.raises(mqabstract.MessageTooLarge):
        mq_ctx.broker.publish(mq_ctx.topic("x"), b"x", headers=too_many)
    big_value = {"h": "v" * (caps.max_header_bytes + 1)}
    with pytest.raises(mqabstract.MessageTooLarge):
        mq_ctx.broker.publish(mq_ctx.topic("x"), b"x", headers=big_value)
    with pytest.raises(mqabstract.InvalidArgument):
        mq_ctx.broker.subscribe(mq_ctx.group("l"), mq_ctx.pattern("#"), lease=caps.max_lease + 1)
    mq_ctx.expect_none(sub)


def test_unknown_option_rejected(mq_ctx: Ctx) -> None:
    with pytest.raises(mqabstract.InvalidArgument, match="unknown"):
        mqabstract.connect(mq_ctx.url, surely_not_an_option_xyz=1)


def test_repr_and_errors_hide_secrets(mq_ctx: Ctx) -> None:
    parsed = mqabstract.BrokerURL.parse(mq_ctx.url)
    text = repr(mq_ctx.broker) + mq_ctx.broker.url
    if parsed.password:
        assert f":{parsed.password}@" not in text and ":***@" in text
    if not parsed.hosts or parsed.username is None:
        return
    # A wrong password must not come back in the error (or the repr, if the backend
    # does not check passwords at all).
    secret = f"Wr0ng-{mq_ctx.token}"
    bad_url = mq_ctx.url.replace(f"{parsed.username}:{parsed.password}@",
                                 f"{parsed.username}:{secret}@", 1)
    try:
        broker = mqabstract.connect(bad_url)
    except mqabstract.MQError as exc:
        assert secret not in str(exc) and secret not in repr(exc)
        assert isinstance(exc, (mqabstract.ConnectionFailed, mqabstract.ValidationError))
    else:
        with broker:
            assert secret not in repr(broker) and secret not in broker.url


def _unreachable(url: str, token: str) -> str | None:
    """The same URL pointed at something that cannot answer (None: process-local)."""
    parsed = mqabstract.BrokerURL.parse(url)
    endpoint = parsed.param("endpoint_url")
    if endpoint:
        return url.replace(endpoint, "http://127.0.0.1:9", 1)
    if parsed.hosts:
        hosts = ",".join(f"{h}:{p}" if p else h for h, p in parsed.hosts)
        return url.replace(hosts, "127.0.0.1:9", 1)
    if parsed.scheme == "sqlite":
        return f"sqlite:////proc/mq-{token}/no/such/dir/x.db"
    return None


def test_unreachable_broker_fails_fast_with_redacted_url(mq_ctx: Ctx) -> None:
    """A broker that is down gives ConnectionFailed within the timeout, never a hang."""
    if not mq_ctx.caps.shared_between_processes:
        pytest.skip(f"{mq_ctx.broker.backend} is process-local: there is no endpoint to lose")
    bad = _unreachable(mq_ctx.url, mq_ctx.token)
    if bad is None:
        pytest.fail(f"don't know how to make {mq_ctx.broker.url} unreachable; extend the suite")
    parsed = mqabstract.BrokerURL.parse(bad)
    started = time.monotonic()
    with pytest.raises(mqabstract.ConnectionFailed) as info:
        broker = mqabstract.connect(bad)  # lazily connecting drivers fail on first use
        try:
            broker.publish(mq_ctx.topic("x"), b"x")
        finally:
            broker.close()
    elapsed = time.monotonic() - started
    assert elapsed < 60 * mq_ctx.scale, f"took {elapsed:.0f}s to report a dead broker"
    assert info.value.retryable
    if parsed.password:
        assert f":{parsed.password}@" not in str(info.value)


def test_ping_is_a_round_trip_and_closed_brokers_refuse_it(mq_ctx: Ctx) -> None:
    broker = mq_ctx.connect()
    took = [broker.ping() for _ in range(3)]
    assert all(0 <= t < mq_ctx.wait for t in took), took
    broker.close()
    with pytest.raises(mqabstract.Closed):
        broker.ping()
