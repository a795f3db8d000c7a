"""Fault injection: killed consumers and publishers, abandoned leases, poison messages.

Every scenario records a history in a :class:`Ledger` (publishes, deliveries with their
holder and lease, settles, kills and freezes, dead letters) and the one history checker
(``history.check``, DESIGN "Reliability: one history checker") judges it: nothing
confirmed is lost, attempts strictly increase per id, no second holder while a lease is
valid, a killed or abandoned holder's messages come back within lease + the backend's
``release_margin``, dead letters at ``max_attempts`` and once. Duplicates are allowed
(at-least-once) and counted in the report.

Process kills apply to backends shared between processes; the in-process memory hub gets
the "abandoned consumer" variant (a consumer that stops without settling or closing).
"""

from __future__ import annotations

import random
import threading
import time

import pytest

import mqabstract
from mqabstract import Backoff, Feature

from .history import DEAD_LETTERED, NACKED
from .support import (
    LEASE,
    Ledger,
    Reporter,
    Worker,
    body_for,
    cleanup,
    collect_dead,
    drain,
    feed,
    kind,
    seed_for,
    token,
)

PROCESS_BACKENDS = ("sqlite", "rabbitmq", "kafka", "sqs", "postgresql")

#: Seconds of silence after which a backend has nothing more to deliver: leases of killed
#: consumers (LEASE) must run out first, and Kafka must also rebalance a dead member away
#: (session timeout 3 s + a join). PostgreSQL: an expired lease is found within the
#: receiver's ``poll_interval`` (0.5 s), like SQLite's.
QUIET = {"memory": 0.5, "sqlite": 1.0, "rabbitmq": 1.5, "sqs": 2.5, "kafka": 4.0,
         "postgresql": 1.0}


def _emit(ledger: Ledger, reporter: Reporter, *, release_margin: float | None,
          skip: dict[str, str] | None = None, **row: object) -> list[str]:
    """Judge the scenario's history (``release_margin``: the backend's; ``skip``:
    rules this scenario cannot judge, with why), report its counts (also when it is about
    to fail) and return the violations."""
    problems = ledger.problems(release_margin=release_margin, skip=skip)
    summary = ledger.summary()
    for rule in skip or ():  # the ledger did not judge it: its count would claim it held
        summary.pop(rule, None)
    counts = {**summary, **row}  # (a scenario may count some itself, e.g. by effects)
    reporter.emit(**counts, problems=len(problems),
                  **({"skipped_rules": sorted(skip)} if skip else {}))
    return problems


def _check(ledger: Ledger, reporter: Reporter, *, release_margin: float | None,
           skip: dict[str, str] | None = None, **row: object) -> None:
    problems = _emit(ledger, reporter, release_margin=release_margin, skip=skip, **row)
    assert not problems, "\n".join(problems)


