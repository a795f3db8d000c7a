"""The outbox, its relay, the bridge and ``PostgresStore`` under SIGKILL.

* **Outbox**: writer threads commit N orders (a row of ``orders`` and its outbox message
  in one transaction; some transactions roll back instead), each holding its transaction
  open a little, while relay processes (``mqa relay``) are SIGKILLed at random and
  restarted. Every committed order's message must arrive with its id, none of a rolled-back
  one, duplicates only as a second copy of an id with the same body, and each key's first
  copies in commit order (the orders' per-key numbers, taken under the key's lock).
* **Bridge**: 10,000 messages in a group of one broker moved to another by ``mqa relay
  --from URL?group=G`` processes SIGKILLed at random: every id arrives, duplicates only by
  id. Runs SQLite → PostgreSQL by default; ``MQ_BRIDGE_FROM`` / ``MQ_BRIDGE_TO`` name other
  brokers (RabbitMQ → Kafka: see docs/reliability.md for the command).
* **PostgresStore**: consumers killed between their handler's committed effect and the ack
  (and inside the transaction): each id's effect exactly once.

Losses and duplicates are judged by the one history checker (``Ledger``); the outbox's own
rules (no rolled-back id, same body per id, per-key commit order) are checked here.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import mqabstract
from mqabstract import OutgoingMessage, outbox

from .support import (
    LEASE,
    REPO,
    Ledger,
    Reporter,
    Worker,
    body_for,
    feed,
    run_replacing_killed,
    seed_for,
    token,
)
from .test_faults import _emit

#: The relay's duplicates are second publishes of an id, each a first delivery (attempt 1)
#: at the target: allowed by the outbox contract, so two rules cannot judge them.
SKIP_RELAYED = {
    "attempts": "a relay's duplicate is a second publish of the id (attempt 1 again), which "
                "the outbox contract allows; checked here: same body, first copies in order",
    "second-holder": "a relay's duplicate is a second message at the target with the same "
                     "id, deliverable while the first copy is held (one receive may return "
                     "both); the source's side is what the relay's claims protect",
}


@pytest.fixture(scope="module")
def pg() -> str:
    from tests.brokers import resolve_url

    return resolve_url("postgresql").split("?")[0]


@pytest.fixture
def schema(pg: str) -> Iterator[str]:
    name = "rel_" + secrets.token_hex(5)
    yield name
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def _relay(source: str, target: str, *extra: str) -> subprocess.Popen[bytes]:
    """``mqa relay`` as a process (killed from outside only)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "mqabstract.cli", "relay", "--from", source,
                             "--to", target, *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _planned(source: str, target: str, batch: int, lease: float, plan: str) -> Worker:
    """A relay process that also SIGKILLs itself between the target's confirmation and the
    source's settle on its Nth claim (``worker.py relay``)."""
    return Worker("relay", source, target, str(batch), str(lease), plan)


