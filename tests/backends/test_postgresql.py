"""PostgreSQL backend: what only it shows — the rows seen with plain SQL, time decided on the
injected clock, NOTIFY and the polling fallback, statements per batch, migration, errors.

Needs a server: ``scripts/brokers up postgresql`` (or ``MQ_TEST_POSTGRESQL_URL``). Every
test works in a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import mqabstract
from mqabstract import FakeClock, OutgoingMessage
from tests.brokers import resolve_url


@pytest.fixture(scope="module")
def server() -> str:
    return resolve_url("postgresql")


@pytest.fixture
def schema(server: str) -> Iterator[str]:
    name = "t_" + secrets.token_hex(6)
    yield name
    with psycopg.connect(_plain(server), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@pytest.fixture
def url(server: str, schema: str) -> str:
    return f"{server}{'&' if '?' in server else '?'}schema={schema}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mq(url: str, clock: FakeClock) -> Iterator[mqabstract.Broker]:
    broker = mqabstract.connect(url, clock=clock)
    yield broker
    broker.close()


def _plain(url: str) -> str:
    """The URL as libpq takes it (no mqabstract options)."""
    return url.split("?", 1)[0]


def _sql(server: str, query: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(_plain(server), autocommit=True) as conn:
        cur = conn.execute(query, args or None)
        return cur.fetchall() if cur.description else []


# -- the rows, seen and written with plain SQL ------------------------------------------------
def test_rows_seen_with_plain_sql_carry_the_fake_clocks_lease(
        mq: mqabstract.Broker, server: str, schema: str, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "orders.*", lease=30)
    mq.publish("orders.eu", b"body", headers={"h": "v"}, key="k", priority=4, id="m-1")
    (row,) = _sql(server, f"SELECT id, topic, body, headers, key, priority, state, attempts"
                          f" FROM {schema}.mq_queue")
    assert row[:3] == ("m-1", "orders.eu", b"body")
    assert json.loads(row[3])["h"] == "v"
    assert row[4:] == ("k", 4, 0, 0)
    (msg,) = sub.receive(wait=5)
    (leased,) = _sql(server, f"SELECT state, attempts, due, token FROM {schema}.mq_queue")
    assert leased[:2] == (1, 1) and leased[3] != 0
    assert leased[2] == pytest.approx(clock.time() + 30)  # the driver's clock, not now()
    msg.ack()
    assert _sql(server, f"SELECT count(*) FROM {schema}.mq_queue") == [(0,)]


def test_a_row_inserted_by_plain_sql_is_received_with_defaults(
        url: str, server: str, schema: str, clock: FakeClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A row and a NOTIFY written by hand wake a waiting receiver: its poll is a minute
    apart, so only the notification can end its wait before the join gives up."""
    with mqabstract.connect(url, clock=clock, poll_interval=60) as mq:
        sub = mq.subscribe("g", "raw.#")
        ((gid,),) = _sql(server, f"SELECT gid FROM {schema}.mq_groups WHERE name = 'g'")

        def insert_and_notify() -> None:
            _sql(server, f"INSERT INTO {schema}.mq_queue (gid, state, due, priority, attempts,"
                         " token, id, topic, published_at, body) VALUES (%s, 0, 0, 0, 0, 0,"
                         " 'plain-1', 'raw.x', 0, 'hi')", gid)
            _sql(server, "SELECT pg_notify(%s, %s)", f"mq_{schema}", str(gid))

        spy = _WaitSpy(mq, monkeypatch)
        got = _received_while_waiting(sub, spy, insert_and_notify, server, schema)
        assert [(m.id, m.topic, m.body, m.attempt) for m in got] == [
            ("plain-1", "raw.x", b"hi", 1)]
        assert spy.waits and spy.waits[-1][1]  # a wake ended it, not the minute's poll
        got[0].ack()


# -- time: decided on the injected clock ----------------------------------------------------------
def test_delay_and_lease_expiry_follow_the_fake_clock(
        mq: mqabstract.Broker, clock: FakeClock) -> None:
    first = mq.subscribe("g", "t", lease=30)
    other = mq.subscribe("g", "t", lease=30)
    mq.publish("t", b"later", delay=60)
    assert first.receive(wait=0.3) == []
    clock.advance(61)
    (msg,) = first.receive(wait=5)
    assert msg.attempt == 1
    assert other.receive(wait=0.3) == []  # leased to first for 30 fake seconds
    clock.advance(31)
    (again,) = other.receive(wait=5)
    assert (again.id, again.attempt) == (msg.id, 2)
    again.ack()
    assert mq.stats("g").ready == 0


