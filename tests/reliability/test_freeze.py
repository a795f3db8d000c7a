"""Frozen consumers: a holder that stops (SIGSTOP, a GC or VM stall) without dying.

The lease rule (DESIGN) says its messages are deliverable to others within the lease plus
the backend's declared ``Capabilities.release_margin``, never while its lease is valid,
and that two deliveries of one id never carry the same attempt. When it wakes, its
settles raise ``LeaseExpired`` and reach nobody.

The chaos run mixes freezes and kills over thousands of messages. Both are judged by the
one history checker (``history.check``) with the backend's ``release_margin``: the
workers' deliveries carry their holder (pid) and lease, the freezes and kills are recorded
where this module does them.
"""

from __future__ import annotations

import os
import random
import time

import pytest

import mqabstract

from .support import (
    Ledger,
    Reporter,
    Worker,
    body_for,
    cleanup,
    collect_dead,
    drain,
    feed,
    freeze_a_holder,
    kind,
    seed_for,
    token,
)
from .test_faults import PROCESS_BACKENDS, QUIET, _check

FREEZE_LEASE = 4.0
HELD = 10


def _publish(mq: mqabstract.Broker, topic: str, prefix: str, count: int,
             ledger: Ledger, first: int = 0) -> None:
    """Publish ids prefix-first .. prefix-(first+count-1) and confirm them in the ledger."""
    for start in range(first, first + count, 500):
        ids = mq.publish_batch([
            mqabstract.OutgoingMessage(topic, body_for(f"{prefix}-{i}"), id=f"{prefix}-{i}")
            for i in range(start, min(first + count, start + 500))])
        for mid in ids:
            ledger.confirm(mid, body_for(mid))


@pytest.mark.backends(*PROCESS_BACKENDS)
def test_frozen_holder_releases_within_lease_and_margin(backend: str, rel_url: str,
                                                        reporter: Reporter) -> None:
    """Freeze a consumer holding messages; another gets them after its lease deadline and
    within the declared margin, with a higher attempt; the woken holder cannot ack."""
    tok = token("f")
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=50, backend=backend)
    with mqabstract.connect(rel_url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=FREEZE_LEASE, max_attempts=50)
        try:
            _publish(mq, topic, tok, 3 * HELD, ledger)
            run = freeze_a_holder(mq, rel_url, group, pattern, FREEZE_LEASE, HELD, ledger,
                                  margin)
        finally:
            cleanup(mq, group)
    held, after = run.held, run.after
    assert run.code == 0, run.stderr
    assert held and set(held) <= set(run.arrived), f"held {sorted(held)}, came back {run.arrived}"
    first = min(t for t, _ in run.arrived.values()) - run.started
    took = max(t for t, _ in run.arrived.values()) - run.started
    _check(ledger, reporter, release_margin=margin, scenario="consumer SIGSTOP", backend=backend,
           kills=1, lease=FREEZE_LEASE, took=round(took, 2), margin=margin)
    assert first >= FREEZE_LEASE, (
        f"another consumer got a held message {first:.2f}s after the receive started, "
        f"inside the {FREEZE_LEASE}s lease")
    assert took <= FREEZE_LEASE + margin, (
        f"held messages came back {took:.2f}s after the receive started; the lease is "
        f"{FREEZE_LEASE}s and {backend} declares release_margin={margin}s")
    assert [e[0] for e in after] == ["EXPIRED"] * len(held), after


#: Messages per chaos run. moto (the SQS stand-in) handles every call in Python with a scan
#: of the queue and of the topic's subscriptions: 5,000 take it about 12 minutes on two
#: cores, so CI runs 1,000 there; ``MQ_CHAOS_MESSAGES=5000 pytest tests/reliability/
#: test_freeze.py -k chaos`` runs the full one.
CHAOS_MESSAGES = {"sqs": 1000}
#: Unacked messages the chaos keeps published ahead of the workers. moto's receive walks
#: its whole queue (a receive of 10 took 0.6 s with 500 waiting), so a shallow queue there
#: keeps the run short without fewer messages or faults.
CHAOS_BACKLOG = {"sqs": 200}
#: Upper bound of a worker's "processing" per message (uniform): short, so the run's
#: length is set by its faults and leases rather than by sleeping workers (at 20 ms a
#: 5,000-message run was ~17 s of sleep for three workers before any fault).
CHAOS_WORK = 0.004