# -- consumers killed at random points ---------------------------------------------------
@pytest.mark.backends(*PROCESS_BACKENDS)
def test_consumer_sigkill(backend: str, rel_url: str, reporter: Reporter) -> None:
    """Consumers SIGKILLed after receive, just before ack, right after ack and at a random
    moment; the survivors must finish every message."""
    seed = seed_for("consumer_sigkill")
    rng = random.Random(seed)
    tok = token()
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=50, backend=backend)
    with mqabstract.connect(rel_url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        try:
            ids = mq.publish_batch(
                [mqabstract.OutgoingMessage(topic, body_for(f"{tok}-{i}"), id=f"{tok}-{i}")
                 for i in range(40)]
            )
            for mid in ids:
                ledger.confirm(mid, body_for(mid))
            plans = [f"recv:{rng.randint(1, 4)}", f"acking:{rng.randint(1, 6)}",
                     f"acked:{rng.randint(1, 6)}", "timed"]
            rng.shuffle(plans)
            kills = 0
            for plan in [*plans, "none"]:
                final = plan == "none"
                spec = "none" if plan in ("timed", "none") else plan
                idle = QUIET[kind(backend)] + LEASE if final else 60.0
                worker = Worker("consume", rel_url, group, pattern, str(LEASE), "50",
                                str(idle), spec, str(rng.randrange(1 << 30)))
                if plan == "timed":
                    assert worker.wait_for("RECV", 1, 90), worker.stderr
                    time.sleep(rng.uniform(0.0, 0.3))
                    worker.kill()
                    code = -9
                else:
                    code = worker.finish(180)
                feed(ledger, worker)
                if final:
                    assert code == 0, f"final consumer exited {code}: {worker.stderr}"
                else:
                    assert code == -9, f"{plan}: exited {code}: {worker.stderr}"
                    kills += 1
            # Whatever the last consumer left (e.g. Kafka still rebalancing): drain here.
            with mq.subscribe(group, pattern, lease=LEASE, max_attempts=50) as sub:
                drain(sub, ledger, QUIET[kind(backend)], 60, set(ledger.expected))
            collect_dead(mq, group, ledger)
        finally:
            cleanup(mq, group)
    _check(ledger, reporter, release_margin=margin, scenario="consumer SIGKILL", backend=backend,
           kills=kills, seed=seed)


# -- publisher killed mid-batch -------------------------------------------------------------
@pytest.mark.backends(*PROCESS_BACKENDS)
def test_publisher_sigkill(backend: str, rel_url: str, reporter: Reporter) -> None:
    """A publisher SIGKILLed mid-stream: every publish that returned is delivered; those in
    flight may or may not be, but nothing else appears."""
    seed = seed_for("publisher_sigkill")
    rng = random.Random(seed)
    tok = token()
    topic, pattern, group = f"rel.{tok}.pub", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=50, backend=backend)
    with mqabstract.connect(rel_url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=10.0, max_attempts=50)
        try:
            worker = Worker("publish", rel_url, topic, "100000", tok, str(seed))
            assert worker.wait_for("PUB", rng.randint(15, 40), 90), worker.stderr
            time.sleep(rng.uniform(0.0, 0.05))  # land inside a publish or a batch
            worker.kill()
            tried = {m for ev in worker.events() if ev[0] == "TRY" for m in ev[1:]}
            for ev in worker.events():
                if ev[0] == "PUB":
                    for mid in ev[1:]:
                        ledger.confirm(mid, body_for(mid))
            for mid in sorted(tried - set(ledger.expected)):  # in flight at the kill
                ledger.in_flight(mid, body_for(mid))
            assert ledger.expected, "publisher was killed before any publish returned"
            with mq.subscribe(group, pattern, lease=10.0, max_attempts=50) as sub:
                drain(sub, ledger, QUIET[kind(backend)], 60, set(ledger.expected))
            collect_dead(mq, group, ledger)
        finally:
            cleanup(mq, group)
    in_flight_delivered = len(set(ledger.maybe) & ledger.acked)
    _check(ledger, reporter, release_margin=margin, scenario="publisher SIGKILL", backend=backend,
           kills=1, in_flight_delivered=in_flight_delivered, seed=seed)


