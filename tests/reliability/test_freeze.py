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
import threading
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
    with ledger.connect(rel_url) as mq:
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


#: Faults per chaos run: ``CHAOS_KILLS`` SIGKILLs and the rest freezes, in a random
#: order on random workers. The run is defined by its faults, not by a message count:
#: publishing keeps a backlog in front of the workers until the last fault, so every
#: fault lands on busy holders, and the run lasts as long as its faults (a freeze lasts
#: 0.3 to 1.5 leases) whatever the backend's speed. ``MQ_CHAOS_FAULTS=40`` runs a longer
#: one.
CHAOS_FAULTS = int(os.environ.get("MQ_CHAOS_FAULTS", "8"))
CHAOS_KILLS = max(1, CHAOS_FAULTS * 3 // 8)
#: Most messages one run publishes (a fast backend under a long run stops here and its
#: remaining faults land on the backlog it still holds).
CHAOS_MAX_MESSAGES = 20_000
#: Unacked messages the chaos keeps published ahead of the workers, topped up every
#: ``TOP_UP`` seconds: the holders stay busy, and the queue stays shallow. It must stay
#: shallow: a released message goes back behind what is queued (RabbitMQ and Kafka
#: re-publish it at the tail), and the checker's release rule times its next delivery, so
#: behind a deep queue it is late by the queue's length (with 1,000 queued at ~150 a
#: second, 7-11 s past lease + margin on RabbitMQ) while it was deliverable in time.
CHAOS_BACKLOG = 100
TOP_UP = 0.1
#: Upper bound of a worker's "processing" per message (uniform): short, so the queue
#: ahead of a released message empties fast.
CHAOS_WORK = 0.004
#: Lease and max_attempts of the chaos run; ``MQ_CHAOS_LEASE=2 MQ_CHAOS_MAX_ATTEMPTS=3``
#: sends about half the messages to the dead letters (each must be listed once). With a
#: lease that short on a loaded host, receives that outlast it are dropped unseen but count
#: as deliveries, and the checker reports dead letters with more attempts than it saw.
CHAOS_LEASE = float(os.environ.get("MQ_CHAOS_LEASE", "5"))
CHAOS_MAX_ATTEMPTS = int(os.environ.get("MQ_CHAOS_MAX_ATTEMPTS", "50"))


@pytest.mark.backends(*PROCESS_BACKENDS)
def test_chaos_freezes_and_kills(backend: str, rel_url: str, reporter: Reporter) -> None:
    """Three consumers work through a steady backlog while one of them is frozen (0.3 to
    1.5 leases) or SIGKILLed and replaced every second or so, ``CHAOS_FAULTS`` times
    (``CHAOS_KILLS`` kills); then the rest is drained: nothing is lost and no attempt
    repeats."""
    seed = seed_for("chaos")
    rng = random.Random(seed)
    tok = token("c")
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=CHAOS_MAX_ATTEMPTS, backend=backend)

    def start() -> Worker:
        return Worker("consume", rel_url, group, pattern, str(CHAOS_LEASE),
                      str(CHAOS_MAX_ATTEMPTS), "600", "none", str(rng.randrange(1 << 30)), "10",
                      str(CHAOS_WORK))

    with ledger.connect(rel_url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=CHAOS_LEASE, max_attempts=CHAOS_MAX_ATTEMPTS)
        workers: list[Worker] = []
        ended: list[Worker] = []
        freezes = kills = 0
        try:
            workers = [start() for _ in range(3)]
            began = time.monotonic()
            plan = ["kill"] * CHAOS_KILLS + ["freeze"] * (CHAOS_FAULTS - CHAOS_KILLS)
            rng.shuffle(plan)

            seen: dict[int, int] = {}  # worker pid -> its lines already counted
            acked: set[str] = set()

            def top_up() -> None:
                """Publishing goes on during the chaos, keeping the backlog full."""
                for w in (*workers, *ended):
                    lines = w.lines[seen.get(w.proc.pid, 0):]
                    seen[w.proc.pid] = seen.get(w.proc.pid, 0) + len(lines)
                    acked.update(ln.split()[1] for ln in lines if ln.startswith("ACKED "))
                while (len(ledger.expected) < CHAOS_MAX_MESSAGES
                       and len(ledger.expected) - len(acked) < CHAOS_BACKLOG):
                    _publish(mq, topic, tok, CHAOS_BACKLOG, ledger, first=len(ledger.expected))

            def busy(seconds: float) -> None:
                """Sleep ``seconds`` while keeping the backlog topped up."""
                until = time.monotonic() + seconds
                while (left := until - time.monotonic()) > 0:
                    top_up()
                    time.sleep(min(TOP_UP, left))

            for fault in plan:
                busy(rng.uniform(0.5, 1.5))
                i = rng.randrange(len(workers))
                if fault == "freeze":
                    # The thaw is on its own timer: a worker frozen inside a SQLite write
                    # transaction holds the file's lock, so this thread's top-up publish
                    # waits for it, and a thaw queued behind that publish never came (the
                    # publish hit its 10 s busy timeout: a test deadlock, not the backend's).
                    frozen_for = rng.uniform(0.3, 1.5) * CHAOS_LEASE
                    workers[i].freeze()
                    thaw = threading.Timer(frozen_for, workers[i].thaw)
                    thaw.start()
                    busy(frozen_for)  # the other two go on
                    thaw.join()
                    freezes += 1
                else:
                    workers[i].kill()
                    ended.append(workers[i])
                    workers[i] = start()
                    kills += 1
            chaos_s = time.monotonic() - began
            for w in workers:
                w.kill()
                ended.append(w)
            feed(ledger, *ended)  # merged in time order: the workers ran side by side
            left = len(set(ledger.expected) - ledger.acked)
            began = time.monotonic()
            with mq.subscribe(group, pattern, lease=CHAOS_LEASE,
                              max_attempts=CHAOS_MAX_ATTEMPTS) as sub:
                # (an ack that a kill cut short may have landed: such an id need not
                # come back, and waiting for it would run the drain to its limit)
                drain(sub, ledger, QUIET[kind(backend)] + CHAOS_LEASE, 120,
                      set(ledger.expected) - ledger.history.in_doubt())
            collect_dead(mq, group, ledger)
            drain_s = time.monotonic() - began
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.kill()
            cleanup(mq, group)
    _check(ledger, reporter, release_margin=margin, scenario="chaos: SIGSTOP + SIGKILL",
           backend=backend, kills=freezes + kills, freezes=freezes, seed=seed,
           chaos_s=round(chaos_s, 1), drained=left, drain_s=round(drain_s, 1))
    assert freezes and kills, f"only {freezes} freezes and {kills} kills: no chaos"
