"""Node failures on a three-node Apache Kafka cluster (KRaft, every node broker + controller).

The module starts one private ``KafkaCluster`` (``scripts/brokerctl.py``) and creates its
topics through mqabstract with ``replication_factor=3`` and ``min_insync_replicas=2`` (a
topic config the driver sets on topics it creates); the producer sends with ``acks=all``
and idempotence, so a confirmed record is on at least two replicas. With unclean leader
election off (Kafka's default) a new leader is an in-sync replica, so it has the record.

Scenarios (each on both clients: ``kafka`` = confluent-kafka, ``kafka-python``):

* SIGKILL the leader of the topic's partitions under publish and consume load, restart it;
* SIGKILL a follower (a node leading none of the topic's partitions when there is one);
* restart the whole cluster under a subscribed consumer and a retrying publisher;
* a consumer SIGSTOPped longer than session + lease: another gets its messages with a
  higher attempt, its late acks raise ``LeaseExpired``;
* the plain URL (no replication options: the driver's defaults must make the topics
  replicated, 3 replicas and ``min.insync.replicas`` 2 on three brokers): SIGKILL the leader
  of partition 0 under load, next to a plain confluent-kafka consumer group on the same
  topic; the delivery pause of both is reported.

Invariants: the one history checker (``history.check``: nothing confirmed lost, bodies
intact, attempts strictly increase per id and copy, no second holder while a lease is
valid, a frozen holder's messages back within lease + release margin, dead letters) with
the cluster's ``release_margin``; consumption goes on after the kill. A whole-cluster
restart is recorded as the end of the consumer's session (its leases end with it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import mqabstract
from backends.kafka.names import REGISTRY, internal, kafka_topic_name
from mqabstract import wire
from tests.brokers import in_ci

from .history import LEASE_EXPIRED
from .support import (
    KAFKA_SESSION,
    LEASE,
    Ledger,
    Publisher,
    Reporter,
    body_for,
    cleanup,
    drain,
    fault_url,
    freeze_a_holder,
    spare_port,
    token,
    with_client,
)

pytestmark = pytest.mark.backends("kafka")

#: Topics of this module: 2 partitions over 3 nodes, so one node usually leads none of
#: a topic's partitions (the follower scenario) while still replicating both.
PARTITIONS = 2
#: Seconds the cluster runs without the killed node, under load (at least; at most MAX).
OUTAGE = 10.0
MAX_OUTAGE = 45.0
BATCH = 20
SESSION = 6.0  # the driver's default session_timeout_ms (the plain-URL scenario's)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private three-node cluster for this module, stopped at teardown whatever happened."""
    import brokerctl as bc  # type: ignore[import-not-found]

    import tests.brokers  # noqa: F401 - puts scripts/ on sys.path

    port = spare_port(19890, also=(1, 2, 1000, 1001, 1002))
    nodes = bc.KafkaCluster(port=port, state_dir=tmp_path_factory.mktemp("kafka-cluster"))
    for node in nodes.nodes:  # three JVMs on a small machine
        node.heap_mb = min(node.heap_mb, 512)
    try:
        try:
            try:
                nodes.start()
            except Exception as first:
                # Seen once in a CI dry run: a node's JVM exited at start with an empty log
                # on the loaded machine. A second start tells that from a real problem.
                print(f"kafka cluster: start failed, retrying once: {first}")
                nodes.stop()
                nodes.start()
        except Exception as exc:  # missing java / Kafka jars
            if in_ci():
                pytest.fail(f"cannot start a three-node Kafka cluster: {exc}")
            pytest.skip(f"cannot start a three-node Kafka cluster: {exc}")
        yield nodes
    finally:
        # Throwaway data: no need to wait 30 s for a node whose clean shutdown hangs (a
        # quorum mid-election after the last scenario took that long at teardown in CI).
        nodes.stop(timeout=5.0)


def _url(cluster: Any, backend: str) -> str:
    options = f"replication_factor=3&min_insync_replicas=2&partitions={PARTITIONS}"
    return fault_url(backend, f"{cluster.url}?{options}")


def _heal(cluster: Any) -> None:
    """Every node up and registered (an earlier scenario may have failed mid-outage)."""
    if not cluster.ready():
        cluster.start()