# -- abandoned consumer (the in-process form of a crash) ---------------------------------------
def test_abandoned_consumer(backend: str, rel_url: str, reporter: Reporter) -> None:
    """A consumer that takes messages and stops without settling or closing (hung or dead
    thread): after the lease, another consumer gets them with attempt + 1."""
    tok = token()
    topic, pattern, group = f"rel.{tok}.a", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=50, backend=backend)
    with mqabstract.connect(rel_url) as mq, mqabstract.connect(rel_url) as other:
        margin = mq.capabilities.release_margin
        try:
            hung = mq.subscribe(group, pattern, lease=LEASE, max_attempts=50)
            for mid in mq.publish_batch([mqabstract.OutgoingMessage(
                    topic, body_for(f"{tok}-{i}"), id=f"{tok}-{i}") for i in range(20)]):
                ledger.confirm(mid, body_for(mid))
            taken: list[mqabstract.Message] = []
            deadline = time.monotonic() + 30
            while len(taken) < 10 and time.monotonic() < deadline:
                # Every other one is acked as it comes, within its lease (collecting all ten
                # first could outlast the 2 s lease of the first ones on a slow broker).
                for msg in ledger.receive(hung, 10 - len(taken), 1.0, holder="hung"):
                    if len(taken) % 2 == 0:
                        at = time.monotonic()
                        msg.ack()
                        ledger.ack(msg.id, "hung", at)
                    taken.append(msg)
            assert taken, "the first consumer got nothing"
            # ``hung`` is never used again: its leases must run out. In the history it is
            # a holder frozen from now to the end.
            ledger.history.frozen("hung", time.monotonic(), None)
            with other.subscribe(group, pattern, lease=LEASE, max_attempts=50) as sub:
                drain(sub, ledger, QUIET[kind(backend)] + LEASE, 60, set(ledger.expected))
            back = [m for m in taken if m.id not in {t.id for t in taken[::2]}]
            collect_dead(mq, group, ledger)
        finally:
            cleanup(mq, group)
    problems = _emit(ledger, reporter, release_margin=margin, scenario="abandoned consumer",
                     backend=backend, kills=1)
    attempts = {mid: a for mid, a, _ in ledger.deliveries}  # the last attempt seen per id
    assert all(attempts[m.id] >= 2 for m in back), attempts
    assert not problems, "\n".join(problems)


# -- poison messages ---------------------------------------------------------------------------
def test_poison_messages_do_not_block(backend: str, rel_url: str, reporter: Reporter) -> None:
    """Messages whose handler always fails are dead-lettered after max_attempts; the others
    are acked on their first delivery, long before the poison ones are given up."""
    tok = token()
    topic, pattern, group = f"rel.{tok}.p", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=3, backend=backend)
    poison: set[str] = set()
    normal: set[str] = set()
    acked_at: dict[str, float] = {}
    stop = threading.Event()
    with mqabstract.connect(rel_url) as mq:
        margin = mq.capabilities.release_margin
        try:
            sub = mq.subscribe(group, pattern, lease=5.0, max_attempts=3)
            batch = [
                mqabstract.OutgoingMessage(topic, body_for(f"{tok}-{i}"), id=f"{tok}-{i}",
                                           headers={"poison": "raise" if i < 2 else "no"})
                for i in range(32)  # the two poison ones at the head of the queue
            ]
            for i, mid in enumerate(mq.publish_batch(batch)):
                (poison if i < 2 else normal).add(mid)
                ledger.confirm(mid, body_for(mid))
            fails: dict[str, int] = {}
            last_poison_failure = [0.0]

            def handler(msg: mqabstract.Message) -> None:
                # The receive call had returned by now (the latest time for it); the
                # consume loop settles after the handler returns: the settle is recorded
                # here, a moment before it starts.
                ledger.received(msg, sub, time.monotonic())
                is_poison = msg.headers.get("poison") == "raise"
                if is_poison:
                    fails[msg.id] = fails.get(msg.id, 0) + 1
                    last_poison_failure[0] = time.monotonic()
                else:
                    acked_at[msg.id] = time.monotonic()
                    ledger.ack(msg.id)
                if len(acked_at) == len(normal) and all(fails.get(p, 0) >= 3 for p in poison):
                    stop.set()
                if is_poison:
                    ledger.settle(msg.id, DEAD_LETTERED if msg.attempt >= 3 else NACKED)
                    raise ValueError("poison")

            # Poison retries 1.5 s apart: the last failure comes ≥ 3 s after the first, time
            # for the 30 others on a slow broker too (moto under a loaded CI took 2.2 s).
            since = time.monotonic()
            stats = sub.consume(handler, idle_timeout=30, wait=0.5, stop=stop,
                                backoff=Backoff(initial=1.5, maximum=1.5, jitter=0))
            ledger.history.receiving("here", since, time.monotonic())
            sub.close()
            # the consume loop dead-letters a handler's error on the last attempt: the
            # attempts ran out, so it must carry max_attempts
            collect_dead(mq, group, ledger, exhausted_too=("ValueError: poison",))
        finally:
            cleanup(mq, group)
    problems = _emit(ledger, reporter, release_margin=margin, scenario="poison (handler raises)",
                     backend=backend, kills=0, poison=len(poison))
    assert set(ledger.dead) == poison, f"dead letters {ledger.dead} != poison {poison}"
    assert all(n == 3 for n in ledger.dead.values()), ledger.dead
    firsts = {mid: a for mid, a, _ in ledger.deliveries if mid in normal}
    assert set(acked_at) == normal and all(a == 1 for a in firsts.values()), firsts
    # Not blocked: every other message was done before the poison ones were given up.
    assert max(acked_at.values()) < last_poison_failure[0]
    assert stats.dead_lettered == len(poison), stats
    assert not problems, "\n".join(problems)


