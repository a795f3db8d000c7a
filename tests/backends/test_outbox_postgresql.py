"""The transactional outbox and the dedupe store on PostgreSQL: rows written in the
application's psycopg transaction, a key's commit order kept while a transaction holding an
earlier row of the key is still open, several relays without double work, the same-database
target (``publish_direct``), ``PostgresStore.transaction``.

Needs a server: ``scripts/brokers up postgresql`` (or ``MQ_TEST_POSTGRESQL_URL``). Every
test works in a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import mqabstract
from mqabstract import OutgoingMessage, outbox
from mqabstract.errors import ConnectionFailed, Duplicate, InvalidArgument, InvalidName, NotFound
from tests.brokers import resolve_url

Conn = psycopg.Connection[Any]


@pytest.fixture(scope="module")
def server() -> str:
    return resolve_url("postgresql")


@pytest.fixture
def schema(server: str) -> Iterator[str]:
    name = "o_" + secrets.token_hex(6)
    yield name
    with psycopg.connect(server.split("?")[0], autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@pytest.fixture
def source(server: str, schema: str) -> str:
    """The outbox URL a relay reads."""
    return f"{server.split('?')[0]}?schema={schema}"


@pytest.fixture
def db(server: str, schema: str) -> Iterator[Conn]:
    """The application's connection (autocommit; transactions with ``conn.transaction()``)."""
    with psycopg.connect(server.split("?")[0], autocommit=True) as conn:
        outbox.setup(conn, schema=schema)
        conn.execute(f"CREATE TABLE {schema}.orders (id int PRIMARY KEY)")
        yield conn


@pytest.fixture
def hub(request: pytest.FixtureRequest) -> Iterator[mqabstract.Broker]:
    with mqabstract.connect(f"memory://pgo-{request.node.name}-{secrets.token_hex(3)}") as mq:
        yield mq


def _outbox(conn: Conn, schema: str) -> list[tuple[str, str | None]]:
    return [(r[0], r[1]) for r in conn.execute(
        f"SELECT id, reason FROM {schema}.mq_outbox ORDER BY seq").fetchall()]


def _all(sub: mqabstract.Subscription, wait: float = 0.2) -> list[mqabstract.Message]:
    got: list[mqabstract.Message] = []
    while msgs := sub.receive(100, wait):
        got += msgs
        sub.ack_many(msgs)
    return got


def test_commit_writes_rollback_does_not(db: Conn, schema: str) -> None:
    with db.transaction():
        db.execute(f"INSERT INTO {schema}.orders VALUES (1)")
        outbox.publish(db, "orders.created", {"id": 1}, key="o-1", id="order-1", schema=schema)
    with pytest.raises(RuntimeError), db.transaction():
        db.execute(f"INSERT INTO {schema}.orders VALUES (2)")
        outbox.publish(db, "orders.created", {"id": 2}, key="o-2", id="order-2", schema=schema)
        raise RuntimeError("rolled back")
    assert _outbox(db, schema) == [("order-1", None)]


def test_non_autocommit_connection_commits_with_the_caller(server: str, schema: str,
                                                           db: Conn) -> None:
    with psycopg.connect(server.split("?")[0]) as conn:  # psycopg's default: a transaction
        outbox.publish(conn, "a.b", b"x", id="one", schema=schema)
        assert _outbox(db, schema) == []  # not committed yet: invisible
        conn.commit()
    assert _outbox(db, schema) == [("one", None)]


def test_bad_input_writes_nothing_and_the_transaction_goes_on(db: Conn, schema: str) -> None:
    with db.transaction():
        with pytest.raises(InvalidName):
            outbox.publish(db, "bad topic", b"x", schema=schema)
        with pytest.raises(InvalidArgument) as info:
            outbox.publish_batch(db, [("a.b", b"ok"), {"topic": "a.b", "body": b"x",
                                                       "priority": 11}], schema=schema)
        assert info.value.index == 1
        outbox.publish(db, "a.b", b"fine", id="fine", schema=schema)
    assert _outbox(db, schema) == [("fine", None)]


def test_autocommit_outside_a_transaction_is_refused(db: Conn, schema: str) -> None:
    with pytest.raises(InvalidArgument, match="autocommit"):
        outbox.publish(db, "a.b", b"x", schema=schema)
    assert _outbox(db, schema) == []