class _Proc:
    """A ``Worker`` seen as the ``Popen`` the ``Killer`` handles."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.stderr = worker, None

    def poll(self) -> int | None:
        return self.worker.proc.poll()

    def send_signal(self, sig: int) -> None:
        self.worker.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.worker.proc.wait(timeout)

    def kill(self) -> None:
        self.worker.proc.kill()

    @property
    def returncode(self) -> int | None:
        return self.worker.proc.returncode


class Killer:
    """Keeps ``n`` relay processes running; ``kill_one`` SIGKILLs a random one and starts
    another in its place."""

    def __init__(self, n: int, start: Any, rng: random.Random) -> None:
        self.start, self.rng = start, rng
        self.procs = [start() for _ in range(n)]
        self.kills = 0  #: SIGKILLs from outside
        self.planned = 0  #: relays that killed themselves after the target confirmed

    def kill_one(self) -> bool:
        """SIGKILL one relay and start another; False when every relay running is one with
        a planned kill of its own (left to it)."""
        self.replace_dead()
        plain = [i for i, p in enumerate(self.procs) if not isinstance(p, _Proc)]
        if not plain:
            return False
        i = self.rng.choice(plain)
        proc = self.procs[i]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.kills += 1
        self.procs[i] = self.start()
        return True

    def replace_dead(self) -> None:
        """Restart relays that killed themselves (planned); any other exit fails."""
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is None:
                continue
            if code != -9:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise AssertionError(f"a relay exited {code} by itself: {err[-2000:]}")
            self.planned += 1
            self.procs[i] = self.start()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _drain(sub: mqabstract.Subscription, ledger: Ledger, quiet: float) -> list[Any]:
    """Everything the target has for the group, acked: (id, body) in delivery order."""
    got: list[Any] = []
    last = time.monotonic()
    while time.monotonic() - last < quiet:
        msgs = ledger.receive(sub, 500, 0.5)
        if msgs:
            last = time.monotonic()
            sub.ack_many(msgs)
            for m in msgs:
                ledger.ack(m.id)
                got.append((m.id, m.body, m.key))
    return got


def test_outbox_relays_sigkilled_at_random(pg: str, schema: str, tmp_path: Path,
                                           reporter: Reporter) -> None:
    seed = seed_for("outbox_sigkill")
    rng = random.Random(seed)
    orders, writers, relays = 2000, 2, 2
    keys = [f"c{i}" for i in range(20)]
    target = f"sqlite:///{tmp_path / 'target.db'}"
    source = f"{pg}?schema={schema}"
    tok = token()
    group = f"rel-{tok}"
    with psycopg.connect(pg, autocommit=True) as conn:
        outbox.setup(conn, schema=schema)
        conn.execute(f"CREATE TABLE {schema}.orders (id text PRIMARY KEY, key text, n int)")
    committed: dict[str, bytes] = {}
    rolled_back: set[str] = set()
    lock = threading.Lock()
    started = time.monotonic()

    def write(w: int) -> None:
        wrng = random.Random(seed + w)
        with psycopg.connect(pg, autocommit=True) as conn:
            for i in range(w, orders, writers):
                oid, key = f"{tok}-{i}", wrng.choice(keys)
                body = body_for(oid)
                try:
                    with conn.transaction():
                        outbox.publish(conn, f"orders.{tok}", body, key=key, id=oid,
                                       schema=schema)
                        # Under the key's outbox lock: n is the key's commit order.
                        conn.execute(f"INSERT INTO {schema}.orders SELECT %s, %s,"
                                     f" coalesce(max(n), 0) + 1 FROM {schema}.orders"
                                     " WHERE key = %s", (oid, key, key))
                        time.sleep(wrng.random() * 0.004)  # in flight a while
                        if wrng.random() < 0.1:
                            raise LookupError("the order is refused")
                except LookupError:
                    with lock:
                        rolled_back.add(oid)
                    continue
                with lock:
                    committed[oid] = body

    with mqabstract.connect(target) as mq:
        mq.declare(group, f"orders.{tok}")
        plans = [f"confirm:{rng.randint(1, 3)}" for _ in range(6)]

        def start() -> Any:  # half `mqa relay`, half relays with a planned self-kill
            if plans and rng.random() < 0.5:
                return _Proc(_planned(source, target, 50, 10.0, plans.pop()))
            return _relay(source, target, "--batch", "50", "--poll", "0.05", "--lease", "10")

        killer = Killer(relays, start, rng)
        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                time.sleep(rng.uniform(0.3, 1.2))
                writing = any(t.is_alive() for t in threads)
                with psycopg.connect(pg) as conn:
                    left = conn.execute(f"SELECT count(*) FROM {schema}.mq_outbox").fetchone()
                if not writing and left is not None and left[0] == 0:
                    break
                killer.kill_one()
        finally:
            for t in threads:
                t.join(60)
            killer.stop()
        # Whatever the last relays left (none, normally): moved here, the same way.
        with outbox.Relay(source, mq) as last:
            finished_here = last.drain()
        ledger = Ledger(max_attempts=50, backend="sqlite")
        for oid, body in committed.items():
            ledger.confirm(oid, body)
        with mq.subscribe(group, f"orders.{tok}", lease=LEASE, max_attempts=50) as sub:
            got = _drain(sub, ledger, 1.5)
    with psycopg.connect(pg) as conn:
        number = {oid: n for oid, n in conn.execute(f"SELECT id, n FROM {schema}.orders")}
    ids = [g[0] for g in got]
    phantom = sorted(set(ids) & rolled_back)
    unknown = sorted(set(ids) - set(committed) - rolled_back)
    other_body = sorted({mid for mid, body, _ in got if mid in committed
                         and body != committed[mid]})
    order_breaks = []
    seen: set[str] = set()
    last_n: dict[str, int] = {}
    for mid, _, key in got:
        if mid in seen or mid not in number:
            continue
        seen.add(mid)
        if number[mid] <= last_n.get(key, 0):
            order_breaks.append((key, mid, number[mid], last_n[key]))
        last_n[key] = number[mid]
    problems = _emit(ledger, reporter, release_margin=None, skip=SKIP_RELAYED,
                     scenario="outbox relay SIGKILL", backend="postgresql->sqlite",
                     orders=orders, committed=len(committed), rolled_back=len(rolled_back),
                     kills=killer.kills, self_kills=killer.planned, relays=relays,
                     delivered=len(ids),
                     duplicates=len(ids) - len(set(ids)), phantoms=len(phantom),
                     order_breaks=len(order_breaks), finished_here=finished_here,
                     seconds=round(time.monotonic() - started, 1), seed=seed)
    assert not problems, "\n".join(problems)
    assert not phantom, f"messages of rolled-back transactions arrived: {phantom[:10]}"
    assert not unknown, unknown[:10]
    assert not other_body, f"a copy with other bytes: {other_body[:10]}"
    assert not order_breaks, f"a key's first copies out of commit order: {order_breaks[:10]}"
    assert set(ids) == set(committed)
    assert killer.kills >= 3 and killer.planned >= 1


# -- the bridge ------------------------------------------------------------------------------
def _bridge_pair(pg: str, tmp_path: Path) -> tuple[str, str, str]:
    """(source URL, target URL, label): ``MQ_BRIDGE_FROM``/``MQ_BRIDGE_TO``, else SQLite →
    this test bed's PostgreSQL."""
    src, dst = os.environ.get("MQ_BRIDGE_FROM"), os.environ.get("MQ_BRIDGE_TO")
    if src and dst:
        return src, dst, f"{src.split(':')[0]}->{dst.split(':')[0]}"
    return (f"sqlite:///{tmp_path / 'bridge-src.db'}",
            f"{pg}?schema=rel_b{secrets.token_hex(4)}", "sqlite->postgresql")