def _chaos_messages(backend: str) -> int:
    env = os.environ.get("MQ_CHAOS_MESSAGES")
    return int(env) if env else CHAOS_MESSAGES.get(kind(backend), 5000)
#: Lease and max_attempts of the chaos run; ``MQ_CHAOS_LEASE=2 MQ_CHAOS_MAX_ATTEMPTS=3``
#: sends about half the messages to the dead letters (each must be listed once). With a
#: lease that short on a loaded host, receives that outlast it are dropped unseen but count
#: as deliveries, and the checker reports dead letters with more attempts than it saw.
CHAOS_LEASE = float(os.environ.get("MQ_CHAOS_LEASE", "5"))
CHAOS_MAX_ATTEMPTS = int(os.environ.get("MQ_CHAOS_MAX_ATTEMPTS", "50"))


@pytest.mark.backends(*PROCESS_BACKENDS)
def test_chaos_freezes_and_kills(backend: str, rel_url: str, reporter: Reporter) -> None:
    """Three consumers work through 5,000 messages while, until they are done, one of
    them is frozen (0.3 to 1.5 leases) or SIGKILLed and replaced every second or so;
    nothing is lost and no attempt repeats."""
    seed = seed_for("chaos")
    rng = random.Random(seed)
    tok = token("c")
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=CHAOS_MAX_ATTEMPTS, backend=backend)
    total = _chaos_messages(backend)

    def start() -> Worker:
        return Worker("consume", rel_url, group, pattern, str(CHAOS_LEASE),
                      str(CHAOS_MAX_ATTEMPTS), "600", "none", str(rng.randrange(1 << 30)), "10",
                      str(CHAOS_WORK))

    with mqabstract.connect(rel_url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=CHAOS_LEASE, max_attempts=CHAOS_MAX_ATTEMPTS)
        workers: list[Worker] = []
        ended: list[Worker] = []
        freezes = kills = 0
        try:
            workers = [start() for _ in range(3)]
            limit = time.monotonic() + 600
            progress, still = -1, 0
            # Chaos until the workers have acked everything (or stall: then drain here).
            while time.monotonic() < limit and (still < 3 or freezes < 3 or kills < 2):
                acked = {e[1] for w in (*workers, *ended) for e in w.events()
                         if e[0] == "ACKED"}
                done = len(acked) >= total
                if done and freezes >= 3 and kills >= 2:
                    break  # (a fast backend finishes early: the chaos still happens)
                # Publishing goes on during the chaos, keeping a backlog (CHAOS_BACKLOG).
                backlog = CHAOS_BACKLOG.get(kind(backend), 1000)
                while (len(ledger.expected) < total
                       and len(ledger.expected) - len(acked) < backlog):
                    _publish(mq, topic, tok, min(250, backlog, total - len(ledger.expected)),
                             ledger,
                             first=len(ledger.expected))
                stalled = (not done and len(acked) == progress
                           and len(ledger.expected) >= total)
                still = still + 1 if stalled else 0
                progress = len(acked)
                time.sleep(rng.uniform(0.5, 1.5))
                i = rng.randrange(len(workers))
                if rng.random() < 0.7:
                    workers[i].freeze()
                    time.sleep(rng.uniform(0.3, 1.5) * CHAOS_LEASE)
                    workers[i].thaw()
                    freezes += 1
                else:
                    workers[i].kill()
                    ended.append(workers[i])
                    workers[i] = start()
                    kills += 1
            for w in workers:
                w.kill()
                ended.append(w)
            feed(ledger, *ended)  # merged in time order: the workers ran side by side
            with mq.subscribe(group, pattern, lease=CHAOS_LEASE,
                              max_attempts=CHAOS_MAX_ATTEMPTS) as sub:
                drain(sub, ledger, QUIET[kind(backend)] + CHAOS_LEASE, 120, set(ledger.expected))
            collect_dead(mq, group, ledger)
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.kill()
            cleanup(mq, group)
    _check(ledger, reporter, release_margin=margin, scenario="chaos: SIGSTOP + SIGKILL",
           backend=backend, kills=freezes + kills, freezes=freezes, seed=seed)
    assert freezes and kills, f"only {freezes} freezes and {kills} kills: no chaos"
