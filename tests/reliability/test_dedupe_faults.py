"""Effectively-once processing under SIGKILL: consumers with a SQLite dedupe store are
killed between their handler's success and the ack (and inside the handler's transaction);
every id's side effect must happen exactly once, none missing, none twice. Whatever the last
consumers leave (a killed member's partitions still being rebalanced) is finished by this
process through the same store, so "missing" means lost, not late.

The one history checker judges it: rule ``effects`` (each id's side effect exactly once,
from the store's ``effects`` table), ``attempts`` (the deliveries each handler saw, printed
by the workers) and ``dead-letters``. The workers run ``consume()``, which settles inside
the loop without printing, so the rules that need settles are skipped (``SKIPPED``)."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import time
from pathlib import Path

import pytest

import mqabstract
from mqabstract.dedupe import SQLiteStore

from .support import (
    LEASE,
    Ledger,
    Reporter,
    Worker,
    cleanup,
    collect_dead,
    feed,
    kind,
    run_replacing_killed,
    seed_for,
    token,
)
from .test_faults import PROCESS_BACKENDS, QUIET, _emit

#: Rules this scenario cannot judge, and why.
SKIPPED = {
    "lost": "acks happen inside consume() and are not printed; 'effects' (each confirmed "
            "id's side effect exactly once) is this scenario's loss check",
    "second-holder": "settles happen inside consume() and are not printed: a redelivery "
                     "after an ack cannot be told from one under a valid lease",
    "release": "settles are not printed: which messages a killed worker still held is "
               "unknown",
}

#: Messages and kills per backend: 10,000 on the embedded default, RabbitMQ and PostgreSQL;
#: fewer where each kill costs seconds (a Kafka rebalance) or moto is slow (~15 messages/s
#: here).
#: Planned kills alternate: after a commit (before the ack), inside a transaction.
COUNT = {"sqlite": 10_000, "rabbitmq": 10_000, "kafka": 2_000, "sqs": 300,
         "postgresql": 10_000}
KILLS = {"sqlite": 12, "rabbitmq": 12, "kafka": 4, "sqs": 4, "postgresql": 12}
WORKERS = 2


# The dedupe logic is the portable layer's: Kafka runs on its default client only (the
# kafka-python client's redelivery under kills is test_faults' and test_chaos' subject).
@pytest.mark.backends(*PROCESS_BACKENDS, one_client=True)
def test_sigkill_between_success_and_ack_processes_each_id_once(
        backend: str, rel_url: str, reporter: Reporter, tmp_path: Path) -> None:
    seed = seed_for(f"dedupe_sigkill_{backend}")
    rng = random.Random(seed)
    tok = token()
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    count, kills = COUNT[kind(backend)], KILLS[kind(backend)]
    span = max(2, count // (kills + WORKERS) // 2)  # the Nth handled message dies
    store = tmp_path / "dedupe.db"
    with contextlib.closing(sqlite3.connect(store)) as db, db:
        db.execute("CREATE TABLE effects (id TEXT, attempt INT, pid INT)")
    idle = QUIET[kind(backend)] + LEASE
    started = time.monotonic()
    ledger = Ledger(max_attempts=50, backend=backend)
    with mqabstract.connect(rel_url) as mq:
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        try:
            ids: list[str] = []
            for start in range(0, count, 500):
                ids += mq.publish_batch(
                    [mqabstract.OutgoingMessage(topic, b"work", id=f"{tok}-{i}")
                     for i in range(start, min(count, start + 500))])
            for mid in ids:
                ledger.confirm(mid, b"work")

            plans = [f"{'after' if n % 2 == 0 else 'inside'}:{rng.randint(1, span)}"
                     for n in range(kills)]

            planned: dict[int, str] = {}  # worker pid -> its plan (for the failure text)

            def spawn() -> Worker:
                plan = plans.pop(0) if plans else "none"
                w = Worker("dedupe", rel_url, group, pattern, str(LEASE), str(store),
                           plan, str(idle))
                planned[w.proc.pid] = plan
                return w

            finished, killed = run_replacing_killed(spawn, WORKERS, 600)
            # What the last consumers left (Kafka may still be rebalancing a killed member's
            # partitions away): this process finishes it, the same way (store, transaction).
            with SQLiteStore(store) as dedupe, \
                    mq.subscribe(group, pattern, lease=LEASE, max_attempts=50) as sub:

                def handler(msg: mqabstract.Message) -> None:
                    ledger.received(msg, sub, time.monotonic())
                    with dedupe.transaction(msg) as db:
                        db.execute("INSERT INTO effects VALUES (?, ?, ?)",
                                   (msg.id, msg.attempt, os.getpid()))

                margin = mq.capabilities.release_margin
                tail = sub.consume(handler, dedupe=dedupe,
                                   idle_timeout=QUIET[kind(backend)] + LEASE + margin)
            collect_dead(mq, group, ledger)
        finally:
            cleanup(mq, group)
    rows = dict(sqlite3.connect(store).execute(
        "SELECT id, count(*) FROM effects GROUP BY id").fetchall())
    twice = sorted(mid for mid, n in rows.items() if n > 1)
    missing = sorted(set(ids) - set(rows))
    feed(ledger, *killed, *finished)
    for mid, n in rows.items():
        ledger.history.effect(mid, n)
    if ledger.history.effects is None:
        ledger.history.effects = {}
    after_commit = sum(1 for w in killed for e in w.events() if e[0] == "KILLED")
    stats = [e for w in finished for e in w.events() if e[0] == "STATS"]
    duplicates = sum(int(e[3]) for e in stats) + tail.duplicates
    problems = _emit(ledger, reporter, release_margin=margin, skip=SKIPPED,
                     scenario="dedupe SIGKILL", backend=backend, kills=len(killed),
                     kills_after_commit=after_commit, duplicates=duplicates,
                     lost=len(missing), confirmed=count,
                     effects_twice=len(twice), effects_missing=len(missing),
                     finished_here=tail.received - tail.duplicates,
                     seconds=round(time.monotonic() - started, 1), seed=seed)
    assert not problems, "\n".join(problems)
    # The first consumers start with every message pending: the first plan (after a commit,
    # within the first ``span`` messages) always comes true; later ones may find the work
    # already done and exit normally.
    assert after_commit >= 1, (
        f"no kill between success and ack ({len(killed)} kills); per worker (plan, exit, "
        f"handled, first/last line): " + "; ".join(
            f"{planned[w.proc.pid]} {w.proc.returncode} "
            f"{sum(1 for e in w.events() if e[0] == 'RECV')} {w.lines[:1]} {w.lines[-1:]}"
            for w in (*killed, *finished)))