def _leaders(cluster: Any, topic: str) -> dict[int, int]:
    """Partition -> leader node id of ``topic`` (raw confluent-kafka metadata)."""
    from confluent_kafka.admin import AdminClient

    bootstrap = ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes if n.running())
    admin = AdminClient({"bootstrap.servers": bootstrap})
    meta = admin.list_topics(kafka_topic_name(topic), timeout=15)
    parts = meta.topics[kafka_topic_name(topic)].partitions
    return {p: parts[p].leader for p in sorted(parts)}


def _roles(cluster: Any, group: str) -> dict[str, Any]:
    """Where the group's other moving parts live (diagnostic): its coordinator node and
    the leaders of its retry topic. Empty on any inspection error."""
    from confluent_kafka.admin import AdminClient

    bootstrap = ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes if n.running())
    admin = AdminClient({"bootstrap.servers": bootstrap})
    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        desc = admin.describe_consumer_groups([group])[group].result(timeout=15)
        out["coordinator"] = desc.coordinator.id
    with contextlib.suppress(Exception):
        retry = internal("r", group)
        parts = admin.list_topics(retry, timeout=15).topics[retry].partitions
        out["retry_leaders"] = {p: parts[p].leader for p in sorted(parts)}
    return out


def _sigkill(node: Any) -> int:
    """SIGKILL one node's JVM by the pid brokerctl recorded for it (nothing else)."""
    pid = node.pid()
    assert pid is not None, f"node {node.node_id} is not running"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while node.running() and time.monotonic() < deadline:
        if node._popen is not None:
            node._popen.poll()  # reap our child
        time.sleep(0.1)
    return pid


