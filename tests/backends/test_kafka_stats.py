"""Kafka ``stats()``: dead letters and the group's lag (end offsets minus committed offsets
over its retry topic and the topics its pattern matches), with both clients."""

from __future__ import annotations

import os
import time

import pytest

import mqabstract
from mqabstract import GroupStats
from mqabstract.backends.kafka.client import TP
from mqabstract.backends.kafka.names import REGISTRY, declared_key, internal
from tests.brokers import resolve_url


@pytest.fixture(scope="module")
def url() -> str:
    return resolve_url("kafka")


def _client_url(url: str, client: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}client={client}"


def _lag(mq: mqabstract.Broker, group: str, want: int, wait: float = 10.0) -> GroupStats:
    """Stats once the lag is ``want`` (commits are asynchronous), or the last ones read."""
    deadline = time.monotonic() + wait
    while True:
        stats = mq.stats(group)
        if stats.lag == want or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _retry_end(url: str, group: str) -> int:
    """Offsets in the group's retry topic (its records and transaction markers), read with
    a plain confluent-kafka consumer."""
    confluent_kafka = pytest.importorskip("confluent_kafka")
    hosts = ",".join(f"{h}:{p or 9092}" for h, p in mqabstract.BrokerURL.parse(url).hosts)
    consumer = confluent_kafka.Consumer({"bootstrap.servers": hosts, "group.id": "lag-probe"})
    try:
        topic = internal("r", group)
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(confluent_kafka.TopicPartition(topic, p),
                                                  timeout=10)[1] for p in parts)
    finally:
        consumer.close()


def _receive(sub: mqabstract.Subscription, n: int) -> list[mqabstract.Message]:
    got: list[mqabstract.Message] = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += sub.receive(n - len(got), 0.5)
    assert len(got) == n
    return got


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_stats_reports_lag_and_dead(url: str, client: str) -> None:
    pytest.importorskip("confluent_kafka" if client == "confluent" else "kafka")
    token = "l" + os.urandom(4).hex()
    group, pattern = f"lag-{token}", f"lag.{token}.*"
    with mqabstract.connect(_client_url(url, client)) as mq:
        with pytest.raises(mqabstract.NotFound):
            mq.stats(group)
        mq.declare(group, pattern, lease=60)
        try:
            mq.publish_batch([(f"lag.{token}.a", f"a{i}".encode()) for i in range(4)])
            mq.publish_batch([(f"lag.{token}.b", f"b{i}".encode()) for i in range(3)])
            # not matched: one word too many, another root
            mq.publish(f"lag.{token}.a.deep", b"no")
            mq.publish(f"other.{token}.a", b"no")
            stats = _lag(mq, group, 7)
            assert stats == GroupStats(group, None, None, None, 0, lag=7)
            # Another connection finds the pattern in the group's declaration.
            with mqabstract.connect(_client_url(url, client)) as other:
                assert other.stats(group).lag == 7

            sub = mq.subscribe(group, pattern, lease=60)
            try:
                assert mq.stats(group).lag == 7  # received nothing yet
                for msg in _receive(sub, 3):
                    msg.ack()
                assert _lag(mq, group, 4).lag == 4
                # A nack re-publishes to the retry topic: still the group's, still lag. The
                # re-publish is a Kafka transaction, whose marker takes an offset of the
                # retry partition; lag counts offsets, as Kafka's own tools do.
                [msg] = _receive(sub, 1)
                msg.nack()
                time.sleep(1.0)  # commits of the original and of the copy's fetch
                retry_offsets = _retry_end(url, group)
                assert retry_offsets >= 2  # the copy and its transaction's commit marker
                assert _lag(mq, group, 3 + retry_offsets).lag == 3 + retry_offsets
                [msg] = _receive(sub, 1)
                msg.dead_letter("counted")
                # The copy is settled: the committed offset passes it, not the marker(s)
                # behind it (known gap: they count until a later record's commit).
                markers = _retry_end(url, group) - 1
                stats = _lag(mq, group, 3 + markers)
                assert (stats.dead, stats.lag) == (1, 3 + markers), stats
            finally:
                sub.close()
            # Closed: its last commit is the group's; another connection agrees.
            with mqabstract.connect(_client_url(url, client)) as other:
                assert _lag(other, group, 3 + markers) == GroupStats(group, None, None, None, 1,
                                                                     lag=3 + markers)
        finally:
            mq.delete_group(group)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_lag_of_a_group_declared_without_its_pattern(url: str, client: str) -> None:
    """Groups declared by versions that did not store the pattern: lag None (dead letters
    still counted) until the group is declared again, which stores it."""
    pytest.importorskip("confluent_kafka" if client == "confluent" else "kafka")
    token = "o" + os.urandom(4).hex()
    group, pattern = f"lag-{token}", f"lag.{token}.#"
    with mqabstract.connect(_client_url(url, client)) as mq:
        mq.declare(group, pattern)
        try:
            mq.publish(f"lag.{token}", b"x")
            driver = mq._driver  # type: ignore[attr-defined]
            declared = driver.declared_ms(group)
            driver.admin.set_group_offsets(declared_key(group), {TP(REGISTRY, 0): (declared, "")})
            with mqabstract.connect(_client_url(url, client)) as old:
                assert old.stats(group) == GroupStats(group, None, None, None, 0, lag=None)
                old.declare(group, pattern)  # stores the pattern, keeps the time
                assert old._driver.declared_ms(group) == declared  # type: ignore[attr-defined]
            with mqabstract.connect(_client_url(url, client)) as new:
                assert new.stats(group).lag == 1
        finally:
            mq.delete_group(group)