# -- bloat: the partition ring (docs: "Bloat") -------------------------------------------------
def test_rotation_truncates_under_a_reader_and_moves_stragglers_forward(
        mq: mqabstract.Broker, server: str, schema: str, clock: FakeClock) -> None:
    sub = mq.subscribe("g", "t", lease=30)
    mq.publish("t", b"later", delay=60)  # stays behind: a straggler to move
    ((first,),) = _sql(server, f"SELECT part FROM {schema}.mq_queue")
    with psycopg.connect(_plain(server)) as reader:  # pins the partitions existing now
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute(f"SELECT 1 FROM {schema}.mq_queue LIMIT 1").fetchall()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            mq.publish_batch([("t", b"x")] * 50)
            got = sub.receive(100, wait=1)
            assert all(m.body == b"x" for m in got)
            sub.ack_many(got)
            parts = dict(_sql(server, f"SELECT part, state FROM {schema}.mq_parts"))
            ((now,),) = _sql(server, f"SELECT part FROM {schema}.mq_queue WHERE body = 'later'")
            if now != first and any(p >= 3 and st == 0 for p, st in parts.items()):
                break  # moved, and a partition made after the reader was truncated
            time.sleep(0.1)
        else:
            pytest.fail(f"no move or truncate in 30 s: {parts}, straggler in {now}")
        assert parts[first] == 3  # drained: the reader holds it, the claims skip it
    clock.advance(61)
    (msg,) = sub.receive(wait=5)
    assert (msg.body, msg.attempt) == (b"later", 1)
    msg.ack()


# -- waking: NOTIFY, and polling when notifications are lost ---------------------------------------
class _WaitSpy:
    """Every idle wait of one broker's receivers: its length and whether a wake (True) or
    its timeout (False) ended it. Whether NOTIFY woke a receiver is read here, not timed."""

    def __init__(self, broker: mqabstract.Broker, monkeypatch: pytest.MonkeyPatch) -> None:
        waker = broker._driver.store.waker  # type: ignore[attr-defined]
        real = waker.wait
        self.waits: list[tuple[float, bool]] = []
        self.waiting = threading.Event()

        def wait(gid: int, seen: tuple[int, int], seconds: float) -> bool:
            self.waiting.set()  # seen was stamped before the look: a wake from now on counts
            woken: bool = real(gid, seen, seconds)
            self.waits.append((seconds, woken))
            return woken

        monkeypatch.setattr(waker, "wait", wait)


def _listening(server: str, schema: str) -> bool:
    rows = _sql(server, "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle'"
                        " AND query LIKE %s", f"LISTEN mq_{schema}%")
    return rows != [(0,)]


def _received_while_waiting(receiver: mqabstract.Subscription, spy: _WaitSpy,
                            send: Callable[[], None], server: str,
                            schema: str | None) -> list[mqabstract.Message]:
    """Once the receiver is idle in a 60 s receive (and, with ``schema``, its broker's
    LISTEN is in place), ``send``; what it got within 30 s. Nothing but a wake or a poll
    shorter than 30 s can deliver before then."""
    if schema is not None:
        for _ in range(300):
            if _listening(server, schema):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the broker's LISTEN connection was not in place within 15 s")
    got: list[mqabstract.Message] = []
    spy.waiting.clear()
    waiter = threading.Thread(target=lambda: got.extend(receiver.receive(wait=60)))
    waiter.start()
    assert spy.waiting.wait(30), "the receiver never went idle"
    send()
    waiter.join(30)
    assert not waiter.is_alive(), f"still waiting after 30 s; its waits: {spy.waits}"
    return got