class _BatchPublisher(threading.Thread):
    """Publishes batches of new ids continuously; a batch's unconfirmed ids (PublishError
    lists the confirmed ones) are retried with the same ids in the next call."""

    def __init__(self, mq: mqabstract.Broker, topic: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self.mq, self.topic, self.prefix = mq, topic, prefix
        self.stop = threading.Event()
        self.confirmed: list[tuple[str, float]] = []
        self.attempted: set[str] = set()
        #: one entry per id of a batch call that did not confirm it: a copy may have landed
        self.failed: list[str] = []
        self.pending: list[str] = []
        self.errors: list[str] = []
        self.untyped: list[str] = []
        self.last_error = ""

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            fresh = [f"{self.prefix}-{i}" for i in range(n, n + BATCH - len(self.pending))]
            n += len(fresh)
            ids = self.pending + fresh
            self.attempted.update(ids)
            try:
                done = self.mq.publish_batch([
                    mqabstract.OutgoingMessage(self.topic, body_for(m), id=m) for m in ids])
            except mqabstract.PublishError as exc:
                done = list(exc.published)
                self.errors.append(type(exc).__name__)
                self.last_error = str(exc)[:300]
            except mqabstract.MQError as exc:
                done = []
                self.errors.append(type(exc).__name__)
                self.last_error = str(exc)[:300]
            except Exception as exc:  # a raw client exception leaked: a bug
                done = []
                self.untyped.append(f"{type(exc).__name__}: {exc}")
            now = time.monotonic()
            self.confirmed += [(m, now) for m in done]
            self.pending = [m for m in ids if m not in set(done)]
            self.failed += self.pending
            self.stop.wait(0.2 if self.pending else 0.05)


class _Consumer(threading.Thread):
    """Receives and acks on one subscription; after ``finish`` is set it stops once
    ``want()`` is acked and nothing came for ``quiet`` seconds (or at ``limit``)."""

    def __init__(self, sub: mqabstract.Subscription, ledger: Ledger, quiet: float) -> None:
        super().__init__(daemon=True)
        self.sub, self.ledger, self.quiet = sub, ledger, quiet
        self.finish = threading.Event()
        self.want: set[str] = set()
        self.limit = float("inf")
        self.times: list[float] = []
        self.errors: list[str] = []
        self.fatal = ""

    def run(self) -> None:
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if self.finish.is_set() and (
                now > self.limit
                or (self.want <= self.ledger.acked and now - last >= self.quiet)
            ):
                return
            try:
                msgs = self.ledger.receive(self.sub, 50, 0.5)
            except mqabstract.MQError as exc:
                self.errors.append(type(exc).__name__)
                if not exc.retryable:
                    self.fatal = f"{type(exc).__name__}: {exc}"[:300]
                    return
                time.sleep(0.3)
                continue
            for msg in msgs:
                last = time.monotonic()
                self.times.append(last)
                at = time.monotonic()
                try:
                    msg.ack()
                except mqabstract.LeaseExpired:  # it comes back with attempt + 1
                    self.errors.append("LeaseExpired")
                    self.ledger.settle(msg.id, LEASE_EXPIRED, "here", at)
                    continue
                except mqabstract.MQError as exc:
                    self.errors.append(type(exc).__name__)
                    continue
                self.ledger.ack(msg.id, t=at)


def _node_failure(cluster: Any, backend: str, reporter: Reporter, role: str) -> None:
    """Kill one node (``leader`` or ``follower`` of the topic) under load; restart it."""
    _heal(cluster)
    url = _url(cluster, backend)
    tok = token("k")
    topic, pattern, group = f"rel.{tok}.load", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=50, backend=backend)
    with mqabstract.connect(url) as mq, mqabstract.connect(url) as cmq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        sub = cmq.subscribe(group, pattern, lease=LEASE, max_attempts=50)
        pub = _BatchPublisher(mq, topic, tok)
        con = _Consumer(sub, ledger, quiet=4.0 + LEASE)
        victim: Any = None
        try:
            pub.start()
            con.start()
            deadline = time.monotonic() + 60
            while (len(pub.confirmed) < 200 or len(con.times) < 100) and \
                    time.monotonic() < deadline:
                time.sleep(0.2)
            leaders = _leaders(cluster, topic)
            led = {n.node_id: sum(1 for v in leaders.values() if v == n.node_id)
                   for n in cluster.nodes}
            # a follower: the node leading the fewest partitions (none, usually)
            victim_id = (leaders[0] if role == "leader"
                         else min(led, key=lambda i: (led[i], i)))
            victim = next(n for n in cluster.nodes if n.node_id == victim_id)
            roles = _roles(cluster, group)
            killed_at = time.monotonic()
            _sigkill(victim)
            # The node stays down OUTAGE seconds, and longer until the consumer delivers
            # again without it (Kafka fences a dead broker after broker.session.timeout.ms,
            # 9 s): consumption must resume on the two survivors.
            resumed = killed_at + OUTAGE
            while time.monotonic() < killed_at + MAX_OUTAGE and not any(
                    t > resumed for t in con.times[-50:]):
                time.sleep(0.2)
            new_leaders = _leaders(cluster, topic)
            restart_at = time.monotonic()
            restart_s = victim.start()
            back_at = time.monotonic()
            time.sleep(3)
            pub.stop.set()
            pub.join(60)
            for mid, _ in pub.confirmed:
                ledger.confirm(mid, body_for(mid))
            for mid in pub.failed:
                ledger.in_flight(mid, body_for(mid))
            con.want = set(ledger.expected)
            con.limit = time.monotonic() + 120
            con.finish.set()
            con.join(150)
        finally:
            pub.stop.set()
            con.finish.set()
            con.limit = 0
            if victim is not None and not victim.running():
                with contextlib.suppress(Exception):
                    victim.start()
            con.join(30)
            sub.close()
            cleanup(mq, group)
    after_kill = sum(1 for t in con.times if t > killed_at)
    during_outage = sum(1 for t in con.times if killed_at + OUTAGE < t < restart_at)
    stamps = sorted([killed_at, *con.times])
    gap = max((b - a for a, b in itertools.pairwise(stamps) if b > killed_at), default=0.0)
    confirmed_during = sum(1 for _, t in pub.confirmed if killed_at < t < back_at)
    problems = ledger.problems(release_margin=margin)
    reporter.emit(scenario=f"kafka cluster: SIGKILL {role}", backend=backend, kills=1,
                  published=len(pub.attempted), **ledger.summary(), problems=len(problems),
                  node=victim_id, leaders_before=leaders, **roles, leaders_during=new_leaders,
                  delivered_after_kill=after_kill, delivered_during_outage=during_outage,
                  confirmed_during_outage=confirmed_during, restart_s=round(restart_s, 1),
                  outage_s=round(restart_at - killed_at, 1), longest_gap_s=round(gap, 1),
                  errors_seen=sorted(set(pub.errors + con.errors)))
    assert not pub.untyped, f"raw client exceptions escaped publish: {pub.untyped[:3]}"
    assert not con.fatal, f"the consumer failed: {con.fatal}"
    assert not problems, "\n".join(problems)
    assert during_outage > 0, (
        f"nothing was delivered from {OUTAGE}s after node {victim_id}'s SIGKILL until its "
        f"restart {restart_at - killed_at:.1f}s after it ({after_kill} after the kill, "
        f"longest gap {gap:.1f}s); consumer errors {con.errors[-5:]}")
    if backend != "kafka-python":
        # kafka-python's producer may wait out a whole outage on a loaded machine (a full CI
        # run: 0 confirmed in 12.8 s, no error; alone: 2,900): reported above, not asserted
        # (docs/backends/kafka.md, known gaps). librdkafka must keep publishing.
        assert confirmed_during > 0, (
            f"nothing was confirmed while node {victim_id} was down; last publish error: "
            f"{pub.last_error}")
    if role == "leader":
        assert victim_id not in new_leaders.values(), (
            f"node {victim_id} still leads {new_leaders} {OUTAGE}s after its SIGKILL")


