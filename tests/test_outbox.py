"""The transactional outbox on SQLite (the application's sqlite3 connection) and the
relay to the memory and SQLite backends, the bridge from a group, ``mqa relay``.
PostgreSQL's outbox: tests/backends/test_outbox_postgresql.py."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import mqabstract
from mqabstract import FakeClock, OutgoingMessage, outbox
from mqabstract.cli import main
from mqabstract.errors import InvalidArgument, InvalidName, MessageTooLarge, NotFound
from mqabstract.outbox.sqlite import SQLiteOutbox


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[sqlite3.Connection, Path]]:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    outbox.setup(conn)
    yield conn, path
    conn.close()


@pytest.fixture
def hub(request: pytest.FixtureRequest) -> Iterator[mqabstract.Broker]:
    with mqabstract.connect(f"memory://outbox-{request.node.name}") as mq:
        yield mq


def _rows(conn: sqlite3.Connection) -> list[tuple[str, str | None]]:
    return conn.execute("SELECT id, reason FROM mq_outbox ORDER BY seq").fetchall()


def test_commit_writes_the_row_and_rollback_writes_nothing(app: tuple[sqlite3.Connection, Path]
                                                           ) -> None:
    conn, _ = app
    with conn:
        conn.execute("INSERT INTO orders VALUES (1)")
        mid = outbox.publish(conn, "orders.created", {"id": 1}, key="o-1", id="order-1")
    assert mid == "order-1"
    with pytest.raises(RuntimeError), conn:
        conn.execute("INSERT INTO orders VALUES (2)")
        outbox.publish(conn, "orders.created", {"id": 2}, id="order-2")
        raise RuntimeError("the application's transaction fails")
    assert _rows(conn) == [("order-1", None)]
    assert conn.execute("SELECT id FROM orders").fetchall() == [(1,)]


@pytest.mark.parametrize("bad, error", [
    ({"topic": "bad topic"}, InvalidName),
    ({"priority": 10}, InvalidArgument),
    ({"headers": {"mq-id": "x"}}, InvalidName),
    ({"id": "has space"}, InvalidArgument),
    ({"body": b"x" * (16 * 1024 * 1024 + 1)}, MessageTooLarge),
    ({"delay": -1}, InvalidArgument),
    ({"ttl": 1, "delay": 5}, InvalidArgument),
])
def test_bad_input_raises_before_anything_is_written(app: tuple[sqlite3.Connection, Path],
                                                      bad: dict[str, object],
                                                      error: type[Exception]) -> None:
    conn, _ = app
    fields: dict[str, object] = {"topic": "orders.created", "body": b"ok", **bad}
    with pytest.raises(error), conn:
        outbox.publish(conn, **fields)  # type: ignore[arg-type]
    with pytest.raises(error) as info, conn:
        outbox.publish_batch(conn, [OutgoingMessage("orders.created", b"fine"),
                                    OutgoingMessage(**fields)])  # type: ignore[arg-type]
    assert info.value.index == 1
    assert _rows(conn) == []


def test_target_limits_are_checked_when_given(app: tuple[sqlite3.Connection, Path],
                                              hub: mqabstract.Broker) -> None:
    conn, _ = app
    caps = hub.capabilities
    with pytest.raises(MessageTooLarge), conn:
        outbox.publish(conn, "t.x", b"x" * (caps.max_body_bytes + 1), limits=caps)


def test_autocommit_connection_without_transaction_is_refused(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    outbox.setup(conn)
    with pytest.raises(InvalidArgument, match="autocommit"):
        outbox.publish(conn, "t.x", b"x")
    conn.execute("BEGIN")
    outbox.publish(conn, "t.x", b"x")
    conn.execute("COMMIT")
    assert len(_rows(conn)) == 1


def test_missing_table_is_not_found(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "none.db")
    with pytest.raises(NotFound, match="setup"):
        outbox.publish(conn, "t.x", b"x")


def test_not_a_connection() -> None:
    with pytest.raises(InvalidArgument, match="psycopg 3 or sqlite3"):
        outbox.publish(object(), "t.x", b"x")


def test_relay_moves_rows_in_commit_order_with_ids_and_fields(
        app: tuple[sqlite3.Connection, Path], hub: mqabstract.Broker) -> None:
    conn, path = app
    sub = hub.subscribe("billing", "orders.#", ordered=True)
    with conn:
        for i in range(5):
            outbox.publish(conn, "orders.created", {"n": i}, key="k", id=f"m{i}",
                           headers={"tenant": "a"}, ttl=600)
    with outbox.Relay(f"sqlite:///{path}", hub) as relay:
        assert relay.drain() == 5
        assert relay.stats.moved == 5
    got = []
    while msgs := sub.receive(1, 0.2):
        got += msgs
        msgs[0].ack()
    assert [m.id for m in got] == [f"m{i}" for i in range(5)]
    assert [m.value for m in got] == [{"n": i} for i in range(5)]
    assert got[0].headers["tenant"] == "a" and got[0].key == "k"
    assert got[0].expires_at is not None
    assert _rows(conn) == []  # deleted once the target had them


def test_relay_to_a_sqlite_broker(app: tuple[sqlite3.Connection, Path], tmp_path: Path) -> None:
    conn, path = app
    with conn:
        outbox.publish_batch(conn, [("a.b", b"1"), ("a.b", b"2")])
    with mqabstract.connect(f"sqlite:///{tmp_path / 'broker.db'}") as mq:
        sub = mq.subscribe("g", "a.#")
        with outbox.Relay(f"sqlite:///{path}", mq) as relay:
            assert relay.drain() == 2
        assert [m.body for m in sub.receive(10, 1.0)] == [b"1", b"2"]


def test_a_row_the_target_refuses_is_marked_and_the_rest_go_on(
        app: tuple[sqlite3.Connection, Path], tmp_path: Path) -> None:
    conn, path = app
    with conn:
        outbox.publish(conn, "a.b", b"small", id="ok-1")
        outbox.publish(conn, "a.b", b"x" * 300_000, id="too-big")  # SQS-sized targets refuse
        outbox.publish(conn, "a.b", b"small", id="ok-2")
    with mqabstract.connect("memory://refuse") as mq:
        # A target whose bodies are at most 1000 bytes (as if it were a smaller broker).
        small = dataclasses.replace(mq.capabilities, max_body_bytes=1000)
        mq._packer = type(mq._packer)(small, "memory")
        sub = mq.subscribe("g", "a.#")
        with outbox.Relay(f"sqlite:///{path}", mq) as relay:
            relay.drain()
            assert (relay.stats.moved, relay.stats.rejected) == (2, 1)
        assert [m.id for m in sub.receive(10, 0.2)] == ["ok-1", "ok-2"]
    [(mid, reason)] = _rows(conn)
    assert mid == "too-big" and reason is not None and "MessageTooLarge" in reason


def test_expired_rows_are_marked_not_published(app: tuple[sqlite3.Connection, Path],
                                               hub: mqabstract.Broker) -> None:
    conn, path = app
    clock = FakeClock()
    with conn:
        outbox.publish(conn, "a.b", b"x", ttl=5, id="late", clock=clock)
    clock.advance(6)
    sub = hub.subscribe("g", "a.#")
    with outbox.Relay(f"sqlite:///{path}", hub, clock=clock) as relay:
        assert relay.drain() == 0
    assert sub.receive(1, 0.1) == []
    assert _rows(conn) == [("late", "expired")]


def test_a_delay_counts_from_the_write(app: tuple[sqlite3.Connection, Path]) -> None:
    conn, path = app
    clock = FakeClock()
    with conn:
        outbox.publish(conn, "a.b", b"x", delay=10, clock=clock)
    clock.advance(4)
    with mqabstract.connect("memory://delay", clock=clock) as mq:
        sub = mq.subscribe("g", "a.#")
        with outbox.Relay(f"sqlite:///{path}", mq, clock=clock) as relay:
            relay.drain()
        assert sub.receive(1, 0) == []
        clock.advance(5)
        assert sub.receive(1, 0) == []
        clock.advance(1.5)
        assert len(sub.receive(1, 0)) == 1


def test_two_relays_one_holds_the_outbox(app: tuple[sqlite3.Connection, Path]) -> None:
    conn, path = app
    clock = FakeClock()
    with conn:
        outbox.publish_batch(conn, [("a.b", str(i)) for i in range(4)])
    one = SQLiteOutbox(str(path), lease=10, clock=clock)
    two = SQLiteOutbox(str(path), lease=10, clock=clock)
    try:
        assert len(one.claim(2, 0)) == 2
        assert two.claim(10, 0) == []  # one holds the lease: no double work
        one.confirm()
        clock.advance(11)  # one is gone (killed): its lease ends, two takes over
        assert [m.body for m in two.claim(10, 0)] == [b"2", b"3"]
        assert one.claim(10, 0) == []
        two.close()  # stopped before confirming: the rows stay, the outbox is free at once
        assert [m.body for m in one.claim(10, 0)] == [b"2", b"3"]
        held = sqlite3.connect(path).execute("SELECT holder FROM mq_outbox_relay").fetchall()
        assert held == [(one._me,)]
    finally:
        one.close()
        two.close()


def test_relay_run_stops_when_idle_and_on_the_event(app: tuple[sqlite3.Connection, Path],
                                                    hub: mqabstract.Broker) -> None:
    conn, path = app
    with conn:
        outbox.publish(conn, "a.b", b"x")
    stop = threading.Event()
    with outbox.Relay(f"sqlite:///{path}", hub, poll_interval=0.01) as relay:
        stats = relay.run(stop, idle_timeout=0.1)
        assert stats.moved == 1
        stop.set()
        assert relay.run(stop).moved == 1


def test_bridge_moves_a_group_with_ids_and_acks_after(tmp_path: Path) -> None:
    src = f"sqlite:///{tmp_path / 'src.db'}"
    with mqabstract.connect(src) as mq, mqabstract.connect("memory://bridge") as dst:
        mq.declare("bridge", "orders.#")
        ids = mq.publish_batch([OutgoingMessage("orders.x", f"m{i}", key="k") for i in range(7)])
        sub = dst.subscribe("g", "#")
        with outbox.Relay(f"{src}?group=bridge&pattern=orders.%23", dst, batch=3) as relay:
            while relay.step(0.2):
                pass
        assert [m.id for m in sub.receive(10, 0.2)] == ids
        assert mq.stats("bridge").ready == 0 and mq.stats("bridge").leased == 0


def test_cli_relay(app: tuple[sqlite3.Connection, Path], tmp_path: Path,
                   capsys: pytest.CaptureFixture[str]) -> None:
    conn, path = app
    with conn:
        outbox.publish_batch(conn, [("a.b", b"1"), ("a.b", b"2")])
    target = f"sqlite:///{tmp_path / 'broker.db'}"
    with mqabstract.connect(target) as mq:
        mq.declare("g", "a.#")
    code = main(["relay", "--from", f"sqlite:///{path}", "--to", target, "--idle", "0.2",
                 "--poll", "0.05"])
    assert code == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["moved"] == 2
    with mqabstract.connect(target) as mq:
        assert mq.stats("g").ready == 2
    assert main(["relay", "--from", "mysql://x/y", "--to", target]) == 2
    assert main(["relay", "--to", target]) == 64


def test_a_failing_target_keeps_the_rows_and_the_relay_backs_off_on_its_clock(
        app: tuple[sqlite3.Connection, Path]) -> None:
    conn, path = app
    with conn:
        outbox.publish(conn, "a.b", b"x", id="kept")
    clock = FakeClock()
    mq = mqabstract.connect("memory://down")
    mq.close()  # every publish now raises Closed
    errors: list[mqabstract.MQError] = []
    stop = threading.Event()
    relay = outbox.Relay(f"sqlite:///{path}", mq, poll_interval=1.0, clock=clock)
    thread = threading.Thread(target=relay.run, args=(stop,),
                              kwargs={"on_error": errors.append})
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert len(errors) == 1  # waiting 1 s of the fake clock before trying again
        clock.advance(1.0)
        deadline = time.monotonic() + 5
        while len(errors) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(errors) == 2 and isinstance(errors[0], mqabstract.Closed)
    finally:
        stop.set()
        thread.join(5)
        relay.close()
    assert relay.stats.failures == 2 and relay.stats.moved == 0
    assert _rows(conn) == [("kept", None)]


def test_source_url_errors() -> None:
    with pytest.raises(InvalidArgument, match="sqlite:// or postgresql://"):
        outbox.Relay("mysql://db/app", "memory://x")
    with pytest.raises(InvalidArgument, match="unknown outbox URL options"):
        outbox.Relay("sqlite:///x.db?foo=1", "memory://x")


def test_bridge_dead_letters_in_the_source_what_the_target_refuses(tmp_path: Path) -> None:
    src = f"sqlite:///{tmp_path / 'src.db'}"
    with mqabstract.connect(src) as mq, mqabstract.connect("memory://bridge-refuse") as dst:
        dst._packer = type(dst._packer)(dataclasses.replace(dst.capabilities,
                                                            max_body_bytes=10), "memory")
        mq.declare("bridge", "#")
        mq.publish_batch([OutgoingMessage("a.b", b"ok", id="fits"),
                          OutgoingMessage("a.b", b"x" * 100, id="too-big")])
        sub = dst.subscribe("g", "#")
        with outbox.Relay(f"{src}?group=bridge", dst) as relay:
            while relay.step(0.2):
                pass
            assert (relay.stats.moved, relay.stats.rejected) == (1, 1)
        assert [m.id for m in sub.receive(10, 0.2)] == ["fits"]
        [dead] = mq.dead_letters("bridge")
        assert dead.id == "too-big" and "MessageTooLarge" in dead.reason