def test_missing_table_is_not_found(server: str) -> None:
    with psycopg.connect(server.split("?")[0]) as conn:
        with pytest.raises(NotFound, match="setup"):
            outbox.publish(conn, "a.b", b"x", schema="o_none_" + secrets.token_hex(3))
        conn.rollback()


def test_in_flight_transaction_is_never_skipped_and_a_key_keeps_commit_order(
        server: str, db: Conn, schema: str, source: str, hub: mqabstract.Broker) -> None:
    """T1 writes key k and stays open; T2 writes k after it (its row would get a later seq,
    and without the key lock could commit first); T3 writes key j and commits. The relay
    must deliver j, then k in commit order T1, T2 — never T2 while T1 is open."""
    sub = hub.subscribe("g", "#")
    plain = server.split("?")[0]
    with psycopg.connect(plain) as t1, psycopg.connect(plain) as t2:
        outbox.publish(t1, "o.k", b"t1", key="k", id="t1", schema=schema)  # open, slow
        t2_done = threading.Event()

        def second() -> None:
            outbox.publish(t2, "o.k", b"t2", key="k", id="t2", schema=schema)
            t2.commit()
            t2_done.set()

        thread = threading.Thread(target=second)
        thread.start()
        with db.transaction():
            outbox.publish(db, "o.j", b"t3", key="j", id="t3", schema=schema)
        with outbox.Relay(source, hub) as relay:
            relay.drain()
            assert [m.id for m in _all(sub)] == ["t3"]
            assert not t2_done.wait(0.5)  # a later writer of k waits for T1
            t1.commit()
            thread.join(10)
            assert t2_done.is_set()
            relay.drain()
            assert [m.id for m in _all(sub)] == ["t1", "t2"]
    assert _outbox(db, schema) == []


def test_rolled_back_in_flight_row_is_never_published(server: str, db: Conn, schema: str,
                                                      source: str,
                                                      hub: mqabstract.Broker) -> None:
    sub = hub.subscribe("g", "#")
    with psycopg.connect(server.split("?")[0]) as t1:
        outbox.publish(t1, "o.k", b"x", key="k", id="gone", schema=schema)
        with db.transaction():
            outbox.publish(db, "o.z", b"y", id="kept", schema=schema)
        with outbox.Relay(source, hub) as relay:
            relay.drain()
            t1.rollback()
            relay.drain()
    assert [m.id for m in _all(sub)] == ["kept"]


