"""Faults only a container makes possible: a paused broker and a network cut.

Each scenario runs a fresh broker container (``mqabstract.conformance.containers``, the
launcher behind ``--mq-container``), a publisher thread and a consumer that holds leases,
then for ``OUTAGE`` seconds either freezes the broker (``docker pause``: it keeps its
sockets but answers nothing) or takes the container off its network (new connections
refused, open ones silent). Asserted: no raw client exception escapes; no publish is
confirmed while the broker cannot have stored it; publishing and receiving recover with
the same ``Broker`` and ``Subscription``; every confirmed message is delivered (RabbitMQ's,
Kafka's and PostgreSQL's storage survive both faults) and the held, unacked ones come
back. The history checker judges the rest (``history.check``); the fault is recorded as
the end of this process's broker session.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
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
    token,
)
from .support import kind as support_kind

OUTAGE = 8.0  # seconds the broker is paused or cut off
RECOVERY_LIMIT = 90.0  # seconds allowed for publishing to get through again


@pytest.fixture
def box(backend: str) -> Iterator[Any]:
    """A fresh broker container for this scenario, stopped whatever happened."""
    from mqabstract.conformance import containers

    try:
        running = containers.start(support_kind(backend))
    except containers.ContainerError as exc:
        if in_ci():
            pytest.fail(f"no broker container (CI=true: never skipped): {exc}")
        pytest.skip(f"no broker container: {exc}")
    running.client_url = fault_url(backend, running.url)
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.backends("rabbitmq", "kafka", "postgresql")
@pytest.mark.parametrize("fault", ["pause", "cut"])
def test_container_fault(box: Any, backend: str, fault: str, reporter: Reporter) -> None:
    tok = token()
    topic, pattern, group = f"rel.{tok}.c", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=20, backend=backend)
    errors: list[str] = []
    start, end = (box.pause, box.unpause) if fault == "pause" else (box.cut, box.restore)
    with mqabstract.connect(box.client_url) as mq:
        margin = mq.capabilities.release_margin
        sub = mq.subscribe(group, pattern, lease=LEASE, max_attempts=20)
        held = hold_some(mq, sub, topic, tok, ledger)
        pub = Publisher(mq, topic, f"{tok}-b")
        pub.start()
        time.sleep(0.5)
        start()
        fault_at = time.monotonic()
        ledger.history.session_lost("here", fault_at)
        try:
            # A receive while the broker is gone: empty, or a typed error.
            with contextlib.suppress(mqabstract.MQError):
                sub.receive(5, 1.0)
            time.sleep(max(0.0, OUTAGE - (time.monotonic() - fault_at)))
        finally:
            end()
        back_at = time.monotonic()
        deadline = back_at + RECOVERY_LIMIT
        while time.monotonic() < deadline and sum(
            1 for _, t in pub.confirmed if t > back_at
        ) < 10:
            time.sleep(0.2)
        pub.stop.set()
        pub.join(30)
        for mid, _ in pub.confirmed:
            ledger.confirm(mid, body_for(mid))
        for mid in pub.failed:  # a publish that raised may have landed: a copy
            ledger.in_flight(mid, body_for(mid))
        receive_error = ""
        try:
            drain(sub, ledger, 2.0 + LEASE, 120, set(ledger.expected), errors=errors)
        except mqabstract.MQError as exc:
            receive_error = f"{type(exc).__name__}: {exc}"
        ack_stale(held, errors, ledger)
        with contextlib.suppress(mqabstract.MQError):
            mq.delete_group(group)
    # Nothing can be confirmed by a broker that is frozen or unreachable (one second of
    # slack at each end for a confirmation already on its way).
    during = [mid for mid, t in pub.confirmed if fault_at + 1.0 < t < back_at - 1.0]
    summary = ledger.summary()
    problems = ledger.problems(release_margin=margin)
    recovered = sum(1 for _, t in pub.confirmed if t > back_at)
    reporter.emit(scenario=f"container {fault}", backend=backend, kills=1, **summary,
                  problems=len(problems), outage_s=OUTAGE,
                  errors_seen=sorted(set(errors + pub.errors)),
                  confirmed_during=len(during), confirmed_after=recovered,
                  receive_error=receive_error[:200])
    assert not pub.untyped, f"raw client exceptions escaped publish: {pub.untyped[:3]}"
    assert not during, f"publishes confirmed while the broker was {fault}d: {during[:5]}"
    assert recovered >= 10, (f"publishing did not recover after the {fault}; errors "
                             f"{pub.errors[-5:]}; last: {pub.last_error}")
    assert not receive_error, f"the subscription did not recover: {receive_error}"
    assert not problems, "\n".join(problems)
    held_unacked = {m.id for m in held[1::2]}
    assert held_unacked <= ledger.acked, "messages held during the fault did not come back"
