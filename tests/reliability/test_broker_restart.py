"""Broker connection cut: the test's own private broker is restarted under a live client.

What can be asserted depends on the broker's storage:

* RabbitMQ (``PrivateRabbit``), Apache Kafka (``PrivateKafka``, a KRaft node from the
  Maven jars) and PostgreSQL (``PrivatePostgres``, Debian's server on its own data dir,
  stopped with a "fast" shutdown that ends every client connection) keep durable queues /
  topics / committed rows and committed offsets across a restart, so
  *every* confirmed publish — before, during and after the outage — must be delivered,
  and messages held unacked at the restart come back.
* moto (``PrivateMoto``) keeps everything in memory: a restart wipes queues and
  messages. This dev broker is not durable, so the test asserts recovery only: errors
  during the outage are typed ``MQError``s, the same ``Broker`` and ``Subscription``
  objects work again (after re-declaring the group the broker forgot), and every publish
  confirmed after the restart is delivered. Messages confirmed before the restart are
  reported as lost-by-the-dev-broker, not as failures.

The history checker judges every scenario (``history.check``); the restart is recorded as
the end of this process's broker session (its leases end with it: a held message may come
back before its deadline). Nothing is killed or frozen, so rule ``release`` has nothing to
judge here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mqabstract
from tests.brokers import in_ci

from .support import (
    LEASE,
    Ledger,
    Publisher,
    Reporter,
    ack_stale,
    body_for,
    drain,
    fault_url,
    hold_some,
    spare_port,
    token,
)
from .support import kind as support_kind


def _private(kind: str, state_dir: Path) -> Any:
    import brokerctl as bc  # type: ignore[import-not-found]

    import tests.brokers  # noqa: F401 - puts scripts/ on sys.path

    if kind == "rabbitmq":
        return bc.PrivateRabbit(port=spare_port(5773, also=(20100, 30100, 30110)),
                                state_dir=state_dir)
    if kind == "kafka":
        return bc.PrivateKafka(port=spare_port(19693, also=(1000,)), state_dir=state_dir)
    if kind == "postgresql":
        return bc.PrivatePostgres(port=spare_port(55600), state_dir=state_dir)
    return bc.PrivateMoto(port=spare_port(5255), state_dir=state_dir)


@pytest.fixture
def private(backend: str, tmp_path: Path) -> Iterator[Any]:
    """A private broker for ``backend``, stopped at teardown whatever happened."""
    kind = support_kind(backend)
    broker = _private(kind, tmp_path / "brokers")
    broker.client_url = fault_url(backend, broker.url)
    try:
        broker.start()
    except Exception as exc:  # missing rabbitmq-server / Kafka jars / moto / postgresql-15
        if in_ci():
            pytest.fail(f"cannot start a private {kind}: {exc}")
        pytest.skip(f"cannot start a private {kind}: {exc}")
    try:
        yield broker
    finally:
        broker.stop()


def _fresh_client_works(url: str, tok: str) -> str:
    """Whether a brand-new connection can declare, publish and receive (diagnostic)."""
    try:
        with mqabstract.connect(url) as mq:
            group = f"rel-{tok}-fresh"
            sub = mq.subscribe(group, f"rel.{tok}.fresh", lease=LEASE)
            mid = mq.publish(f"rel.{tok}.fresh", b"probe")
            end = time.monotonic() + 30
            while time.monotonic() < end:
                for msg in sub.receive(1, 1.0):
                    msg.ack()
                    if msg.id == mid:
                        mq.delete_group(group)
                        return "works"
            return "message not received in 30 s"
    except mqabstract.MQError as exc:
        return f"fails too: {type(exc).__name__}: {str(exc)[:200]}"


#: Private brokers whose storage survives a restart (moto's does not).
DURABLE = ("rabbitmq", "kafka", "postgresql")


@pytest.mark.backends("rabbitmq", "kafka", "sqs", "postgresql")
def test_broker_restart(private: Any, backend: str, reporter: Reporter) -> None:
    """Restart the broker under a publisher thread and a consumer holding leases."""
    kind = private.kind
    durable = kind in DURABLE
    tok = token()
    topic, pattern, group = f"rel.{tok}.r", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=20, backend=backend)
    errors: list[str] = []
    with mqabstract.connect(private.client_url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=LEASE, max_attempts=20)
        sub = mq.subscribe(group, pattern, lease=LEASE, max_attempts=20)
        held = hold_some(mq, sub, topic, tok, ledger)
        pub = Publisher(mq, topic, f"{tok}-b")
        pub.start()
        time.sleep(0.5)
        restarted_at = time.monotonic()
        ledger.history.session_lost("here", restarted_at)
        downtime = private.restart()
        back_at = declared_at = time.monotonic()
        if not durable:
            # The dev broker forgot the group: declare it again (idempotent), as an
            # application would after a broker loss. Retried: the client may still be
            # reconnecting.
            end = time.monotonic() + 60
            while True:
                try:
                    mq.declare(group, pattern, lease=LEASE, max_attempts=20)
                    break
                except mqabstract.MQError as exc:
                    errors.append(type(exc).__name__)
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.5)
            declared_at = time.monotonic()
        # Let the publisher get some messages through the recovered connection.
        end = time.monotonic() + 60
        while time.monotonic() < end and sum(
            1 for _, t in pub.confirmed if t > back_at
        ) < 10:
            time.sleep(0.2)
        pub.stop.set()
        pub.join(30)
        for mid, t in pub.confirmed:
            if durable or t > declared_at:
                ledger.confirm(mid, body_for(mid))
            else:
                ledger.in_flight(mid, body_for(mid))
        for mid in pub.failed:  # a publish that raised may have landed: a copy
            ledger.in_flight(mid, body_for(mid))
        if not durable:
            for mid in [f"{tok}-a{i}" for i in range(20)]:  # what hold_some published
                ledger.demote(mid)
        receive_error = ""
        try:
            drain(sub, ledger, 2.0 + LEASE, 90, set(ledger.expected), errors=errors)
        except mqabstract.MQError as exc:
            receive_error = f"{type(exc).__name__}: {exc}"
        ack_stale(held, errors, ledger)
        with contextlib.suppress(mqabstract.MQError):
            mq.delete_group(group)
    fresh = "" if durable else _fresh_client_works(private.client_url, tok)
    summary = ledger.summary()
    problems = ledger.problems(release_margin=margin)
    lost_by_dev_broker = 0 if durable else len(set(ledger.maybe) - ledger.acked)
    reporter.emit(scenario="broker restart", backend=backend, kills=1, **summary,
                  problems=len(problems), restart_s=round(back_at - restarted_at, 1),
                  start_s=round(downtime, 1), errors_seen=sorted(set(errors + pub.errors)),
                  lost_by_dev_broker=lost_by_dev_broker,
                  confirmed_after_restart=sum(1 for _, t in pub.confirmed if t > back_at),
                  fresh_client=fresh or "n/a", receive_error=receive_error[:200])
    assert not pub.untyped, f"raw client exceptions escaped publish: {pub.untyped[:3]}"
    assert sum(1 for _, t in pub.confirmed if t > back_at) >= 10, (
        f"publishing did not recover after the restart; errors {pub.errors[-5:]}; "
        f"last: {pub.last_error}; a fresh connection: {fresh}")
    assert not receive_error, (
        f"the subscription did not recover: {receive_error}; a fresh connection: {fresh}")
    assert not problems, "\n".join(problems)
    if durable:
        held_unacked = {m.id for m in held[1::2]}
        assert held_unacked <= ledger.acked, "messages held at the restart did not come back"