@pytest.mark.backends(*PROCESS_BACKENDS)
def test_poison_that_kills_the_consumer(backend: str, rel_url: str,
                                        reporter: Reporter) -> None:
    """A message that crashes every consumer receiving it: after max_attempts leases ran
    out it is dead-lettered, and the other messages still get through."""
    seed = seed_for("poison_crash")
    rng = random.Random(seed)
    tok = token()
    topic, pattern, group = f"rel.{tok}.k", f"rel.{tok}.#", f"rel-{tok}"
    max_attempts = 2
    ledger = Ledger(max_attempts=max_attempts, backend=backend)
    # The worker takes one message at a time. On RabbitMQ the client also prefetches
    # (`prefetch`, default 100), and a crashed process's prefetched messages come back
    # counted as delivered (x-delivery-count): exact crash attempts need prefetch=1, as
    # docs/backends/rabbitmq.md says.
    if backend == "rabbitmq":
        rel_url += ("&" if "?" in rel_url else "?") + "prefetch=1"
    with mqabstract.connect(rel_url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=LEASE, max_attempts=max_attempts)
        try:
            batch = [
                mqabstract.OutgoingMessage(topic, body_for(f"{tok}-{i}"), id=f"{tok}-{i}",
                                           headers={"poison": "crash" if i == 5 else "no"})
                for i in range(12)
            ]
            for mid in mq.publish_batch(batch):
                ledger.confirm(mid, body_for(mid))
            kills = 0
            for _ in range(max_attempts + 3):
                worker = Worker("consume", rel_url, group, pattern, str(LEASE),
                                str(max_attempts), str(QUIET[kind(backend)] + LEASE), "none",
                                str(rng.randrange(1 << 30)), "1")  # one at a time: a
                # crash must not cost the poison's batch-mates an attempt
                code = worker.finish(180)
                feed(ledger, worker)
                if code == 0:
                    break
                assert code == -9, f"exited {code}: {worker.stderr}"
                kills += 1
            collect_dead(mq, group, ledger)
        finally:
            cleanup(mq, group)
    problems = _emit(ledger, reporter, release_margin=margin, scenario="poison (kills consumer)",
                     backend=backend, kills=kills, seed=seed)
    assert kills == max_attempts, f"{kills} crashes for max_attempts={max_attempts}"
    seen = {mid: [a for m, a, _ in ledger.deliveries if m == mid] for mid in ledger.dead}
    assert list(ledger.dead) == [f"{tok}-5"], f"dead: {ledger.dead}; their deliveries {seen}"
    assert ledger.dead[f"{tok}-5"] == max_attempts
    assert not problems, "\n".join(problems)


def test_memory_has_no_process_faults() -> None:
    """The memory hub is process-local: killing a process loses it by design (documented);
    its crash coverage is the abandoned-consumer scenario."""
    with mqabstract.connect("memory://rel-doc") as mq:
        assert not mq.capabilities.shared_between_processes
        assert mq.capabilities.supports(Feature.DEAD_LETTER)