def test_bridge_sigkilled_at_random_moves_every_id(pg: str, tmp_path: Path,
                                                   reporter: Reporter) -> None:
    seed = seed_for("bridge_sigkill")
    rng = random.Random(seed)
    count = int(os.environ.get("MQ_BRIDGE_COUNT", "10000"))
    src, dst, label = _bridge_pair(pg, tmp_path)
    tok = token()
    topic, group, out_group = f"rel.{tok}.moved", f"bridge-{tok}", f"rel-{tok}"
    started = time.monotonic()
    ledger = Ledger(max_attempts=50, backend=label)
    with mqabstract.connect(src) as a, mqabstract.connect(dst) as b:
        a.declare(group, f"rel.{tok}.#", lease=LEASE, max_attempts=1000)
        b.declare(out_group, f"rel.{tok}.#", lease=LEASE, max_attempts=50)
        for start in range(0, count, 500):
            ids = a.publish_batch([OutgoingMessage(topic, body_for(f"{tok}-{i}"),
                                                   id=f"{tok}-{i}", key=f"k{i % 7}")
                                   for i in range(start, min(count, start + 500))])
            for mid in ids:
                ledger.confirm(mid, body_for(mid))
        bridge_src = f"{src}{'&' if '?' in src else '?'}group={group}&pattern=rel.{tok}.%23"
        plans = [f"confirm:{rng.randint(1, 8)}" for _ in range(4)]

        def start() -> Any:  # mostly `mqa relay`; some kill themselves before acking
            if plans and rng.random() < 0.3:
                return _Proc(_planned(bridge_src, dst, 200, LEASE, plans.pop()))
            return _relay(bridge_src, dst, "--batch", "200", "--lease", str(LEASE), "--poll",
                          "0.2")

        # Kills go by progress, not by the clock: one as the backlog passes each mark, so a
        # bridge that moves its messages in two seconds is killed as often as a slow one
        # (on a timer, a fast SQLite -> PostgreSQL bridge once finished with no kill).
        marks = sorted((count * rng.uniform(lo, lo + 0.15) for lo in (0.1, 0.35, 0.6)),
                       reverse=True)
        killer = Killer(2, start, rng)
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                time.sleep(0.05)
                st = a.stats(group)
                left = sum(n or 0 for n in (st.ready, st.leased, st.delayed))
                if not left:
                    break
                killer.replace_dead()
                if marks and left <= marks[0] and killer.kill_one():
                    marks.pop(0)
        finally:
            killer.stop()
        with outbox.Relay(bridge_src, b, lease=LEASE) as last:  # what the last ones left
            finished_here = 0
            while n := last.step(1.0):
                finished_here += n
        with b.subscribe(out_group, f"rel.{tok}.#", lease=LEASE, max_attempts=50) as sub:
            got = _drain(sub, ledger, 3.0)
        with contextlib.suppress(mqabstract.MQError):
            a.delete_group(group)
            b.delete_group(out_group)
    if "?schema=rel_b" in dst:  # this test's own schema on the test bed's PostgreSQL
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {dst.rsplit('=', 1)[1]} CASCADE")
    ids = [g[0] for g in got]
    other_body = sorted({mid for mid, body, _ in got if body != body_for(mid)})
    problems = _emit(ledger, reporter, release_margin=None, skip=SKIP_RELAYED,
                     scenario="bridge SIGKILL", backend=label, confirmed=count,
                     kills=killer.kills, self_kills=killer.planned, delivered=len(ids),
                     duplicates=len(ids) - len(set(ids)), finished_here=finished_here,
                     seconds=round(time.monotonic() - started, 1), seed=seed)
    assert not problems, "\n".join(problems)
    assert not other_body, other_body[:10]
    assert len(set(ids)) == count
    assert killer.kills >= 2


