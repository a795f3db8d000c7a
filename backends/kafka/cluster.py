"""The Kafka cluster as a driver and its subscriptions use it: clients, topics, offsets.

``KafkaCluster`` is the part of ``KafkaDriver`` that its subscriptions call (topic names
and partitions, committed offsets, writes, the clients' settings); they are written
against it, so that ``driver`` imports ``subscription`` and never the other way round.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from mqabstract.capabilities import Capabilities
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    MQError,
    PublishError,
)
from mqabstract.url import BrokerURL, redact

from .client import (
    TP,
    Admin,
    Client,
    ClientError,
    Created,
    Kind,
    Outgoing,
    Producer,
    Settings,
)
from .errors import native, transient
from .names import internal, kafka_topic_name

__all__ = ["AUTO", "BROKER_DEFAULT", "KafkaCluster", "replication_plan"]

log = logging.getLogger("mqabstract.kafka")

#: ``replication_factor`` / ``min_insync_replicas`` values: chosen from the cluster's size
#: (the default), or left to the broker's ``default.replication.factor`` /
#: ``min.insync.replicas``.
AUTO = 0
BROKER_DEFAULT = -1

#: Seconds a cluster size stays cached. It is asked when topics are created, and must be
#: fresh: once a dead broker is fenced (Kafka: 9 s) a topic with one replica per broker
#: seen before cannot be created.
CLUSTER_SIZE_TTL = 1.0

#: Topic names ``topic`` remembers before it starts again (an application that publishes
#: to unboundedly many topics must not grow the map without end).
_NAMES_KEPT = 4096

R = TypeVar("R")


def replication_plan(brokers: int, replication_factor: int = AUTO,
                     min_insync_replicas: int = AUTO) -> tuple[int, int | None]:
    """The replication and ``min.insync.replicas`` of a topic created on a cluster of
    ``brokers`` brokers: ``(replication, min_isr)``, where replication -1 leaves it to the
    broker and ``min_isr`` None leaves the topic config unset (the broker's default).

    AUTO replication is ``min(3, brokers)``; AUTO ``min_isr`` is ``replication - 1`` kept
    within 1..2, so with ``acks=all`` a confirmed record is on two brokers once there are
    three and one broker may always fail without stopping publishes. Explicit values win;
    AUTO ``min_isr`` under the broker's replication (unknown here) is the broker's too.
    ``ValueError`` for a ``min_isr`` above the replication (every publish would fail).
    """
    auto = replication_factor == AUTO
    replication = min(3, max(1, brokers)) if auto else replication_factor
    if min_insync_replicas == AUTO:
        min_isr = None if replication == BROKER_DEFAULT else min(2, max(1, replication - 1))
    elif min_insync_replicas == BROKER_DEFAULT:
        min_isr = None
    else:
        min_isr = min_insync_replicas
    if min_isr is not None and replication != BROKER_DEFAULT and min_isr > replication:
        raise ValueError(f"min_insync_replicas={min_isr} is above the replication "
                         f"{replication} of the topics it would apply to: every publish "
                         "would fail (NOT_ENOUGH_REPLICAS)")
    return replication, min_isr


class KafkaCluster(abc.ABC):
    """One cluster, shared by a driver and its subscriptions: the clients (made per
    process), admin calls retried while coordinators move, the topic list, topics created
    on demand with their replication, groups' committed offsets, and writes waited for.

    Thread rules: any thread; ``_lock`` guards making the clients, ``_topics_lock`` the
    shared topic list.
    """

    def __init__(self, url: BrokerURL, opts: dict[str, Any], client: Client) -> None:
        self.url = url
        self.opts = opts
        self.prefix: str = opts["topic_prefix"]
        self.partitions: int = max(1, opts["partitions"])
        self.client = client
        self.settings = self._settings(url, opts)
        self._known: set[str] = set()
        self._names: dict[str, str] = {}  # mqabstract topic -> Kafka topic (``topic``)
        self._send_timeout = opts["request_timeout_ms"] / 1000 * 2
        self._brokers: tuple[int, float] | None = None  # (cluster size, when asked)
        self._most_brokers = 0
        self._warned: set[str] = set()  # topics reported as not replicated
        self.topic_version = 0
        self._lock = threading.Lock()  # creating clients
        self._topics_lock = threading.Lock()
        self._topics_at = float("-inf")
        self._all_topics: set[str] = set()
        self._closed = False
        self._pid = -1
        self._admin_c: Admin | None = None
        self._producer_c: Producer | None = None
        try:
            self.producer  # noqa: B018 - connect now: a bad URL fails at open
        except Exception as exc:
            self.close()
            raise ConnectionFailed(
                f"cannot connect to {url.redacted()}: {redact(str(exc))[:300]}") from exc

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """The driver's (``KafkaDriver``): subscriptions read ``max_lease``."""

    # -- setup -------------------------------------------------------------------------------
    @staticmethod
    def _settings(url: BrokerURL, opts: Mapping[str, Any]) -> Settings:
        servers = tuple(f"{h}:{p or 9092}" if ":" not in h else f"[{h}]:{p or 9092}"
                        for h, p in url.hosts) or ("127.0.0.1:9092",)
        user = opts["sasl_plain_username"] or url.username
        password = opts["sasl_plain_password"] or url.password
        protocol = opts["security_protocol"]
        mechanism = opts["sasl_mechanism"]
        if user is not None:
            mechanism = mechanism or "PLAIN"
            protocol = protocol or "SASL_PLAINTEXT"
        return Settings(
            servers=servers, client_id=opts["client_id"],
            request_timeout_ms=opts["request_timeout_ms"],
            connect_timeout=opts["connect_timeout"],
            security_protocol=protocol, sasl_mechanism=mechanism,
            sasl_username=user, sasl_password=password if user is not None else None,
            ssl_cafile=opts["ssl_cafile"], ssl_certfile=opts["ssl_certfile"],
            ssl_keyfile=opts["ssl_keyfile"], ssl_password=opts["ssl_password"],
            ssl_check_hostname=opts["ssl_check_hostname"], linger_ms=opts["linger_ms"],
            session_timeout_ms=opts["session_timeout_ms"],
            heartbeat_interval_ms=opts["heartbeat_interval_ms"],
            max_poll_interval_ms=opts["max_poll_interval_ms"],
            fetch_max_wait_ms=opts["fetch_max_wait_ms"],
            prefetch_kbytes=opts["prefetch_kbytes"],
        )

    def _fork_check(self) -> None:
        """Clients belong to the process that made them (their sockets and threads do not
        survive a fork): a child makes its own on first use."""
        pid = os.getpid()
        if pid != self._pid:
            self._pid = pid
            self._admin_c = self._producer_c = None
            self._all_topics, self._topics_at = set(), float("-inf")

    @property
    def admin(self) -> Admin:
        with self._lock:
            self._fork_check()
            if self._admin_c is None:
                self._admin_c = self.client.admin(self.settings)
            return self._admin_c

    @property
    def producer(self) -> Producer:
        made = self._producer_c  # every publish asks: the made one without the lock
        if made is not None and self._pid == os.getpid():
            return made
        with self._lock:
            self._fork_check()
            if self._producer_c is None:
                self._producer_c = self.client.producer(self.settings)
            return self._producer_c

    def _renew_producer(self, failure: ClientError) -> None:
        """Replace a producer that failed fatally (e.g. its idempotent producer id could not
        be re-initialised after a broker restart: every later send fails). A new producer
        gets a new producer id."""
        if failure.kind is not Kind.FATAL:
            return
        with self._lock:
            old, self._producer_c = self._producer_c, None
        log.info("kafka: producer renewed after %s", failure.native or failure.kind.value)
        if old is not None:
            old.close(0)

    def _check(self) -> None:
        if self._closed:
            raise Closed(f"broker {self.url.redacted()} is closed")

    def call(self, fn: Callable[..., R], *args: Any, groups: Collection[str] = (),
             budget: float | None = None) -> R:
        """One admin call, retried on transient errors until ``request_timeout_ms``.

        Apache Kafka answers group requests with NOT_COORDINATOR / COORDINATOR_LOAD_IN_PROGRESS
        while a ``__consumer_offsets`` partition moves or loads (seen on a busy single node
        too); the next try looks the coordinator up again.
        """
        if budget is None:
            budget = self.opts["request_timeout_ms"] / 1000
        deadline = time.monotonic() + budget
        pause = 0.05
        while True:
            try:
                return fn(*args)
            except ClientError as exc:
                if not exc.retriable or time.monotonic() + pause > deadline:
                    raise
                log.debug("kafka: %s retried after %s", getattr(fn, "__name__", fn),
                          exc.native)
                self.admin.forget_coordinators(groups)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    # -- topics ---------------------------------------------------------------------------------
    def topic(self, topic: str) -> str:
        """The Kafka topic of an mqabstract topic (remembered: every publish maps one)."""
        name = self._names.get(topic)
        if name is None:
            if len(self._names) >= _NAMES_KEPT:
                self._names.clear()
            name = self._names[topic] = kafka_topic_name(topic, self.prefix)
        return name

    def retry_topic(self, group: str) -> str:
        return internal("r", group)

    def dead_topic(self, group: str) -> str:
        return internal("d", group)

    def topic_names(self) -> set[str]:
        """Every topic name: the cluster's list at most ``metadata_max_age_ms`` old, shared by
        this driver's subscriptions (listing all topics costs ~0.1 s on a busy cluster),
        plus the topics this driver created, at once."""
        with self._topics_lock:
            now = time.monotonic()
            age = self.opts["metadata_max_age_ms"] / 1000
            if now - self._topics_at >= age:
                try:
                    self._all_topics = self.admin.list_topics()
                except Exception as exc:
                    if self._topics_at == float("-inf") or not transient(exc):
                        raise native(exc, "cannot list topics", self.url) from exc
                    # A node is away (the listing may have gone to it): keep reading with
                    # the topics known, try again in a second. Raising here would stop the
                    # subscriptions' data threads for the whole outage.
                    log.info("kafka: topic list kept: %s", redact(str(exc))[:300])
                    self._topics_at = now - age + 1.0
                    return self._all_topics | self._known
                self._topics_at = now
            return self._all_topics | self._known

    def partitions_for(self, topic: str) -> set[int]:
        """A topic's partitions (the producer's cached metadata: no full-cluster request)."""
        return self.producer.partitions(topic) or set()

    def cluster_size(self) -> int:
        """Brokers in the cluster's metadata (live ones), asked at most once a second."""
        cached = self._brokers
        if cached is not None and time.monotonic() - cached[1] < CLUSTER_SIZE_TTL:
            return cached[0]
        n = self.call(self.admin.cluster_size)
        self._brokers = (n, time.monotonic())
        self._most_brokers = max(self._most_brokers, n)
        return n

    def ensure_topics(self, names: Collection[str], partitions: int | None = None,
                      compact: bool = False) -> None:
        """Create missing topics (idempotent; an existing topic keeps its partitions and
        replication). Every topic the driver uses is created here: data, retry,
        dead-letter and registry topics. Replication and ``min.insync.replicas`` follow
        ``replication_plan`` over the cluster's size; an existing topic with one replica
        on a cluster of several brokers is reported once (a warning)."""
        if self._known.issuperset(names):  # every publish asks: known ones at once
            return
        missing = [n for n in names if n not in self._known]
        configs = {"cleanup.policy": "compact"} if compact else {}
        rf, isr = self.opts["replication_factor"], self.opts["min_insync_replicas"]
        brokers = 0  # unknown: needed for AUTO, else only for the replication check
        if rf != 1:
            try:
                brokers = self.cluster_size()
            except Exception as exc:
                if rf == AUTO and transient(exc):
                    raise native(exc, "cannot read the cluster's brokers", self.url) from exc
                if rf == AUTO:  # a broker without DescribeCluster: its defaults, said loudly
                    log.warning("kafka: the cluster's brokers cannot be read (%s): topics %s "
                                "are created with the broker's default replication",
                                redact(str(exc))[:300], sorted(missing))
                    rf = BROKER_DEFAULT
                else:
                    log.debug("kafka: cluster size not read: %s", redact(str(exc))[:300])
        try:
            replication, min_isr = replication_plan(brokers, rf, isr)
        except ValueError as exc:
            raise InvalidArgument(f"cannot create topics on {self.url.redacted()}: "
                                  f"{exc}") from exc
        if min_isr is not None:
            configs["min.insync.replicas"] = str(min_isr)
        try:
            result = self.call(self.admin.create_topics, missing,
                               partitions or self.partitions, replication, configs)
        except Exception as exc:
            raise native(exc, "cannot create topics", self.url) from exc
        for name, outcome in result.items():
            if isinstance(outcome, ClientError):
                raise ConnectionFailed(
                    f"cannot create topic {name!r} on {self.url.redacted()}: {outcome}")
        new = sorted(n for n, o in result.items() if o is Created.NEW)
        if new and rf == AUTO and replication < min(3, self._most_brokers):
            log.warning("kafka: topics %s created with replication %d: only %d of the %d "
                        "brokers seen earlier are in the cluster's metadata (one is down?)",
                        new, replication, brokers, self._most_brokers)
        existed = [n for n, o in result.items() if o is Created.EXISTED]
        if existed and brokers > 1 and rf != 1:
            self._check_replication(existed, brokers)
        if new:
            self._await_ready(new)
        self._known.update(missing)
        self.topic_version += 1  # our subscriptions look for new matching topics at once

    def _await_ready(self, names: Collection[str]) -> None:
        """Wait until topics just created are usable. CreateTopics returns once the
        controller has them; a broker answers for them a moment later, when its metadata
        has them with a leader per partition (a reader made at once failed its end-offset
        query with UNKNOWN_PARTITION: conformance, loaded machine). Bounded by the request
        timeout; past it, the lag is left to the callers' handling of transient errors."""
        deadline = time.monotonic() + self.opts["request_timeout_ms"] / 1000
        pending: dict[str, str] = dict.fromkeys(names, "not asked yet")
        while True:
            try:
                pending = self.admin.unready(sorted(pending))
            except Exception as exc:  # (the creation stands; the check is best effort)
                log.debug("kafka: readiness of %s not read: %s", sorted(pending),
                          redact(str(exc))[:300])
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if pending:
            log.warning("kafka: topics created but not usable after %d ms: %s",
                        self.opts["request_timeout_ms"], pending)

    def _check_replication(self, topics: Collection[str], brokers: int) -> None:
        """Warn, once per topic, about existing topics with a single replica on a cluster
        of several brokers: a publish to one is confirmed with no copy elsewhere, and its
        partitions stop while their broker is down. Best effort (never fails a call)."""
        todo = [t for t in topics if t not in self._warned]
        if not todo:
            return
        try:
            found = self.admin.replication(todo)
        except Exception as exc:
            log.debug("kafka: replication of %s not read: %s", todo, redact(str(exc))[:300])
            return
        for topic in sorted(found):
            if found[topic] == 1:
                self._warned.add(topic)
                log.warning(
                    "kafka: topic %r has replication 1 on a cluster of %d brokers: publishes "
                    "to it are confirmed with no second copy, and its partitions are "
                    "unavailable while their broker is down. Raise its replication "
                    "(kafka-reassign-partitions) and set min.insync.replicas=2 on it",
                    topic, brokers)

    # -- writes and offsets -----------------------------------------------------------------------
    def send(self, records: Sequence[Outgoing], ids: Sequence[str] = ()) -> None:
        """Write records and wait for every ack; raise naming the ones that failed (by
        ``ids``, the messages' ids, for a ``PublishError``)."""
        try:
            results = self.producer.send(records, self._send_timeout)
        except Exception as exc:  # the producer could not be made: nothing was sent
            raise native(exc, "publish failed", self.url) from exc
        self._confirmed(results, ids)

    def _confirmed(self, results: Sequence[ClientError | None], ids: Sequence[str]) -> None:
        """Raise for the records ``results`` says were not acknowledged: one record's own
        error, or a ``PublishError`` naming the confirmed ``ids`` (given for batches)."""
        if not any(results):  # all acknowledged (the common case: no per-record work)
            return
        failed: dict[int, MQError] = {}
        fatal: ClientError | None = None
        for i, err in enumerate(results):
            if err is None:
                continue
            failed[i] = native(err, "publish failed", self.url)
            fatal = fatal or err
        if fatal is not None:
            self._renew_producer(fatal)
        if failed:
            if len(results) == 1:
                raise failed[0]
            raise PublishError.from_outcomes(ids, [failed.get(i) for i in range(len(results))])

    def send_one(self, record: Outgoing) -> None:
        """Write one record and wait for its ack (one record per batch, see ``_read_all``)."""
        self.send([record])

    def committed(self, group: str, tps: Collection[TP]) -> dict[TP, tuple[int, str] | None]:
        """The group's committed (offset, checkpoint metadata); None where it has none."""
        try:
            return self.call(self.admin.group_offsets, group, tps, groups=(group,))
        except Exception as exc:
            raise native(exc, f"cannot read offsets of {group!r}", self.url) from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            producer, admin = self._producer_c, self._admin_c
            self._producer_c = self._admin_c = None
        if producer is not None:
            producer.close(5)
        if admin is not None:
            admin.close()