def test_sigkill_partition_leader(cluster: Any, backend: str, reporter: Reporter) -> None:
    """SIGKILL the node leading the topic's partition 0 under publish and consume load."""
    _node_failure(cluster, backend, reporter, "leader")


def test_sigkill_follower(cluster: Any, backend: str, reporter: Reporter) -> None:
    """SIGKILL a node that only follows the topic's partitions (or leads the fewest)."""
    _node_failure(cluster, backend, reporter, "follower")


def test_whole_cluster_restart(cluster: Any, backend: str, reporter: Reporter) -> None:
    """All three nodes stop and start under a subscribed consumer and a retrying
    publisher; the same Broker and Subscription objects recover and every confirmed
    publish is delivered."""
    _heal(cluster)
    url = _url(cluster, backend)
    tok = token("w")
    topic, pattern, group = f"rel.{tok}.r", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=50, backend=backend)
    errors: list[str] = []
    with mqabstract.connect(url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        sub = mq.subscribe(group, pattern, lease=LEASE, max_attempts=50)
        pub = Publisher(mq, topic, f"{tok}-p")
        receive_error = ""
        try:
            before = mq.publish_batch([mqabstract.OutgoingMessage(
                topic, body_for(f"{tok}-a{i}"), id=f"{tok}-a{i}") for i in range(50)])
            for mid in before:
                ledger.confirm(mid, body_for(mid))
            drain(sub, ledger, 0.0, 30, set(before[:20]), errors=errors)
            pub.start()
            time.sleep(1.0)
            stopped_at = time.monotonic()
            ledger.history.session_lost("here", stopped_at)
            cluster.stop()
            down_s = time.monotonic() - stopped_at
            time.sleep(2.0)
            start_s = cluster.start()
            back_at = time.monotonic()
            end = time.monotonic() + 90
            while time.monotonic() < end and sum(1 for _, t in pub.confirmed if t > back_at) < 20:
                time.sleep(0.2)
            pub.stop.set()
            pub.join(60)
            for mid, _ in pub.confirmed:
                ledger.confirm(mid, body_for(mid))
            for mid in pub.failed:  # a publish that raised may have landed: a copy
                ledger.in_flight(mid, body_for(mid))
            try:
                drain(sub, ledger, 4.0 + LEASE, 120, set(ledger.expected), errors=errors)
            except mqabstract.MQError as exc:
                receive_error = f"{type(exc).__name__}: {exc}"
        finally:
            pub.stop.set()
            _heal(cluster)
            sub.close()
            cleanup(mq, group)
    problems = ledger.problems(release_margin=margin)
    after = sum(1 for _, t in pub.confirmed if t > back_at)
    reporter.emit(scenario="kafka cluster: restart all nodes", backend=backend, kills=1,
                  published=len({m for m, _ in pub.confirmed} | pub.retried) + len(before),
                  **ledger.summary(), problems=len(problems), stop_s=round(down_s, 1),
                  start_s=round(start_s, 1), confirmed_after_restart=after,
                  errors_seen=sorted(set(errors + pub.errors)), receive_error=receive_error[:200])
    assert not pub.untyped, f"raw client exceptions escaped publish: {pub.untyped[:3]}"
    assert after >= 20, (f"publishing did not recover after the restart; errors "
                         f"{pub.errors[-5:]}; last: {pub.last_error}")
    assert not receive_error, f"the subscription did not recover: {receive_error}"
    assert not problems, "\n".join(problems)


def test_consumer_stalled_past_session(cluster: Any, backend: str, reporter: Reporter) -> None:
    """A consumer holding messages is SIGSTOPped longer than session + lease; another
    consumer of the group gets them with a higher attempt; the woken one's acks raise
    LeaseExpired; nothing is lost."""
    _heal(cluster)
    url = _url(cluster, backend)
    tok = token("s")
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    ledger = Ledger(max_attempts=50, backend=backend)
    held_n = 10
    with mqabstract.connect(url) as mq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        try:
            ids = mq.publish_batch([mqabstract.OutgoingMessage(
                topic, body_for(f"{tok}-{i}"), id=f"{tok}-{i}") for i in range(3 * held_n)])
            for mid in ids:
                ledger.confirm(mid, body_for(mid))
            # frozen longer than session + lease whatever happens meanwhile
            run = freeze_a_holder(mq, url, group, pattern, LEASE, held_n, ledger, margin,
                                  frozen_for=KAFKA_SESSION + LEASE + 1)
        finally:
            cleanup(mq, group)
    held, arrived, after, code = run.held, run.arrived, run.after, run.code
    problems = ledger.problems(release_margin=margin)
    took = max((t for t, _ in arrived.values()), default=float("nan")) - run.started
    expired = sum(1 for e in after if e[0] == "EXPIRED")
    reporter.emit(scenario="kafka cluster: consumer stalled past session", backend=backend,
                  kills=1, published=3 * held_n, **ledger.summary(), problems=len(problems),
                  held=len(held), came_back=len(arrived), came_back_s=round(took, 2), lease=LEASE,
                  margin=margin, frozen_s=round(run.frozen_s, 1), stale_acks_expired=expired,
                  stale_acks_accepted=len(after) - expired)
    assert code == 0, run.stderr
    assert held and set(held) <= set(arrived), f"held {sorted(held)}, came back {arrived}"
    lower = {m: (held[m], a) for m, (_, a) in arrived.items() if a <= held[m]}
    assert not lower, f"redelivered without a higher attempt (held, again): {lower}"
    assert not problems, "\n".join(problems)
    assert [e[0] for e in after] == ["EXPIRED"] * len(held), after


class _RawConsumer(threading.Thread):
    """The baseline: a plain confluent-kafka consumer, alone in its own group, on the same
    Kafka topic (earliest, auto commit, the driver's session and heartbeat); records when
    each record arrived and its ``mq-id``."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.group = bootstrap, topic, group
        self.stop = threading.Event()
        self.times: list[float] = []
        self.ids: set[str] = set()
        self.errors: list[str] = []

    def run(self) -> None:
        from confluent_kafka import Consumer

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "auto.offset.reset": "earliest", "enable.auto.commit": True,
                             "session.timeout.ms": int(SESSION * 1000),
                             "heartbeat.interval.ms": 1000, "log_level": 3})
        consumer.subscribe([self.topic])
        try:
            while not self.stop.is_set():
                for rec in consumer.consume(200, 0.5):
                    if rec.error() is not None:
                        self.errors.append(rec.error().name())
                        continue
                    mid = dict(rec.headers() or ()).get(wire.ID)
                    self.times.append(time.monotonic())
                    if mid is not None:
                        self.ids.add(mid.decode())
        finally:
            consumer.close()


def _pause(times: list[float], since: float, until: float) -> float:
    """The longest stretch without a delivery between ``since`` (the node loss) and
    ``until`` (publishing stopped)."""
    stamps = [since, *sorted(t for t in times if since < t < until), until]
    return max(b - a for a, b in itertools.pairwise(stamps))


def _replication(cluster: Any, topics: list[str]) -> dict[str, tuple[int, str]]:
    """Per Kafka topic: (fewest replicas of a partition, its min.insync.replicas)."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    bootstrap = ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes if n.running())
    admin = AdminClient({"bootstrap.servers": bootstrap})
    meta = admin.list_topics(timeout=15).topics
    out: dict[str, tuple[int, str]] = {}
    for topic in topics:
        replicas = min(len(p.replicas) for p in meta[topic].partitions.values())
        res = ConfigResource("topic", topic)
        config = admin.describe_configs([res])[res].result(timeout=15)
        out[topic] = (replicas, config["min.insync.replicas"].value)
    return out


def test_plain_url_sigkill_leader(cluster: Any, backend: str, reporter: Reporter) -> None:
    """The plain cluster URL, no replication options: the driver's defaults replicate its
    topics (3 replicas, min.insync.replicas 2), so SIGKILLing the leader of partition 0
    under load loses no confirmed message. A plain confluent-kafka consumer group reads the
    same topic meanwhile: its delivery pause after the kill is the baseline for ours."""
    _heal(cluster)
    url = with_client(backend, cluster.url)  # nothing else: the defaults are under test
    tok = token("p")
    topic, pattern, group = f"rel.{tok}.load", f"rel.{tok}.#", f"rel-{tok}"
    kafka_topic = kafka_topic_name(topic)
    bootstrap = cluster.url.removeprefix("kafka://")
    ledger = Ledger(max_attempts=50, backend=backend)
    with mqabstract.connect(url) as mq, mqabstract.connect(url) as cmq:
        margin = mq.capabilities.release_margin
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        sub = cmq.subscribe(group, pattern, lease=LEASE, max_attempts=50)
        pub = _BatchPublisher(mq, topic, tok)
        con = _Consumer(sub, ledger, quiet=4.0 + LEASE)
        raw = _RawConsumer(bootstrap, kafka_topic, f"raw-{tok}")
        victim: Any = None
        try:
            pub.start()
            con.start()
            deadline = time.monotonic() + 60
            while not pub.confirmed and time.monotonic() < deadline:
                time.sleep(0.1)
            raw.start()  # the topic exists now
            replication = _replication(cluster, [kafka_topic, internal("r", group),
                                                 internal("d", group), REGISTRY])
            deadline = time.monotonic() + 60
            while (len(pub.confirmed) < 200 or len(con.times) < 100 or len(raw.times) < 100) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            leaders = _leaders(cluster, topic)
            victim_id = leaders[0]
            victim = next(n for n in cluster.nodes if n.node_id == victim_id)
            killed_at = time.monotonic()
            _sigkill(victim)
            resumed = killed_at + OUTAGE
            while time.monotonic() < killed_at + MAX_OUTAGE and not (
                    any(t > resumed for t in con.times[-50:])
                    and any(t > resumed for t in raw.times[-50:])):
                time.sleep(0.2)
            restart_at = time.monotonic()
            restart_s = victim.start()
            back_at = time.monotonic()
            time.sleep(3)
            pub.stop.set()
            pub.join(60)
            stopped_at = time.monotonic()
            for mid, _ in pub.confirmed:
                ledger.confirm(mid, body_for(mid))
            for mid in pub.attempted - set(ledger.expected):
                ledger.in_flight(mid, body_for(mid))
            con.want = set(ledger.expected)
            con.limit = time.monotonic() + 120
            con.finish.set()
            limit = time.monotonic() + 120
            while not set(ledger.expected) <= raw.ids and time.monotonic() < limit:
                time.sleep(0.2)
            con.join(150)
        finally:
            pub.stop.set()
            raw.stop.set()
            con.finish.set()
            con.limit = 0
            if victim is not None and not victim.running():
                with contextlib.suppress(Exception):
                    victim.start()
            con.join(30)
            raw.join(30)
            sub.close()
            cleanup(mq, group)
    problems = ledger.problems(release_margin=margin)
    pause = _pause(con.times, killed_at, stopped_at)
    raw_pause = _pause(raw.times, killed_at, stopped_at)
    raw_missing = set(ledger.expected) - raw.ids
    confirmed_during = sum(1 for _, t in pub.confirmed if killed_at < t < back_at)
    reporter.emit(scenario="kafka cluster: SIGKILL leader, plain URL", backend=backend,
                  kills=1, published=len(pub.attempted), **ledger.summary(),
                  problems=len(problems), node=victim_id, leaders_before=leaders,
                  replication={t: list(r) for t, r in replication.items()},
                  pause_s=round(pause, 1), raw_pause_s=round(raw_pause, 1),
                  raw_delivered=len(raw.times), raw_missing=len(raw_missing),
                  confirmed_during_outage=confirmed_during, restart_s=round(restart_s, 1),
                  outage_s=round(restart_at - killed_at, 1),
                  errors_seen=sorted(set(pub.errors + con.errors)),
                  raw_errors=sorted(set(raw.errors)))
    assert not pub.untyped, f"raw client exceptions escaped publish: {pub.untyped[:3]}"
    assert not con.fatal, f"the consumer failed: {con.fatal}"
    assert all(r == (3, "2") for r in replication.values()), (
        f"topics not replicated by default (replicas, min.insync.replicas): {replication}")
    assert not problems, "\n".join(problems)
    assert not raw_missing, (f"{len(raw_missing)} confirmed ids never reached the plain "
                             f"consumer: {sorted(raw_missing)[:5]}")