def test_listen_wakes_a_receiver_of_another_connection_before_its_poll(
        url: str, schema: str, server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with mqabstract.connect(url, poll_interval=60) as consumer, \
            mqabstract.connect(url) as producer:
        sub = consumer.subscribe("g", "t")
        spy = _WaitSpy(consumer, monkeypatch)
        got = _received_while_waiting(sub, spy, lambda: producer.publish("t", b"x"),
                                      server, schema)
        assert [m.body for m in got] == [b"x"]
        assert spy.waits[-1][1]  # woken; the poll was a minute away
        got[0].ack()


def test_without_notifications_a_receiver_still_gets_messages_within_its_poll(
        url: str, server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """listen=false stands for a pooler in transaction mode, where NOTIFYs never arrive:
    the consumer holds no LISTEN connection, never idles longer than poll_interval between
    looks, and so receives what another process publishes."""
    with mqabstract.connect(url, listen=False, poll_interval=0.3) as consumer, \
            mqabstract.connect(url) as producer:
        sub = consumer.subscribe("g", "t")
        listening = _sql(server, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE"
                                 " %s", f"LISTEN mq_{url.rsplit('=', 1)[1]}%")
        assert listening == [(0,)]
        assert consumer.capabilities.release_margin == pytest.approx(0.3 + 0.25)
        spy = _WaitSpy(consumer, monkeypatch)
        for n in range(3):
            got = _received_while_waiting(
                sub, spy, lambda n=n: producer.publish("t", str(n).encode()), server, None)
            assert [m.body for m in got] == [str(n).encode()]
            got[0].ack()
        assert spy.waits and all(0 < s <= 0.3 and not woken for s, woken in spy.waits)


# -- one statement per batch ---------------------------------------------------------------------
def test_batch_publish_claim_and_ack_are_one_statement_each(
        mq: mqabstract.Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    sub = mq.subscribe("a", "t")
    mq.subscribe("b", "t").close()  # a second group: the rows fan out in the same statement
    mq.publish("t", b"warm")  # routes loaded
    sub.ack_many(sub.receive(10, wait=5))
    calls: list[str] = []
    real = psycopg.Connection.execute

    def counting(self: psycopg.Connection[Any], query: Any, *args: Any, **kw: Any) -> Any:
        if threading.current_thread() is main:  # not the listener's, not the rotation's
            calls.append(str(query)[:40])
        return real(self, query, *args, **kw)

    main = threading.current_thread()
    monkeypatch.setattr(psycopg.Connection, "execute", counting)
    mq.publish_batch([OutgoingMessage("t", {"n": i}) for i in range(500)])
    assert len(calls) == 1, calls
    calls.clear()
    got = sub.receive(500, wait=5)
    assert len(got) == 500
    assert len(calls) == 2, calls  # promote, claim: pipelined, one round trip
    calls.clear()
    assert sub.receive(500) == []
    assert len(calls) == 3, calls  # fewer than asked: and when the next row falls due
    calls.clear()
    sub.ack_many(got)
    assert len(calls) == 1, calls
    monkeypatch.undo()
    assert mq.stats("a").ready == 0 and mq.stats("b").ready == 501


def test_a_batch_larger_than_a_chunk_is_written_in_one_transaction(
        mq: mqabstract.Broker, server: str, schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mqabstract.backends.postgresql import driver

    monkeypatch.setattr(driver, "CHUNK_BYTES", 250)
    sub = mq.subscribe("g", "t")
    mq.publish("t", b"warm")
    sub.ack_many(sub.receive(10, wait=5))
    statements: list[str] = []
    real = psycopg.Connection.execute

    def counting(self: psycopg.Connection[Any], query: Any, *args: Any, **kw: Any) -> Any:
        if "ins AS (INSERT INTO" in str(query):  # (a chunk also takes the writer lock)
            statements.append("publish")
        return real(self, query, *args, **kw)

    monkeypatch.setattr(psycopg.Connection, "execute", counting)
    mq.publish_batch([OutgoingMessage("t", bytes([i]) * 100) for i in range(10)])
    assert len(statements) == 5  # two 100-byte bodies per 250-byte chunk
    got = sub.receive(20, wait=5)
    assert sorted(m.body[0] for m in got) == list(range(10))
    sub.ack_many(got)


# -- schema and migration --------------------------------------------------------------------------
def test_concurrent_opens_of_a_new_schema_migrate_it_once(url: str, server: str,
                                                          schema: str) -> None:
    errors: list[BaseException] = []
    brokers: list[mqabstract.Broker] = []

    def open_one() -> None:
        try:
            brokers.append(mqabstract.connect(url))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for b in brokers:
        b.close()
    assert not errors, errors
    assert _sql(server, f"SELECT version FROM {schema}.mq_version") == [(1,)]
    with mqabstract.connect(url) as again:  # idempotent: nothing to do, nothing lost
        again.declare("g", "t")
    assert _sql(server, f"SELECT version FROM {schema}.mq_version") == [(1,)]


def test_a_schema_from_a_newer_version_is_refused(url: str, server: str, schema: str) -> None:
    mqabstract.connect(url).close()
    _sql(server, f"UPDATE {schema}.mq_version SET version = 99")
    with pytest.raises(mqabstract.ConnectionFailed, match="newer"):
        mqabstract.connect(url)


# -- errors and options ----------------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_that_never_answers_fails_within_the_connect_timeout() -> None:
    silent = socket.socket()  # accepts connections (backlog) and never says a word
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        url = f"postgresql://mq:S3cret-pw@127.0.0.1:{port}/db?connect_timeout=2"
        started = time.monotonic()
        with pytest.raises(mqabstract.ConnectionFailed) as info:
            mqabstract.connect(url)
        assert time.monotonic() - started < 2 + 10  # the limit kept (no hang), with room
    finally:
        silent.close()
    assert "S3cret-pw" not in str(info.value) and f"127.0.0.1:{port}" in str(info.value)
    assert info.value.retryable


def test_refused_connection_is_connection_failed_at_once() -> None:
    url = f"postgresql://mq:S3cret-pw@127.0.0.1:{_closed_port()}/db?connect_timeout=60"
    started = time.monotonic()
    with pytest.raises(mqabstract.ConnectionFailed) as info:
        mqabstract.connect(url)
    assert time.monotonic() - started < 30  # not retried until the minute's limit
    assert "S3cret-pw" not in str(info.value) and "mq:***@" in str(info.value)


def test_lost_connections_become_connection_failed_then_recover(
        mq: mqabstract.Broker, server: str, schema: str) -> None:
    mq.ping()
    # only this test's connections: application_name names the schema
    killed = _sql(server, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE application_name = %s", f"mqabstract:{schema}")
    assert killed == [(True,)]
    with pytest.raises(mqabstract.ConnectionFailed):
        mq.ping()  # psycopg's OperationalError never escapes as itself
    mq.ping()  # the pool replaced the dead connection


@pytest.mark.parametrize("option, value", [
    ("schema", "Bad-Name"), ("schema", "x" * 60), ("poll_interval", "0"),
    ("poll_interval", "nan"), ("connect_timeout", "-1"), ("pool_size", "0"),
    ("listen", "maybe"), ("no_such_option", "1"),
])
def test_bad_options_are_refused_before_connecting(option: str, value: str) -> None:
    url = f"postgresql://mq:pw@127.0.0.1:{_closed_port()}/db?{option}={value}"
    with pytest.raises(mqabstract.InvalidArgument):
        mqabstract.connect(url)


@pytest.mark.parametrize("url", ["postgresql://mq:pw@127.0.0.1:5432/",
                                 "postgresql:///db"])
def test_urls_without_host_or_database_are_invalid(url: str) -> None:
    with pytest.raises(mqabstract.InvalidURL):
        mqabstract.connect(url)


def test_postgres_scheme_is_an_alias(url: str) -> None:
    with mqabstract.connect(url.replace("postgresql://", "postgres://", 1)) as mq:
        assert mq.backend == "postgresql"


class _Relay:
    """A TCP relay to the server that can go silent: ``freeze()`` stops forwarding bytes
    both ways with every connection left open (a paused server, a GC or VM stall, a black
    hole on the path); ``thaw()`` forwards again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.flowing = threading.Event()
        self.flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
                self._socks += [client, upstream]
                for src, dst in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def freeze(self) -> None:
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.thaw()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


def test_a_server_that_goes_silent_fails_calls_within_the_connect_timeout(
        server: str, schema: str) -> None:
    """psycopg puts no time limit on a statement, and a frozen server answers nothing (not
    even a cancel request): without the driver's own limit a receive(timeout=0.5) waited for
    as long as the server stayed frozen (the container pause scenario hung for good)."""
    parsed = mqabstract.url.BrokerURL.parse(server)
    host, port = parsed.hosts[0]
    relay = _Relay((host, port or 5432))
    url = (f"postgresql://{parsed.username}:{parsed.password}@127.0.0.1:{relay.port}/"
           f"{parsed.path}?schema={schema}&connect_timeout=2")
    try:
        with mqabstract.connect(url) as mq:
            mq.declare("g", "t.#")
            sub = mq.subscribe("g", "t.#")
            relay.freeze()
            results = []
            for call in (lambda: sub.receive(1, 0.5), lambda: mq.publish("t.x", b"1")):
                outcome: list[BaseException | None] = []

                def run(call: Any = call, outcome: list[BaseException | None] = outcome) -> None:
                    try:
                        call()
                        outcome.append(None)
                    except BaseException as exc:
                        outcome.append(exc)

                caller = threading.Thread(target=run, daemon=True)
                caller.start()
                caller.join(4)  # connect_timeout (2 s) and slack for a loaded machine
                assert outcome, "the call still waits on the silent server after 4 s"
                assert isinstance(outcome[0], mqabstract.ConnectionFailed), outcome
                results.append(str(outcome[0]))
            # The receive's connection is cut; the publish then finds the pool's replacement
            # still connecting to the silent server: no connection within the same 2 s.
            assert "did not answer within 2s" in results[0], results
            assert "within 2s" in results[1], results
            relay.thaw()
            mq.publish("t.x", b"after")  # the pool replaced the cut connections
            got = sub.receive(5, 5.0)
            assert [m.body for m in got][-1:] == [b"after"]
    finally:
        relay.close()