def test_two_relays_run_at_once_without_double_work_and_keep_key_order(
        db: Conn, schema: str, source: str, hub: mqabstract.Broker) -> None:
    sub = hub.subscribe("g", "#", ordered=True)
    keys = [f"k{i}" for i in range(12)]
    with db.transaction():
        outbox.publish_batch(db, [OutgoingMessage("o.x", f"{k}:{n}", key=k, id=f"{k}-{n}")
                                  for n in range(40) for k in keys], schema=schema)
    relays = [outbox.Relay(source, hub, batch=7, poll_interval=0.01) for _ in range(2)]
    stop = threading.Event()
    threads = [threading.Thread(target=r.run, args=(stop,), kwargs={"idle_timeout": 1.0})
               for r in relays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in relays:
        r.close()
    moved = [r.stats.moved for r in relays]
    assert sum(moved) == 480 and all(moved), moved  # both worked, nothing twice
    got = _all(sub)
    assert len(got) == 480 and len({m.id for m in got}) == 480
    for k in keys:
        assert [m.id for m in got if m.key == k] == [f"{k}-{n}" for n in range(40)]


def test_a_claim_of_a_killed_relay_comes_back(db: Conn, schema: str, source: str,
                                              hub: mqabstract.Broker) -> None:
    from mqabstract.backends.postgresql.outbox import PGOutbox

    with db.transaction():
        outbox.publish_batch(db, [OutgoingMessage("a.b", b"x", key="k", id=f"m{i}")
                                  for i in range(3)], schema=schema)
    dead = PGOutbox(source)
    assert [m.id for m in dead.claim(10, 0)] == ["m0", "m1", "m2"]
    other = PGOutbox(source)
    assert other.claim(10, 0) == []  # the partition is held
    assert dead._conn is not None
    dead._conn.close()  # the relay's process died: its connection ended
    deadline = time.monotonic() + 10  # (the server ends the session a moment later)
    while not (got := other.claim(10, 0)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m.id for m in got] == ["m0", "m1", "m2"]
    other.confirm()
    other.close()
    assert _outbox(db, schema) == []


def test_relay_to_postgresql_and_sqlite_brokers(db: Conn, schema: str, source: str,
                                                server: str, tmp_path: Path) -> None:
    with db.transaction():
        outbox.publish_batch(db, [("a.b", b"1"), ("a.b", b"2")], schema=schema)
        outbox.publish(db, "a.b", b"3", priority=5, delay=0.01, schema=schema)
    target = f"{server.split('?')[0]}?schema={schema}"  # the broker's tables beside the outbox
    with mqabstract.connect(target) as mq:
        sub = mq.subscribe("g", "a.#")
        with outbox.Relay(source, mq) as relay:
            assert relay.drain() == 3
        time.sleep(0.05)
        assert sorted(m.body for m in _all(sub, 1.0)) == [b"1", b"2", b"3"]
    with db.transaction():
        outbox.publish(db, "a.b", b"4", schema=schema)
    with mqabstract.connect(f"sqlite:///{tmp_path / 'b.db'}") as mq:
        sub = mq.subscribe("g", "a.#")
        with outbox.Relay(source, mq) as relay:
            assert relay.drain() == 1
        assert [m.body for m in _all(sub, 1.0)] == [b"4"]


def test_same_database_target_is_atomic_without_a_relay(db: Conn, schema: str,
                                                        server: str) -> None:
    target = f"{server.split('?')[0]}?schema={schema}"
    with mqabstract.connect(target) as mq:
        sub = mq.subscribe("g", "orders.#")
        with pytest.raises(RuntimeError), db.transaction():
            db.execute(f"INSERT INTO {schema}.orders VALUES (1)")
            outbox.publish_direct(db, "orders.created", {"id": 1}, id="rolled", schema=schema)
            raise RuntimeError("rolled back")
        with db.transaction():
            db.execute(f"INSERT INTO {schema}.orders VALUES (2)")
            mid = outbox.publish_direct(db, "orders.created", {"id": 2}, key="o", ttl=60,
                                        id="committed", schema=schema)
            assert sub.receive(1, 0.3) == []  # not committed yet
        [msg] = sub.receive(1, 2.0)
        assert (msg.id, msg.value, msg.key) == (mid, {"id": 2}, "o")
        assert msg.expires_at is not None
        msg.ack()
        assert sub.receive(1, 0.3) == []
        with pytest.raises(InvalidName), db.transaction():
            outbox.publish_direct(db, "bad topic", b"x", schema=schema)


def test_direct_publish_goes_into_the_ring_like_the_drivers_and_is_delivered_once(
        db: Conn, schema: str, server: str) -> None:
    """publish_direct into the partition ring (docs/backends/postgresql.md, "Bloat"): the
    row lands in the current partition with the columns the driver's publish writes; direct
    publishes committed and rolled back while the ring rotates arrive once and never; and a
    transaction held open across rotations keeps its partition from being called drained
    (its row is not visible yet), so the row is delivered at commit even while a reader
    pins the partition against truncation."""
    from mqabstract.backends.postgresql.rotation import CURRENT, DRAINED, OPEN

    plain = server.split("?")[0]
    target = f"{plain}?schema={schema}"
    with mqabstract.connect(target) as mq, psycopg.connect(plain, autocommit=True) as app, \
            psycopg.connect(plain, autocommit=True) as reader:
        sub = mq.subscribe("g", "t.#", lease=30)  # (a subscriber: the ring's pass runs)
        fields: dict[str, Any] = {"headers": {"h": "1"}, "key": "k", "priority": 7}
        mq.publish("t.same", b"same", id="by-driver", **fields)
        with db.transaction():
            outbox.publish_direct(db, "t.same", b"same", id="by-direct", schema=schema,
                                  **fields)
        cols = "gid, state, due, priority, attempts, token, key, topic, headers, body, part"
        one, two = db.execute(f"SELECT {cols} FROM {schema}.mq_queue WHERE id IN"
                              " ('by-driver', 'by-direct') ORDER BY id").fetchall()
        assert one == two  # same columns, same partition (the ring has not moved yet)
        assert sorted(m.id for m in _all(sub)) == ["by-direct", "by-driver"]

        sent, rolled, got = {"held"}, set(), []
        with db.transaction():
            outbox.publish_direct(db, "t.held", b"held", id="held", schema=schema)
            (held_in, current), = db.execute(
                f"SELECT q.part, (SELECT part FROM {schema}.mq_parts WHERE state = {CURRENT})"
                f" FROM {schema}.mq_queue q WHERE q.id = 'held'").fetchall()
            assert held_in == current
            reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")  # holds the xmin horizon
            reader.execute(f"SELECT 1 FROM {schema}.mq_queue LIMIT 1").fetchall()  # and locks
            deadline, n, since = time.monotonic() + 40, 0, None
            while since is None or time.monotonic() - since < 3:  # 6 passes of the ring
                assert time.monotonic() < deadline, "the ring did not move on in 40 s"
                n += 1
                mq.publish_batch([(f"t.{n}", b"x")] * 20)  # traffic: the ring rotates
                sent |= {f"d{n}"}
                with app.transaction():
                    outbox.publish_direct(app, "t.d", b"d", id=f"d{n}", schema=schema)
                with pytest.raises(RuntimeError), app.transaction():
                    outbox.publish_direct(app, "t.r", b"r", id=f"r{n}", schema=schema)
                    rolled.add(f"r{n}")
                    raise RuntimeError("rolled back")
                got += _all(sub, 0.05)
                (state,), = db.execute(f"SELECT state FROM {schema}.mq_parts WHERE part = %s",
                                       (held_in,)).fetchall()
                assert state != DRAINED, "drained under an uncommitted direct publish"
                if state == OPEN and since is None:
                    since = time.monotonic()
        deadline = time.monotonic() + 10  # committed; the reader still pins its partition
        while "held" not in {m.id for m in got} and time.monotonic() < deadline:
            got += _all(sub, 0.2)
        assert "held" in {m.id for m in got}, "a committed direct publish was not delivered"
        reader.rollback()
        got += _all(sub, 1.0)
    ids = [m.id for m in got if m.topic.startswith(("t.d", "t.r", "t.held"))]
    assert sorted(ids) == sorted(sent)  # each committed one once, no rolled back one
    assert len([m for m in got if m.body == b"x"]) == 20 * n
    assert all(m.attempt == 1 for m in got)


def test_direct_publish_from_a_snapshot_older_than_a_drain_is_delivered(
        db: Conn, schema: str, server: str) -> None:
    """A REPEATABLE READ transaction sees the ring as it was at its snapshot: its direct
    publish lands in a partition that has since been drained (pruned by the claims). The
    ring's pass sees the writer's lock and opens the partition again, so the row is
    delivered at commit, even while a reader keeps the partition from being truncated."""
    from mqabstract.backends.postgresql.rotation import DRAINED, OPEN

    plain = server.split("?")[0]

    def state_of(part: int) -> int:
        return int(db.execute(f"SELECT state FROM {schema}.mq_parts WHERE part = %s",
                              (part,)).fetchall()[0][0])

    with mqabstract.connect(f"{plain}?schema={schema}") as mq, psycopg.connect(plain) as old, \
            psycopg.connect(plain, autocommit=True) as reader:
        sub = mq.subscribe("g", "t.#", lease=30)
        old.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        (first,), = old.execute(f"SELECT part FROM {schema}.mq_parts WHERE state = 1")
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute(f"SELECT 1 FROM {schema}.mq_queue LIMIT 1").fetchall()  # pins them
        deadline, got = time.monotonic() + 40, []
        while state_of(first) != DRAINED:
            assert time.monotonic() < deadline, "the first partition was not drained in 40 s"
            mq.publish_batch([("t.x", b"x")] * 20)
            got += _all(sub, 0.05)
        outbox.publish_direct(old, "t.old", b"old", id="old", schema=schema)
        (into,), = old.execute(f"SELECT part FROM {schema}.mq_queue WHERE id = 'old'")
        assert into == first  # where its snapshot says rows go
        deadline = time.monotonic() + 10
        while state_of(first) != OPEN:
            assert time.monotonic() < deadline, "the ring left a written partition drained"
            time.sleep(0.1)
        old.commit()
        deadline = time.monotonic() + 10
        while "old" not in {m.id for m in got} and time.monotonic() < deadline:
            got += _all(sub, 0.2)
        assert [m.id for m in got if m.id == "old"] == ["old"]
        reader.rollback()


def test_errors_name_no_secret(server: str) -> None:
    bad = server.split("?")[0].replace("@", "x@", 1)  # a wrong password
    with pytest.raises(ConnectionFailed) as info:
        outbox.Relay(bad + "?schema=o_x", "memory://x")
    secret = psycopg.conninfo.conninfo_to_dict(bad).get("password") or "x"
    assert str(secret) not in str(info.value)


# -- PostgresStore ---------------------------------------------------------------------------
class _Msg:
    def __init__(self, group: str, mid: str) -> None:
        self.group, self.id = group, mid


def test_postgres_store_commits_effect_with_the_id(server: str, schema: str, db: Conn) -> None:
    from mqabstract.dedupe import PostgresStore

    with PostgresStore(server.split("?")[0], schema=schema) as store:
        msg: Any = _Msg("g", "m1")
        with store.transaction(msg) as conn:
            conn.execute(f"INSERT INTO {schema}.orders VALUES (1)")
        with pytest.raises(Duplicate), store.transaction(msg) as conn:
            conn.execute(f"INSERT INTO {schema}.orders VALUES (99)")
        with pytest.raises(RuntimeError), store.transaction(_Msg("g", "m2")) as conn:  # type: ignore[arg-type]
            conn.execute(f"INSERT INTO {schema}.orders VALUES (2)")
            raise RuntimeError("handler failed")
        assert store.seen("g", "m1") and not store.seen("g", "m2")
        assert not store.seen("other", "m1")
        assert len(store) == 1
    assert [r[0] for r in db.execute(f"SELECT id FROM {schema}.orders")] == [1]


def test_postgres_store_concurrent_delivery_waits_then_is_a_duplicate(
        server: str, schema: str) -> None:
    from mqabstract.dedupe import PostgresStore

    with PostgresStore(server.split("?")[0], schema=schema) as store:
        msg: Any = _Msg("g", "same")
        inside, release, outcome = threading.Event(), threading.Event(), []

        def first() -> None:
            with store.transaction(msg):
                inside.set()
                release.wait(10)

        def second() -> None:
            try:
                with store.transaction(msg):
                    outcome.append("processed")
            except Duplicate:
                outcome.append("duplicate")

        a = threading.Thread(target=first)
        a.start()
        inside.wait(10)
        b = threading.Thread(target=second)
        b.start()
        time.sleep(0.3)
        assert outcome == []  # waits for the first delivery's transaction
        release.set()
        a.join(10)
        b.join(10)
        assert outcome == ["duplicate"]


def test_postgres_store_in_consume_with_an_application_connection(
        server: str, schema: str, db: Conn) -> None:
    from mqabstract.dedupe import PostgresStore

    app = psycopg.connect(server.split("?")[0], autocommit=True)
    with PostgresStore(app, schema=schema) as store, mqabstract.connect("memory://pgs") as mq:
        sub = mq.subscribe("g", "a.#")
        mq.publish("a.b", b"1", id="one")
        mq.publish("a.b", b"1", id="one")  # a duplicate by id

        def handler(msg: mqabstract.Message) -> None:
            with store.transaction(msg) as conn:
                conn.execute(f"INSERT INTO {schema}.orders VALUES (%s)", (int(msg.body),))

        stats = sub.consume(handler, dedupe=store, idle_timeout=0.3)
        assert (stats.received, stats.duplicates) == (2, 1)
        assert "mqsecret" not in repr(store)
    app.close()
    assert [r[0] for r in db.execute(f"SELECT id FROM {schema}.orders")] == [1]


def test_cli_relay_from_postgresql(db: Conn, schema: str, source: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from mqabstract.cli import main

    with db.transaction():
        outbox.publish_batch(db, [("a.b", b"1"), ("a.b", b"2")], schema=schema)
    target = f"sqlite:///{tmp_path / 'b.db'}"
    with mqabstract.connect(target) as mq:
        mq.declare("g", "a.#")
    assert main(["relay", "--from", source, "--to", target, "--idle", "0.3"]) == 0
    assert '"moved": 2' in capsys.readouterr().out
    assert _outbox(db, schema) == []
