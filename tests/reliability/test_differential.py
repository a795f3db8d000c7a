"""Differential testing: one generated operation sequence, run on the memory reference and
on the backend under test, with the contract's invariants checked on both histories.

Operations: publish (a small batch, keys from a tiny set), receive, ack / nack(delay) /
extend of a held message, lease expiry (wait out the lease), a stale settle (ack, nack,
extend or dead_letter of a message whose lease ran out), consumer crash (abandon the
subscription without closing it). Afterwards a fresh consumer drains the group.

Invariants, on every backend: every published id ends acked or dead-lettered (no loss);
every one was delivered at least once; a redelivery carries the same bytes; attempts grow
per id and never exceed ``max_attempts``; dead letters carry ``max_attempts`` attempts; a
stale settle raises ``LeaseExpired`` and changes nothing (the lease rule, memory included); in
``ordered`` groups a key's message is never delivered while an earlier one of the key is
leased to us (every backend: the portable layer's gate), and each key's messages are first
delivered in publish order (on partition-style backends only while no failure intervened,
``ORDER_SURVIVES_FAILURE``). Histories must agree where the contract fixes
them: the set of ids finally acked or dead-lettered equals the published set on both. Which
message a receive returns may differ (batch sizes, interleaving of keys), so per-operation
histories are not compared.

Real brokers wait in real time for leases, so examples are few and short; with ``CI`` set
Hypothesis is derandomized (same examples every run).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import mqabstract
from tests.brokers import in_ci

from .support import Reporter, body_for, cleanup, digest, kind, token

LEASE = 2.0
MAX_ATTEMPTS = 3
#: Examples per backend: each real-broker example costs seconds of real waiting
#: (``MQ_DIFFERENTIAL_EXAMPLES=N`` runs N on each, for a longer hunt).
EXAMPLES = {"memory": 12, "sqlite": 6, "rabbitmq": 3, "kafka": 3, "sqs": 3, "postgresql": 6}
RECEIVE_WAIT = {"memory": 0.2, "sqlite": 0.3, "rabbitmq": 0.8, "kafka": 1.5, "sqs": 1.0,
                "postgresql": 0.3}

Op = tuple[Any, ...]

_publish = st.tuples(st.just("publish"),
                     st.lists(st.sampled_from(["k0", "k1", None]), min_size=1, max_size=3))
_receive = st.tuples(st.just("receive"), st.integers(1, 4))
_settle = st.tuples(st.sampled_from(["ack", "ack", "nack", "extend"]), st.integers(0, 7),
                    st.sampled_from([0.0, 0.0, 1.0]))
_rare = st.sampled_from([("expire",), ("crash",)])
_stale = st.tuples(st.just("stale"), st.integers(0, 7),
                   st.sampled_from(["ack", "nack", "extend", "dead_letter"]))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[bool, list[Op]]:
    """(ordered, ops): a publish first, at most one expiry and one crash."""
    ordered = draw(st.booleans())
    ops: list[Op] = [draw(_publish)]
    ops += draw(st.lists(st.one_of(_publish, _receive, _receive, _settle), max_size=8))
    if draw(st.booleans()):
        at = draw(st.integers(1, len(ops)))
        rare = draw(_rare)
        ops.insert(at, rare)
        if rare == ("expire",) and draw(st.booleans()):
            ops.insert(at + 1, draw(_stale))
    return ordered, ops


@dataclass
class History:
    """What one run observed."""

    published: list[tuple[str, str | None]] = field(default_factory=list)
    deliveries: list[tuple[str, int, str]] = field(default_factory=list)
    acked: set[str] = field(default_factory=set)
    dead: dict[str, int] = field(default_factory=dict)
    order_violations: list[str] = field(default_factory=list)
    failure: bool = False  #: a crash or lease expiry happened (order is then not promised)
    stale: list[str] = field(default_factory=list)  #: outcome of each settle after the lease

    def problems(self, ordered: bool, fifo_group: bool = True) -> list[str]:
        """Broken invariants. Per-key first-delivery order is checked always on FIFO-group
        backends, and on partition-style ones only while no failure intervened (the
        contract's "while no failure intervenes")."""
        out: list[str] = []
        ids = [m for m, _ in self.published]
        finished = self.acked | set(self.dead)
        if set(ids) - finished:
            out.append(f"lost (neither acked nor dead): {sorted(set(ids) - finished)}")
        delivered = {m for m, _, _ in self.deliveries}
        if set(ids) - delivered:
            out.append(f"never delivered: {sorted(set(ids) - delivered)}")
        if delivered - set(ids):
            out.append(f"delivered but never published: {sorted(delivered - set(ids))}")
        wrong = {m for m, _, d in self.deliveries if d != digest(body_for(m))}
        if wrong:
            out.append(f"bytes changed on delivery: {sorted(wrong)}")
        per_id: dict[str, list[int]] = defaultdict(list)
        for mid, attempt, _ in self.deliveries:
            per_id[mid].append(attempt)
        for mid, attempts in per_id.items():
            if attempts[0] < 1 or any(b <= a for a, b in itertools.pairwise(attempts)):
                out.append(f"attempts of {mid} not increasing: {attempts}")
            if max(attempts) > MAX_ATTEMPTS:
                out.append(f"{mid} delivered with attempt {max(attempts)} > {MAX_ATTEMPTS}")
        for mid, attempts in self.dead.items():
            if attempts != MAX_ATTEMPTS:
                out.append(f"{mid} dead-lettered after {attempts} attempts, not {MAX_ATTEMPTS}")
        reached = [o for o in self.stale if o != "LeaseExpired"]
        if reached:
            out.append(f"settles after the lease deadline did not raise LeaseExpired: {reached}")
        if set(self.dead) & self.acked:
            out.append(f"both acked and dead: {sorted(set(self.dead) & self.acked)}")
        if ordered:
            out += self.order_violations  # one at a time: every backend, failure or not
        if ordered and (fifo_group or not self.failure):
            keyed: dict[str, list[str]] = defaultdict(list)
            for mid, key in self.published:
                if key is not None:
                    keyed[key].append(mid)
            first: list[str] = []
            for mid, _, _ in self.deliveries:
                if mid not in first:
                    first.append(mid)
            for key, mids in keyed.items():
                got = [m for m in first if m in mids]
                if got != mids[: len(got)]:
                    out.append(f"key {key}: first deliveries {got}, published {mids}")
        return out


# The contract orders a key's messages "to a single consumer while no failure intervenes"
# (partition / FIFO-group semantics), and one at a time on every backend (README, ordered
# groups). On these a key's publish order of first deliveries also survives a crash or an
# expiry (PostgreSQL, like SQLite: a nacked or expired row keeps its place, and a key's
# later rows wait while it is in the group); on Kafka (partition owner) and RabbitMQ a
# rebalance or a cut between a nack and its return may let a later one go first
# (docs/backends/kafka.md, "Ordered groups").
ORDER_SURVIVES_FAILURE = {"memory", "sqlite", "sqs", "postgresql"}
#: Backends where, in an ordered group, a consumer that stops receiving without closing
#: keeps its keys' messages until it resumes or leaves the group: Kafka (a partition has
#: one owner and ordered groups never hand records off; docs/backends/kafka.md, "Idle
#: hand-off") and RabbitMQ (a single active consumer gets everything until it goes away;
#: docs/backends/rabbitmq.md, "Queue types, priority and order"). There the abandoned
#: subscription of a ``crash`` leaves the group (is closed) before the drain, as a
#: crashed process's connection or session would end; elsewhere it stays open to the end
#: and its leases must run out.
HUNG_KEEPS_KEYS = {"kafka", "rabbitmq"}


def run(url: str, ordered: bool, ops: list[Op], wait: float,
        hung_keeps_keys: bool = False) -> History:
    """Apply ``ops`` to a fresh group at ``url``, drain it, and return what happened."""
    tok = token("d")
    topic, pattern, group = f"rel.{tok}.t", f"rel.{tok}.#", f"rel-{tok}"
    hist = History()
    counter = itertools.count()
    with mqabstract.connect(url) as mq:
        try:
            def subscribe() -> mqabstract.Subscription:
                return mq.subscribe(group, pattern, lease=LEASE, max_attempts=MAX_ATTEMPTS,
                                    ordered=ordered)

            sub = subscribe()
            abandoned: list[mqabstract.Subscription] = []
            held: list[tuple[mqabstract.Message, float]] = []  # (message, lease ends)
            stale: list[mqabstract.Message] = []  # held when their lease ran out

            def take(msgs: list[mqabstract.Message]) -> None:
                now = time.monotonic()
                live = {m.key: m.id for m, until in held if until > now + 0.3 and m.key}
                for msg in msgs:
                    if (ordered and msg.key in live
                            and live[msg.key] != msg.id):
                        hist.order_violations.append(
                            f"{msg.id} (key {msg.key}) delivered while {live[msg.key]} "
                            "of the same key was leased")
                    hist.deliveries.append((msg.id, msg.attempt, digest(msg.body)))
                    held.append((msg, now + LEASE))

            for op in ops:
                if op[0] == "publish":
                    batch = []
                    for key in op[1]:
                        mid = f"{tok}-{next(counter)}"
                        batch.append(mqabstract.OutgoingMessage(topic, body_for(mid), id=mid,
                                                                key=key))
                        hist.published.append((mid, key))
                    mq.publish_batch(batch)
                elif op[0] == "receive":
                    take(sub.receive(op[1], wait))
                elif op[0] in ("ack", "nack", "extend"):
                    # Only touch live leases: settling an expired receipt is allowed to do
                    # nothing, and the drain below settles whatever is left.
                    soon = time.monotonic() + 0.5
                    held[:] = [(m, until) for m, until in held if until > soon]
                    if not held:
                        continue
                    msg, until = held[op[1] % len(held)]
                    if op[0] == "ack":
                        msg.ack()
                        hist.acked.add(msg.id)
                        held.remove((msg, until))
                    elif op[0] == "nack":
                        msg.nack(op[2])
                        held.remove((msg, until))
                    else:
                        msg.extend(LEASE)
                        held[held.index((msg, until))] = (msg, time.monotonic() + LEASE)
                elif op[0] == "expire":
                    hist.failure = True
                    time.sleep(LEASE + 0.5)
                    stale += [m for m, _ in held]
                    held.clear()
                elif op[0] == "stale":
                    if not stale:
                        continue
                    msg = stale[op[1] % len(stale)]
                    try:
                        if op[2] == "extend":
                            msg.extend(LEASE)
                        elif op[2] == "dead_letter":
                            msg.dead_letter("differential: stale")
                        else:
                            getattr(msg, op[2])()
                        hist.stale.append(f"{op[2]} took effect")
                    except mqabstract.MQError as exc:
                        hist.stale.append(type(exc).__name__)
                elif op[0] == "crash":
                    hist.failure = True
                    abandoned.append(sub)  # never closed: its leases must run out
                    held.clear()
                    sub = subscribe()
            now = time.monotonic()
            for msg, until in held:  # leave the rest to the drain, attempt + 1
                if until > now + 0.5:
                    msg.nack()
            held.clear()
            if ordered and hung_keeps_keys:
                for s in abandoned:
                    s.close()
                abandoned.clear()
            want = {m for m, _ in hist.published}

            def settle(msgs: list[mqabstract.Message]) -> None:
                """Ack a received batch in one call; on a loaded machine a lease may run out
                first: such a message comes back with attempt + 1 and is acked then."""
                with contextlib.suppress(mqabstract.LeaseExpired):
                    sub.ack_many(msgs)
                hist.acked.update(m.id for m in msgs if m.settled)

            deadline = time.monotonic() + 30  # leases, nack delays, rebalances fit
            while time.monotonic() < deadline:
                for dl in mq.dead_letters(group, limit=1000):
                    hist.dead[dl.id] = dl.attempts
                if want <= hist.acked | set(hist.dead):
                    break
                msgs = sub.receive(10, wait)
                take(msgs)
                settle(msgs)
                held.clear()
            # nothing may come back after everything was settled
            extra = sub.receive(10, wait)
            take(extra)
            settle(extra)
            for s in abandoned:
                s.close()
        finally:
            cleanup(mq, group)
    return hist


def test_differential(backend: str, rel_url: str, reporter: Reporter) -> None:
    """Generated operation sequences: invariants hold on memory and on ``backend``, and the
    finally-settled id sets agree."""
    stats = {"examples": 0, "messages": 0, "delivered": 0, "dead_lettered": 0,
             "stale_settles": 0}
    wait = RECEIVE_WAIT[kind(backend)]

    # No shrinking on real brokers: every replay costs seconds of real waiting, and the
    # failing sequence is printed in full anyway.
    phases = list(Phase) if backend == "memory" else [Phase.explicit, Phase.generate]
    examples = int(os.environ.get("MQ_DIFFERENTIAL_EXAMPLES", EXAMPLES[kind(backend)]))
    @settings(max_examples=examples, deadline=None, derandomize=in_ci(),
              database=None, suppress_health_check=list(HealthCheck), phases=phases)
    @given(scenarios())
    # Always at least one stale settle per backend (the lease rule), besides generated ones.
    @example((False, [("publish", ["k0", None]), ("receive", 2), ("expire",),
                      ("stale", 0, "ack"), ("stale", 1, "dead_letter")]))
    def check(scenario: tuple[bool, list[Op]]) -> None:
        ordered, ops = scenario
        ref = run("memory://differential", ordered, ops, RECEIVE_WAIT["memory"])
        assert not ref.problems(ordered), ("memory reference", ops, ref.problems(ordered))
        got = ref if backend == "memory" else run(rel_url, ordered, ops, wait,
                                                    kind(backend) in HUNG_KEEPS_KEYS)
        problems = got.problems(ordered, kind(backend) in ORDER_SURVIVES_FAILURE)
        assert not problems, (backend, ops, problems)
        settled_ref = sorted(int(m.rsplit("-", 1)[1]) for m in ref.acked | set(ref.dead))
        settled_got = sorted(int(m.rsplit("-", 1)[1]) for m in got.acked | set(got.dead))
        assert settled_ref == settled_got, (ops, settled_ref, settled_got)
        stats["examples"] += 1
        stats["messages"] += len(got.published)
        stats["delivered"] += len(got.deliveries)
        stats["dead_lettered"] += len(got.dead)
        stats["stale_settles"] += len(got.stale)

    try:
        check()
    except BaseException:
        reporter.emit(scenario="differential (Hypothesis)", backend=backend, problems=1,
                      **stats)
        raise
    reporter.emit(scenario="differential (Hypothesis)", backend=backend, lost=0, **stats)