# -- PostgresStore -------------------------------------------------------------------------
def test_postgres_store_sigkill_between_effect_and_ack(pg: str, schema: str, tmp_path: Path,
                                                       reporter: Reporter) -> None:
    """test_dedupe_faults' scenario with the store (and the effects) in PostgreSQL, on the
    embedded broker: every id's effect exactly once."""
    from mqabstract.dedupe import PostgresStore

    seed = seed_for("pgstore_sigkill")
    rng = random.Random(seed)
    count, kills, workers_n = 2000, 8, 2
    span = max(2, count // (kills + workers_n) // 2)
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    tok = token()
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.effects (id text, attempt int, pid int)")
    store_spec = f"{pg}#{schema}"
    started = time.monotonic()
    ledger = Ledger(max_attempts=50, backend="sqlite")
    with mqabstract.connect(url) as mq:
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        ids: list[str] = []
        for start in range(0, count, 500):
            ids += mq.publish_batch([OutgoingMessage(topic, b"work", id=f"{tok}-{i}")
                                     for i in range(start, min(count, start + 500))])
        for mid in ids:
            ledger.confirm(mid, b"work")
        plans = [f"{'after' if n % 2 == 0 else 'inside'}:{rng.randint(1, span)}"
                 for n in range(kills)]

        def spawn() -> Worker:
            return Worker("dedupe", url, group, pattern, str(LEASE), store_spec,
                          plans.pop(0) if plans else "none", "2.0")

        finished, killed = run_replacing_killed(spawn, workers_n, 300)
        with PostgresStore(pg, schema=schema) as store, \
                mq.subscribe(group, pattern, lease=LEASE, max_attempts=50) as sub:

            def handler(msg: mqabstract.Message) -> None:
                ledger.received(msg, sub, time.monotonic())
                with store.transaction(msg) as db:
                    db.execute(f"INSERT INTO {schema}.effects VALUES (%s, %s, %s)",
                               (msg.id, msg.attempt, os.getpid()))

            margin = mq.capabilities.release_margin
            tail = sub.consume(handler, dedupe=store, idle_timeout=1.0 + LEASE + margin)
    with psycopg.connect(pg) as conn:
        rows = dict(conn.execute(f"SELECT id, count(*) FROM {schema}.effects GROUP BY id"
                                 ).fetchall())
    twice = sorted(mid for mid, n in rows.items() if n > 1)
    missing = sorted(set(ids) - set(rows))
    feed(ledger, *killed, *finished)
    for mid, n in rows.items():
        ledger.history.effect(mid, n)
    after_commit = sum(1 for w in killed for e in w.events() if e[0] == "KILLED")
    from .test_dedupe_faults import SKIPPED

    problems = _emit(ledger, reporter, release_margin=margin, skip=SKIPPED,
                     scenario="PostgresStore SIGKILL", backend="sqlite+postgres-store",
                     kills=len(killed), kills_after_commit=after_commit, confirmed=count,
                     effects_twice=len(twice), effects_missing=len(missing),
                     finished_here=tail.received - tail.duplicates,
                     seconds=round(time.monotonic() - started, 1), seed=seed)
    assert not problems, "\n".join(problems)
    assert not twice and not missing, (twice[:10], missing[:10])
    assert after_commit >= 1
