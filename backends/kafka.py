"""Kafka backend (``kafka://host:9092[,host2:9092]``) on kafka-python 3.0.

Mapping (details and reasons in ``docs/backends/kafka.md``):

* one Kafka topic per mqabstract topic, created on demand with ``partitions`` partitions;
  ``key`` is the Kafka key, so per-key order is the partition's order;
* a group is a Kafka consumer group whose members subscribe to the group's retry topic
  ``__mqa..r..<group>`` only; each member reads, by manual assignment, the partitions of
  the topics matching the pattern (our regex) that map to the retry partitions it owns
  (``_slot``), so new topics need no rebalance; dead letters live in ``__mqa..d..<group>``;
* the group's declaration time is stored as a committed offset of the group on the
  internal topic ``__mqa..groups`` (durable, shared between processes);
* per-message ack on top of offsets: only the contiguous acked prefix of each partition is
  committed; auto-commit is off;
* the lease rule across freezes and crashes: each offset commit carries the partition's
  checkpoint as metadata (delivery mark, takeover bump, latest lease deadline, settled
  offsets, ``_Checkpoint``). The coordinator validates commits against member id and
  generation, so records are handed out, and anything re-published, only after such a
  commit succeeded (a consumer woken from a freeze past its session writes nothing); a
  new owner holds inherited records until the recorded deadline and delivers them with
  a higher attempt than any earlier owner gave. The session stays short (6 s): a frozen
  or killed holder's messages are back at most ``release_margin`` after their deadline;
* nack, lease expiry, delay and replay re-publish the message to the group's retry topic
  with its due time and delivery count in headers; a background thread per consumer
  holds records that are not due yet and hands them out when they are.

Every tansu workaround here is also correct on Apache Kafka; each says so where it is made.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import logging
import random
import re
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple

from kafka import (
    ConsumerRebalanceListener,
    KafkaAdminClient,
    KafkaConsumer,
    KafkaProducer,
    TopicPartition,
)
from kafka import structs as _kstructs
from kafka.admin import NewTopic
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from mqabstract import wire
from mqabstract.capabilities import Capabilities, Feature, Support
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    LeaseExpired,
    MessageTooLarge,
    MQError,
    NotFound,
    PublishError,
    Timeout,
)
from mqabstract.model import DeadLetter, Delivery, Envelope, GroupSpec, GroupStats, utc
from mqabstract.names import topic_matches
from mqabstract.options import Option, parse_options
from mqabstract.url import BrokerURL, redact

__all__ = ["KafkaDriver", "kafka_topic_name", "topic_regex"]

log = logging.getLogger("mqabstract.kafka")

# Headers we carry: the wire schema (mqabstract/wire.py); users cannot set ``mq-`` headers.
H_ID = wire.ID
H_TS = wire.PUBLISHED_AT  # exact float (the record timestamp has ms precision)
H_TOPIC = wire.TOPIC  # mqabstract topic, on retry/dead-letter records and hashed topics
H_KEY = wire.KEY  # original key on dead-letter records (their Kafka key is the entry id)
H_N = wire.ATTEMPT  # deliveries so far (attempt of the next delivery = n + 1)
H_DUE = wire.DELIVER_AT  # epoch seconds before which the record must not be delivered
H_HOPS = wire.HOPS  # idle hand-offs between consumers of a group, for back-off
H_REASON = wire.REASON
H_DEAD_AT = wire.DEAD_AT

MAX_TOPIC = 249  # Apache Kafka's limit on topic names
INTERNAL = "__mqa.."  # internal names contain "..", which no mapped mqabstract name does
HASHED = "__mqh.."
REGISTRY = INTERNAL + "groups"

_TANSU_NO_TS = -1

# Every topic is created explicitly (ensure_topics: partitions, compaction). With the
# clients' default, a metadata request for a topic that was deleted (delete_group) makes
# Apache Kafka (auto.create.topics.enable=true) create it again, with the broker's default
# partitions and cleanup policy: a retry topic with other slots, a dead-letter topic that
# is not compacted, and "topic_id changed ... likely recreated" churn in every client.
NO_AUTO_CREATE: dict[str, Any] = {"allow_auto_create_topics": False}
#: Seconds between a frozen or dead member's eviction (its session after its last heartbeat)
#: and the first delivery by the partitions' new owner: the join, positioning, a fetch.
#: Measured up to 0.6 s after the session on a loaded two-core machine; 2.5 s of headroom.
_RELEASE_SLACK = 2.5
#: Longest a revocation waits for re-publishes in flight (on kafka-python's IO thread).
_MOVING_WAIT = 3.0
_REBALANCING = getattr(getattr(_kstructs, "MemberState", None), "REBALANCING", "<rebalancing>")


def _transient(exc: BaseException) -> bool:
    """Whether a background thread should retry after ``exc`` instead of stopping: the
    broker is unreachable, restarting or moving a coordinator (the same call can work
    later). A background thread that stopped on such an error would leave the
    subscription dead for good after the broker came back."""
    if isinstance(exc, MQError):
        return exc.retryable
    if isinstance(exc, KafkaError):
        return bool(getattr(exc, "retriable", False)) or type(exc).__name__ in (
            "NoBrokersAvailable", "KafkaConnectionError", "NodeNotReadyError")
    return isinstance(exc, (ConnectionError, TimeoutError))


def _no_auto_create(client: Any) -> Any:
    """kafka-python 3.0.12 takes ``allow_auto_create_topics`` but never hands it to the
    cluster metadata that builds the requests: set it there too."""
    for attr in ("_cluster", "_metadata"):
        cluster = getattr(client, attr, None)
        config = getattr(cluster, "config", None)
        if isinstance(config, dict) and "allow_auto_create_topics" in config:
            config["allow_auto_create_topics"] = False
    return client


def _escape(name: str) -> str:
    # Apache Kafka refuses a topic whose name equals another's after '.' -> '_' (metric
    # names collide). Mapped names never contain '_', so the mapping stays injective there.
    return name.replace("-", "--").replace("_", "-u")


_UNESCAPE = re.compile(r"-(.)")


def _unescape(name: str) -> str:
    return _UNESCAPE.sub(lambda m: {"-": "-", "u": "_"}.get(m[1], m[0]), name)


def kafka_topic_name(topic: str, prefix: str = "") -> str:
    """The Kafka topic for an mqabstract topic (hashed when longer than Kafka allows)."""
    name = prefix + _escape(topic)
    if len(name) <= MAX_TOPIC:
        return name
    return HASHED + hashlib.sha256((prefix + "\0" + topic).encode()).hexdigest()[:48]


def _internal(kind: str, group: str) -> str:
    name = f"{INTERNAL}{kind}..{_escape(group)}"
    if len(name) <= MAX_TOPIC:
        return name
    return f"{INTERNAL}{kind}..h-{hashlib.sha256(group.encode()).hexdigest()[:48]}"


def topic_regex(pattern: str, prefix: str = "") -> str:
    """A regex over Kafka topic names matching exactly the mapped topics ``pattern`` matches.

    AMQP ``#`` absorbs its own separator, so a separator is either a dot or, at the very
    start of the mapped name, nothing (the fixed-width look-behind on the prefix).
    """
    words = pattern.split(".")
    if "*" not in words and "#" not in words:
        return "^" + re.escape(kafka_topic_name(pattern, prefix)) + "$"
    sep = rf"(?:(?<=^{re.escape(prefix)})|\.)"
    parts = []
    for word in words:
        if word == "*":
            parts.append(sep + r"[^.]+")
        elif word == "#":
            parts.append(rf"(?:{sep}[^.]+)*")
        else:
            parts.append(sep + re.escape(_escape(word)))
    # Hashed (over-long) topics cannot be matched by name: take them all and filter on the
    # topic carried in their header.
    return rf"^(?:{re.escape(prefix)}{''.join(parts)}|{re.escape(HASHED)}.+)$"


def _hdr(headers: Sequence[tuple[str, bytes | None]]) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", "replace") for k, v in headers}


def _native(exc: BaseException, what: str, url: BrokerURL) -> MQError:
    text = redact(f"{what} on {url.redacted()}: {type(exc).__name__}: {exc}")[:2000]
    name = type(exc).__name__
    if name == "InvalidSessionTimeoutError":
        return InvalidArgument(redact(
            f"{what} on {url.redacted()}: the broker refuses the consumer session timeout; "
            "set the option session_timeout_ms (URL query or connect() keyword) within "
            "the broker's group.min.session.timeout.ms .. group.max.session.timeout.ms "
            "(Apache Kafka: 6000 .. 1800000 by default), and heartbeat_interval_ms below "
            "a third of it")[:2000])
    if "TooLarge" in name:
        return MessageTooLarge(text)
    if "Timeout" in name:
        return Timeout(text)
    if isinstance(exc, KafkaError) and not getattr(exc, "retriable", True):
        return MQError(text)
    return ConnectionFailed(text)


class KafkaDriver(Driver):
    """Kafka through kafka-python: topics, partitions, consumer groups, emulated leases."""

    name: ClassVar[str] = "kafka"

    OPTIONS: ClassVar[dict[str, Option]] = {
        "partitions": Option(int, 4, "partitions of topics this driver creates"),
        "replication_factor": Option(int, -1, "replication of created topics (-1: broker)"),
        "topic_prefix": Option(str, "", "prefix of every mapped topic name"),
        # Apache Kafka refuses sessions below group.min.session.timeout.ms (6000 by default).
        "session_timeout_ms": Option(int, 6000, "consumer session (broker: 6000 or more)"),
        "heartbeat_interval_ms": Option(int, 1000, "consumer heartbeat (< session / 3)"),
        "max_poll_interval_ms": Option(int, 30000, "rebalance timeout of the group"),
        "metadata_max_age_ms": Option(int, 1000, "how soon new topics reach pattern groups"),
        "request_timeout_ms": Option(int, 15000, "per request"),
        "connect_timeout": Option(float, 10.0, "seconds to reach the cluster at open"),
        "linger_ms": Option(int, 2, "producer batching delay"),
        "handoff_ms": Option(int, 500, "idle consumer hands ready messages to the group"),
        "max_buffered": Option(int, 20000, "records one consumer holds before pausing"),
        "client_id": Option(str, "mqabstract", "Kafka client id"),
        "security_protocol": Option(str, None, "PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
        "sasl_mechanism": Option(str, None, "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, ..."),
        "sasl_plain_username": Option(str, None, "SASL user (default: URL user)"),
        "sasl_plain_password": Option(str, None, "SASL password (default: URL password)"),
        "ssl_cafile": Option(str, None, "CA bundle"),
        "ssl_certfile": Option(str, None, "client certificate"),
        "ssl_keyfile": Option(str, None, "client key"),
        "ssl_password": Option(str, None, "client key password"),
        "ssl_check_hostname": Option(bool, True, "verify the broker's host name"),
    }

    CAPABILITIES: ClassVar[Capabilities] = Capabilities(
        features={
            Feature.WILDCARDS: Support.EMULATED,
            Feature.FANOUT: Support.NATIVE,
            Feature.COMPETING: Support.NATIVE,
            Feature.LEASE_EXTEND: Support.EMULATED,
            Feature.NACK_DELAY: Support.EMULATED,
            Feature.DELAY: Support.EMULATED,
            Feature.PRIORITY: Support.UNSUPPORTED,
            Feature.ORDERING: Support.NATIVE,
            Feature.DEAD_LETTER: Support.EMULATED,
            Feature.BATCH: Support.NATIVE,
        },
        # Apache's default message.max.bytes is 1 MiB + 12 per batch; keep room for
        # headers (16 KiB) and ours.
        max_body_bytes=1_000_000,
        max_headers=64,
        max_header_bytes=16 * 1024,
        # Topics keep records 7 days by default: a delayed record must outlive its delay.
        max_delay=6 * 86400.0,
        max_batch=10_000,
        max_priority=0,
        max_receive=1000,
        min_lease=1.0,  # a lease that runs out is a re-publish to the retry topic
        # A frozen or killed member is evicted one session (6 s) after its last heartbeat,
        # so at most one session after its lease deadline; its partitions' new owner
        # delivers after a join (measured: at most 6.1 s after the deadline,
        # docs/backends/kafka.md). The instance value follows session_timeout_ms.
        release_margin=_RELEASE_SLACK + 6.0,
        max_consumers_per_group=4,  # the default ``partitions``
        notes={
            Feature.PRIORITY: "a Kafka partition is an ordered log; ordering a group's "
            "partitions by priority would only reorder what one consumer has fetched",
        },
    )

    def __init__(self, url: BrokerURL, opts: dict[str, Any]) -> None:
        self.url = url
        self.opts = opts
        self.prefix: str = opts["topic_prefix"]
        self.partitions: int = max(1, opts["partitions"])
        self.common = self._client_config(url, opts)
        self._lock = threading.Lock()  # admin client and caches
        self._producer_lock = threading.Lock()
        self._known: set[str] = set()
        self._declared: dict[str, int] = {}
        self.topic_version = 0
        self._topics_lock = threading.Lock()
        self._topics_at = float("-inf")
        self._all_topics: set[str] = set()
        self._meta: Any = None
        self._closed = False
        timeout = int(opts["connect_timeout"] * 1000)
        self.admin: Any = None
        try:
            self.admin = KafkaAdminClient(**self.common, bootstrap_timeout_ms=timeout)
            self.producer = self._new_producer()
        except Exception as exc:
            if self.admin is not None:
                with contextlib.suppress(Exception):
                    self.admin.close()
            raise ConnectionFailed(
                f"cannot connect to {url.redacted()}: {type(exc).__name__}: "
                f"{redact(str(exc))[:300]}"
            ) from exc
        # Instance refinements: competing consumers are bounded by the partitions this
        # driver creates (retry topics included, whose partitions are the slots); the
        # release margin follows the session.
        self._caps = replace(self.CAPABILITIES, max_consumers_per_group=self.partitions,
                             release_margin=opts["session_timeout_ms"] / 1000 + _RELEASE_SLACK)

    # -- setup -------------------------------------------------------------------------------
    def _new_producer(self) -> KafkaProducer:
        return _no_auto_create(KafkaProducer(
            **self.common,
            allow_auto_create_topics=False,  # see NO_AUTO_CREATE
            max_block_ms=self.opts["request_timeout_ms"],
            acks="all",
            enable_idempotence=True,
            linger_ms=self.opts["linger_ms"],
            max_request_size=1_048_576,
            batch_size=256 * 1024,
            bootstrap_timeout_ms=int(self.opts["connect_timeout"] * 1000),
        ))

    def _renew_producer(self, failure: BaseException) -> None:
        """Replace a producer that failed fatally (e.g. its idempotent producer id could not
        be re-initialised after a broker restart: kafka-python then fails every later send).
        A new producer gets a new producer id: right on Apache Kafka and on tansu."""
        if not isinstance(failure, KafkaError) or getattr(failure, "retriable", False):
            return
        if "TooLarge" in type(failure).__name__ or "Invalid" in type(failure).__name__:
            return  # about the record, not the producer
        with self._producer_lock:
            old = self.producer
            try:
                self.producer = self._new_producer()
            except Exception as exc:  # broker still away: try again after the next failure
                log.info("kafka: producer not renewed: %s", redact(str(exc)))
                return
        log.info("kafka: producer renewed after %s", type(failure).__name__)
        with contextlib.suppress(Exception):
            old.close(timeout=0)

    @staticmethod
    def _client_config(url: BrokerURL, opts: Mapping[str, Any]) -> dict[str, Any]:
        servers = [f"{h}:{p or 9092}" if ":" not in h else f"[{h}]:{p or 9092}"
                   for h, p in url.hosts] or ["127.0.0.1:9092"]
        cfg: dict[str, Any] = {
            "bootstrap_servers": servers,
            "client_id": opts["client_id"],
            "request_timeout_ms": opts["request_timeout_ms"],
        }
        user = opts["sasl_plain_username"] or url.username
        password = opts["sasl_plain_password"] or url.password
        protocol = opts["security_protocol"]
        if user is not None:
            cfg["sasl_mechanism"] = opts["sasl_mechanism"] or "PLAIN"
            cfg["sasl_plain_username"] = user
            cfg["sasl_plain_password"] = password
            protocol = protocol or "SASL_PLAINTEXT"
        elif opts["sasl_mechanism"]:
            cfg["sasl_mechanism"] = opts["sasl_mechanism"]
        if protocol:
            cfg["security_protocol"] = protocol
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password"):
            if opts[name]:
                cfg[name] = opts[name]
        if not opts["ssl_check_hostname"]:
            cfg["ssl_check_hostname"] = False
        return cfg

    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> KafkaDriver:
        return cls(url, parse_options(url, options, cls.OPTIONS, cls.name))

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _check(self) -> None:
        if self._closed:
            raise Closed(f"broker {self.url.redacted()} is closed")

    def _admin(self, call: Any, *args: Any, groups: Collection[str] = (),
               budget: float | None = None, **kw: Any) -> Any:
        """One admin call under the admin lock, retried on retriable errors until
        ``request_timeout_ms``.

        Apache Kafka answers group requests with NOT_COORDINATOR / COORDINATOR_LOAD_IN_PROGRESS
        while a ``__consumer_offsets`` partition moves or loads (seen on a busy single
        node too); its Java clients retry those, kafka-python's admin client does not and
        keeps the group's coordinator cached, so the next try looks it up again.
        """
        if budget is None:
            budget = self.opts["request_timeout_ms"] / 1000
        deadline = time.monotonic() + budget
        pause = 0.05
        while True:
            try:
                with self._lock:
                    return call(*args, **kw)
            except KafkaError as exc:
                if not getattr(exc, "retriable", False) or time.monotonic() + pause > deadline:
                    raise
                log.debug("kafka: %s retried after %s", call.__name__, type(exc).__name__)
                with contextlib.suppress(Exception):  # kafka-python keeps it forever
                    cache = self.admin._manager.cluster._coordinators
                    for key in [k for k in cache if k[1] in groups]:
                        del cache[key]
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def topic(self, topic: str) -> str:
        return kafka_topic_name(topic, self.prefix)

    def retry_topic(self, group: str) -> str:
        return _internal("r", group)

    def dead_topic(self, group: str) -> str:
        return _internal("d", group)

    def topic_names(self) -> set[str]:
        """Every topic name: the cluster's list at most ``metadata_max_age_ms`` old, shared by
        this driver's subscriptions (listing all topics costs ~0.1 s on a busy cluster),
        plus the topics this driver created, at once."""
        with self._topics_lock:
            now = time.monotonic()
            if now - self._topics_at >= self.opts["metadata_max_age_ms"] / 1000:
                try:
                    if self._meta is None:
                        self._meta = _no_auto_create(KafkaConsumer(
                            **self.common, **NO_AUTO_CREATE, group_id=None))
                    self._all_topics = set(self._meta.topics())
                except Exception as exc:
                    raise _native(exc, "cannot list topics", self.url) from exc
                self._topics_at = now
            return self._all_topics | self._known

    def ensure_topics(self, names: Collection[str], partitions: int | None = None,
                      compact: bool = False) -> None:
        """Create missing topics (idempotent; an existing topic keeps its partitions)."""
        missing = [n for n in names if n not in self._known]
        if not missing:
            return
        configs = {"cleanup.policy": "compact"} if compact else {}
        new = [NewTopic(n, partitions or self.partitions, self.opts["replication_factor"],
                        topic_configs=configs) for n in missing]
        try:
            result = self._admin(self.admin.create_topics, new, raise_errors=False)
        except Exception as exc:
            raise _native(exc, "cannot create topics", self.url) from exc
        for item in result.get("topics", []):
            code = item.get("error_code", 0)
            if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS
                raise ConnectionFailed(
                    f"cannot create topic {item.get('name')!r} on {self.url.redacted()}: "
                    f"error {code} {item.get('error_message') or ''}"
                )
        self._known.update(missing)
        self.topic_version += 1  # our subscriptions look for new matching topics at once

    # -- publishing ----------------------------------------------------------------------------
    def _record_headers(self, env: Envelope, topic_header: bool) -> list[tuple[str, bytes]]:
        headers = [(k, v.encode()) for k, v in env.headers.items()]
        headers.append((H_ID, env.id.encode()))
        headers.append((H_TS, repr(env.published_at).encode()))
        if env.deliver_at is not None:
            headers.append((H_DUE, repr(env.deliver_at).encode()))
        if topic_header:
            headers.append((H_TOPIC, env.topic.encode()))
        return headers

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        self._check()
        names = {e.topic: self.topic(e.topic) for e in envelopes}
        self.ensure_topics(set(names.values()))
        futures: list[Any] = []
        for env in envelopes:
            name = names[env.topic]
            try:
                futures.append(self.producer.send(
                    name,
                    value=env.body,
                    key=env.key.encode() if env.key is not None else None,
                    headers=self._record_headers(env, name.startswith(HASHED)),
                    timestamp_ms=int(env.published_at * 1000),
                ))
            except Exception as exc:
                futures.append(exc)
        self.wait_all(futures, [e.id for e in envelopes])

    def wait_all(self, futures: list[Any], ids: list[str]) -> list[Any]:
        """Wait for every send; raise PublishError naming the ones that failed."""
        with contextlib.suppress(Exception):
            self.producer.flush(timeout=self.opts["request_timeout_ms"] / 1000 * 2)
        failed: dict[int, MQError] = {}
        done: list[str] = []
        meta: list[Any] = []
        fatal: BaseException | None = None
        for i, fut in enumerate(futures):
            try:
                if isinstance(fut, BaseException):
                    raise fut
                meta.append(fut.get(timeout=self.opts["request_timeout_ms"] / 1000))
                done.append(ids[i])
            except Exception as exc:
                meta.append(None)
                failed[i] = _native(exc, "publish failed", self.url)
                fatal = fatal or exc
        if fatal is not None:
            self._renew_producer(fatal)
        if failed:
            if len(futures) == 1:
                raise failed[0]
            first = next(iter(failed.values()))
            raise PublishError(f"{len(failed)} of {len(futures)} not confirmed: {first}",
                               published=done, failed=failed)
        return meta

    def send_one(self, topic: str, value: bytes | None, key: bytes | None,
                 headers: list[tuple[str, bytes]], partition: int | None = None) -> Any:
        """Send one record and wait for its ack (one record per batch, see dead_letters)."""
        try:
            fut = self.producer.send(topic, value=value, key=key, headers=headers,
                                     partition=partition)
            self.producer.flush(timeout=self.opts["request_timeout_ms"] / 1000)
            return fut.get(timeout=self.opts["request_timeout_ms"] / 1000)
        except Exception as exc:
            self._renew_producer(exc)
            raise _native(exc, f"cannot write to {topic}", self.url) from exc

    # -- groups --------------------------------------------------------------------------------
    def declare(self, spec: GroupSpec) -> None:
        self._check()
        names = [self.retry_topic(spec.name)]
        words = spec.pattern.split(".")
        if "*" not in words and "#" not in words:
            names.append(self.topic(spec.pattern))
        self.ensure_topics(names)
        self.ensure_topics([self.dead_topic(spec.name)], partitions=1, compact=True)
        self.ensure_topics([REGISTRY], partitions=1)
        self.declared_ms(spec.name, create=True)

    def declared_ms(self, group: str, create: bool = False) -> int | None:
        """When the group was declared (epoch ms), stored as a committed offset on the
        registry topic: durable, visible to every process, no extra topic per group.

        It is committed by a shadow group ``<group>..mqa-declared`` that never has members:
        Apache Kafka refuses an admin offset commit for a group with active members
        (UNKNOWN_MEMBER_ID), so writing it as the group's own offset fails when another
        process's consumer is already in the group (two processes subscribing at once, a
        group that existed before). Groups declared by older versions have it as the
        group's own offset: read there when the shadow has none.

        (Offset-commit metadata would be the obvious place, but tansu drops it. A committed
        offset is just as durable on Apache Kafka, so this is right on both.)
        """
        if group in self._declared:
            return self._declared[group]
        tp = TopicPartition(REGISTRY, 0)
        key = _declared_key(group)
        try:
            found = self._admin(self.admin.list_group_offsets, {key: [tp], group: [tp]},
                                groups=(key, group))
            value: int | None = None
            for name in (key, group):
                oam = found.get(name, {}).get(tp)
                if oam is not None and oam.offset >= 0:
                    value = oam.offset
                    break
            if value is None and create:
                value = int(time.time() * 1000)
                self._admin(self.admin.alter_group_offsets, key,
                            {tp: OffsetAndMetadata(value, "", -1)}, groups=(key,))
        except Exception as exc:
            raise _native(exc, f"cannot read group {group!r}", self.url) from exc
        if value is not None:
            self._declared[group] = value
        return value

    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        self._check()
        declared = self.declared_ms(spec.name, create=True)
        assert declared is not None
        return KafkaSubscription(self, spec, declared)

    def committed(self, group: str, tps: Collection[TopicPartition]
                  ) -> dict[TopicPartition, OffsetAndMetadata | None]:
        """The group's committed offsets with their metadata (the partition checkpoint,
        ``_Checkpoint``); None where it has none."""
        try:
            found = self._admin(self.admin.list_group_offsets, {group: list(tps)},
                                groups=(group,)).get(group, {})
        except Exception as exc:
            raise _native(exc, f"cannot read offsets of {group!r}", self.url) from exc
        out: dict[TopicPartition, OffsetAndMetadata | None] = {}
        for tp in tps:
            oam = found.get(tp)
            out[tp] = oam if oam is not None and oam.offset >= 0 else None
        return out

    # -- dead letters ----------------------------------------------------------------------------
    def _read_all(self, topic: str) -> list[Any]:
        """Every record of a one-partition topic, oldest first.

        Reads up to the end offset. tansu reports a wrong (too low) end offset after a
        batched produce, so every write to dead-letter topics is a one-record batch (see
        ``send_one``); that is also correct on Apache Kafka.
        """
        consumer = _no_auto_create(KafkaConsumer(
            **self.common, **NO_AUTO_CREATE, group_id=None, enable_auto_commit=False))
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            end = consumer.end_offsets([tp])[tp]
            out: list[Any] = []
            deadline = time.monotonic() + self.opts["request_timeout_ms"] / 1000
            while consumer.position(tp) < end and time.monotonic() < deadline:
                for recs in consumer.poll(timeout_ms=200).values():
                    out.extend(recs)
            return out
        except Exception as exc:
            raise _native(exc, f"cannot read {topic}", self.url) from exc
        finally:
            consumer.close()

    def _dead_entries(self, group: str) -> list[Any]:
        topic = self.dead_topic(group)
        if topic not in self._known:
            try:
                with self._lock:
                    exists = topic in set(self.admin.list_topics())
            except Exception as exc:
                raise _native(exc, "cannot list topics", self.url) from exc
            if not exists:
                raise NotFound(f"no group {group!r} on {self.url.redacted()}")
            self._known.add(topic)
        live: dict[bytes, Any] = {}
        for rec in self._read_all(topic):
            if rec.value is None:  # tombstone: purged or replayed
                live.pop(rec.key, None)
            else:
                live[rec.key] = rec
        return list(live.values())

    @staticmethod
    def _dead_letter(rec: Any) -> DeadLetter:
        h = _hdr(rec.headers)
        meta = {k: h.pop(k) for k in list(h) if k.startswith(wire.PREFIX)}
        dead_at = meta.get(H_DEAD_AT)
        return DeadLetter(
            id=meta.get(H_ID, ""),
            topic=meta.get(H_TOPIC, ""),
            body=rec.value,
            headers=h,
            key=meta.get(H_KEY),
            priority=0,
            published_at=utc(float(meta.get(H_TS, rec.timestamp / 1000))),
            attempts=int(meta.get(H_N, "0")),
            reason=meta.get(H_REASON, ""),
            dead_lettered_at=utc(float(dead_at)) if dead_at else None,
        )

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        self._check()
        return [self._dead_letter(r) for r in self._dead_entries(group)[:limit]]

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        self._check()
        picked = self._pick(group, ids)
        retry = self.retry_topic(group)
        self.ensure_topics([retry])
        for rec in picked:
            headers = [(k, v) for k, v in rec.headers
                       if k not in (H_N, H_REASON, H_DEAD_AT, H_KEY, H_HOPS, H_DUE)]
            headers.append((H_N, b"0"))
            key = _hdr(rec.headers).get(H_KEY)
            self.send_one(retry, rec.value, key.encode() if key is not None else None, headers)
            self.send_one(self.dead_topic(group), None, rec.key, [])
        return len(picked)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        # Kafka cannot delete single records (and tansu has no delete_records): a purge
        # writes a tombstone for the entry; the topic is compacted, so Apache Kafka drops
        # both eventually, and readers skip tombstoned entries at once.
        self._check()
        picked = self._pick(group, ids)
        for rec in picked:
            self.send_one(self.dead_topic(group), None, rec.key, [])
        return len(picked)

    def _pick(self, group: str, ids: Collection[str] | None) -> list[Any]:
        entries = self._dead_entries(group)
        if ids is None:
            return entries
        return [r for r in entries if _hdr(r.headers).get(H_ID) in ids]

    def stats(self, group: str) -> GroupStats:
        self._check()
        return GroupStats(group, None, None, None, len(self._dead_entries(group)))

    def delete_group(self, group: str) -> None:
        self._check()
        topics = [self.retry_topic(group), self.dead_topic(group)]
        try:
            with self._lock:
                with contextlib.suppress(Exception):
                    self.admin.delete_topics(topics, raise_errors=False)
                with contextlib.suppress(Exception):
                    # (..mqa-delivered / ..mqa-takeovers: delivery marks of versions
                    # before the partition checkpoint)
                    self.admin.delete_groups([group, _declared_key(group),
                                              group + "..mqa-delivered",
                                              group + "..mqa-takeovers"])
        except Exception as exc:  # pragma: no cover - suppressed above
            raise _native(exc, f"cannot delete group {group!r}", self.url) from exc
        self._known.difference_update(topics)
        self._declared.pop(group, None)
        # kafka-python's producer asks for the metadata of every topic it ever wrote to,
        # forever, and retries at once on "unknown topic": forget the deleted ones.
        with contextlib.suppress(Exception):
            self.producer._metadata._topics.difference_update(topics)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.producer.flush()
        finally:
            with contextlib.suppress(Exception):
                self.producer.close(timeout=5)
            with contextlib.suppress(Exception):
                self.admin.close()
            with self._topics_lock, contextlib.suppress(Exception):
                if self._meta is not None:
                    self._meta.close()


def _declared_key(group: str) -> str:
    return group + "..mqa-declared"


_CKPT = "mq1"
#: Characters of done-offset ranges in a checkpoint (Apache Kafka keeps commit metadata up
#: to offset.metadata.max.bytes, 4096 by default).
_CKPT_RANGES = 3000


class _Checkpoint(NamedTuple):
    """What the owner of a partition stores with its committed offset (commit metadata).

    ``mark``: records below it were handed to an application (by this owner or earlier
    ones). ``bump``: attempts the owner adds to records below the mark it inherited.
    ``deadline``: epoch seconds; no lease on a record below the mark runs past it.
    ``done``: settled offsets above the committed one (acked, re-published, dead-lettered),
    as ranges; a subset when it does not fit (those are delivered again, with the bump).
    """

    mark: int = 0
    bump: int = 0
    deadline: float = 0.0
    done: tuple[tuple[int, int], ...] = ()

    def encode(self, limit: int = _CKPT_RANGES) -> str:
        items: list[str] = []
        size = 0
        for a, b in self.done:
            item = str(a) if a == b else f"{a}-{b}"
            size += len(item) + 1
            if size > limit:
                break
            items.append(item)
        return f"{_CKPT} {self.mark} {self.bump} {int(self.deadline * 1000)} {','.join(items)}"

    @classmethod
    def decode(cls, meta: str | None) -> _Checkpoint:
        words = (meta or "").split(" ")
        if len(words) != 5 or words[0] != _CKPT:
            return cls()  # none, or written by a plain client
        try:
            done = []
            for item in filter(None, words[4].split(",")):
                a, _, b = item.partition("-")
                done.append((int(a), int(b or a)))
            return cls(int(words[1]), int(words[2]), int(words[3]) / 1000, tuple(done))
        except ValueError:
            return cls()


def _ranges(offsets: Collection[int]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for off in sorted(offsets):
        if out and off == out[-1][1] + 1:
            out[-1] = (out[-1][0], off)
        else:
            out.append((off, off))
    return tuple(out)


class _Part:
    """Offsets of one assigned partition: fetched, acked, committed, and its checkpoint."""

    __slots__ = ("bump", "committed", "confirmed", "deadline", "done", "hold", "inherited",
                 "mark", "meta", "next_fetch", "order", "revoked_at", "sent_meta")

    def __init__(self, found: OffsetAndMetadata | None) -> None:
        committed = found.offset if found is not None else None
        ckpt = _Checkpoint.decode(found.metadata if found is not None else None)
        self.order: deque[int] = deque()  # fetched offsets not yet committed, in order
        self.done: set[int] = set()
        self.committed = committed  # last offset sent in a commit
        self.confirmed = committed  # last commit the coordinator accepted
        self.meta = found.metadata if found is not None else None  # sent with ``committed``
        self.sent_meta = self.meta  # as confirmed
        self.next_fetch: int | None = None
        self.mark = max(ckpt.mark, committed or 0)
        self.deadline = ckpt.deadline
        self.revoked_at: tuple[int | None, str | None] | None = None
        # Records below the inherited mark were handed out by earlier owners that did not
        # commit them: one attempt more than any of them gave (bump), not before the last
        # lease on them ends (hold), except those the checkpoint lists as settled.
        if committed is not None and ckpt.mark > committed:
            self.inherited = ckpt.mark
            self.bump = ckpt.bump + 1
            self.hold = ckpt.deadline
            for a, b in ckpt.done:
                if b >= committed:
                    self.done.update(range(max(a, committed), b + 1))
        else:
            self.inherited = 0
            self.bump = 0
            self.hold = 0.0

    def fetched(self, offset: int) -> None:
        self.order.append(offset)
        self.next_fetch = offset + 1

    def commit_point(self) -> int | None:
        order, done = self.order, self.done
        while order and order[0] in done:
            done.discard(order.popleft())
        if order:
            return order[0]
        return self.next_fetch

    def checkpoint(self, limit: int = _CKPT_RANGES) -> tuple[int | None, str]:
        """(offset to commit, metadata): call with the subscription lock held."""
        point = self.commit_point()
        if point is None:
            point = self.committed
        done = [o for o in self.done if point is None or o >= point]
        ckpt = _Checkpoint(self.mark, self.bump, self.deadline, _ranges(done))
        return point, ckpt.encode(limit)


class _Rec:
    """A fetched record on its way to the application."""

    __slots__ = ("body", "deadline", "due", "headers", "hops", "id", "key", "n", "offset",
                 "published_at", "since", "topic", "tp")

    def __init__(self, tp: TopicPartition, offset: int) -> None:
        self.tp = tp
        self.offset = offset
        self.deadline = 0.0
        self.since = 0.0
        self.due = 0.0
        self.hops = 0


def _slot(tp: TopicPartition, slots: int) -> int:
    """The retry partition ("slot") whose owner in the group also reads data partition ``tp``."""
    return (zlib.crc32(tp.topic.encode()) + tp.partition) % max(1, slots)


class _Listener(ConsumerRebalanceListener):
    """kafka-python 3 calls listeners on its IO thread, where blocking consumer calls are
    refused: the listener only records the change; the background threads act on it."""

    def __init__(self, sub: KafkaSubscription) -> None:
        self.sub = sub

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.sub.revoked(revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.sub.assigned(assigned)


class KafkaSubscription(DriverSubscription):
    """One consumer of a group, on two KafkaConsumers owned by two background threads.

    * The *group* consumer is the Kafka consumer-group member. It subscribes to the group's
      retry topic only, a fixed list: the group rebalances when members come and go, never
      because a topic matching the pattern appeared. Its retry partitions are this
      member's *slots*. Its thread does nothing but poll (kafka-python 3.0 abandons a join
      whose SyncGroup answer arrives while no poll is waiting, seen against tansu), take
      new assignments and commit offsets (for the data partitions too: an offset commit
      is checked against the member's generation, not its assignment, on Apache Kafka and
      tansu alike).
    * The *data* consumer has no group: it is assigned, by hand, the partitions of the
      topics matching the pattern whose slot (``_slot``) this member owns, and refreshes
      that list when topics appear, so a new topic is read from its first message without
      a rebalance. Its thread also expires leases, releases delayed records and hands
      idle records to other members.
    """

    def __init__(self, driver: KafkaDriver, spec: GroupSpec, declared_ms: int) -> None:
        self.d = driver
        self.spec = spec
        self.declared_ms = declared_ms
        self.retry = driver.retry_topic(spec.name)
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.commit_lock = threading.Lock()  # one commit built and sent at a time
        self.epoch = 0  # revocations so far (lock held)
        self.moving = 0  # re-publishes between their fence and their settled mark
        self.ckpt_limit = _CKPT_RANGES  # halved if the broker keeps less commit metadata
        self.ready: deque[_Rec] = deque()
        self.held: list[tuple[float, int, _Rec]] = []
        self.leased: dict[int, _Rec] = {}
        self.parts: dict[TopicPartition, _Part] = {}
        self.suspended: dict[TopicPartition, tuple[_Part, list[_Rec]]] = {}
        self.pending: set[TopicPartition] = set()
        self.new_assignment: set[TopicPartition] | None = None
        self.slots: set[int] = set()
        self.slot_version = 0
        self.tokens = itertools.count(1)
        self.seq = itertools.count()
        self.closed = False
        self.stopping = False
        self.group_stopping = False
        self.waiting = 0
        self.last_receive = time.monotonic()
        self.paused = False
        self.assigned_once = threading.Event()
        self.error: BaseException | None = None
        self.data_assigned: set[TopicPartition] = set()
        self.applied_version = -1
        self.topic_version = -1
        self.next_refresh = 0.0
        self.matched: set[str] = set()
        self.partitions: dict[str, set[int]] = {}
        self.names: dict[str, str] = {}  # Kafka topic -> mqabstract topic
        opts = driver.opts
        self.group: Any = None
        try:
            self.slot_count = len(driver.producer.partitions_for(self.retry) or ()) or 1
            self.regex = re.compile(topic_regex(spec.pattern, driver.prefix))
            self.group = KafkaConsumer(
                **driver.common,
                **NO_AUTO_CREATE,
                group_id=spec.name,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=opts["session_timeout_ms"],
                heartbeat_interval_ms=opts["heartbeat_interval_ms"],
                max_poll_interval_ms=opts["max_poll_interval_ms"],
                max_poll_records=1000,
                fetch_max_wait_ms=100,
            )
            _no_auto_create(self.group)
            self.group.subscribe(topics=[self.retry], listener=_Listener(self))
            self._await_retry_metadata(opts["request_timeout_ms"] / 1000)
            self.data = KafkaConsumer(
                **driver.common,
                **NO_AUTO_CREATE,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_poll_records=1000,
                fetch_max_wait_ms=100,
            )
            _no_auto_create(self.data)
        except Exception as exc:
            if self.group is not None:
                with contextlib.suppress(Exception):
                    self.group.close(autocommit=False)
            raise _native(exc, f"cannot join group {spec.name!r}", driver.url) from exc
        self.group_thread = threading.Thread(
            target=self._run_group, name=f"mqa-kafka-g-{spec.name}", daemon=True)
        self.data_thread = threading.Thread(
            target=self._run_data, name=f"mqa-kafka-d-{spec.name}", daemon=True)
        self.group_thread.start()
        self.data_thread.start()
        # Wait for the first assignment so that consumers subscribed one after another
        # settle before they receive (fewer rebalances that take in-flight messages away).
        self.assigned_once.wait(opts["session_timeout_ms"] / 1000 * 3 + 5)
        if self.error is not None:  # e.g. the broker refused the session timeout
            failure = self.error
            self.close()
            raise _native(failure, f"cannot join group {spec.name!r}", driver.url) from failure

    def _await_retry_metadata(self, timeout: float) -> None:
        """Join only once the group consumer knows the retry topic's partitions.

        Apache Kafka creates a topic in the controller first; a broker's metadata may
        miss it for a moment after CreateTopics returned. A leader that joins then assigns
        nothing, and its rejoin for the late metadata hits a kafka-python 3.0 bug: the
        leader's own assignment updates its metadata snapshot while that JoinGroup is in
        flight, so if one ``poll`` times out before SyncGroup answers, ``need_rejoin()``
        turns false and the finished join is never completed (no assignment, no
        heartbeats, the session expires): the member hangs with no slots, for good.
        """
        # After subscribe: the metadata update also refreshes kafka-python's snapshot of
        # the subscribed topics, so the first assignment is not followed by a rebalance.
        deadline = time.monotonic() + timeout
        while not self.group.partitions_for_topic(self.retry):
            if time.monotonic() >= deadline:
                raise KafkaError(f"retry topic {self.retry} not in the broker's metadata")
            time.sleep(0.05)

    # -- group thread ------------------------------------------------------------------------
    def _run_group(self) -> None:
        retry_at = 0.0  # when to position a new assignment again after a failure
        try:
            while not self.group_stopping:
                try:
                    recs = self.group.poll(timeout_ms=200, max_records=1000)
                except Exception as exc:
                    # kafka-python 3.0's poll raises the connection error of a coordinator
                    # lookup made while the broker is down (its metadata refresh fails);
                    # the same consumer works again once the broker is back.
                    if not _transient(exc):
                        raise
                    log.info("kafka: group consumer of %s waits for the broker: %s",
                             self.spec.name, redact(str(exc))[:300])
                    time.sleep(0.2)
                    continue
                self._keep_join_alive()
                if recs:
                    self._ingest(recs)
                if self.new_assignment is not None and time.monotonic() >= retry_at:
                    try:
                        self._take_assignment()
                    except Exception as exc:
                        if not _transient(exc):
                            raise
                        # The broker is restarting: keep polling (heartbeats, the join)
                        # and position the assignment once it answers again.
                        log.info("kafka: assignment of %s not positioned yet: %s",
                                 self.spec.name, redact(str(exc))[:300])
                        retry_at = time.monotonic() + 0.5
                self._commit(sync=False)
        except Exception as exc:
            log.warning("kafka: group consumer of %s stopped: %s", self.spec.name,
                        redact(str(exc)))
            self.error = exc
        finally:
            with contextlib.suppress(Exception):
                self._commit(sync=True)
            with contextlib.suppress(Exception):
                self.group.close(autocommit=False)
            with self.cv:
                self.cv.notify_all()
            self.assigned_once.set()

    def _keep_join_alive(self) -> None:
        """Work around a kafka-python 3.0 bug that leaves a member without partitions.

        A rejoin triggered by a metadata change (not by the coordinator) is driven by
        ``need_rejoin()``, which compares snapshots the leader's own assignment updates
        while its JoinGroup/SyncGroup is in flight. If ``poll`` times out before SyncGroup
        answers (a join round often takes longer than one 200 ms poll on a busy Apache
        Kafka), the next ``poll`` sees nothing to do and the finished join is never
        completed: no assignment, no listener call, no heartbeats; the session expires and
        the member stays without slots, for good. Seen with a single member whose first
        metadata lacked the just-created retry topic. While a join is in flight, keep the
        rejoin flag up so the next ``poll`` awaits it to the end (private attributes of
        kafka-python 3.0; harmless if they change: the guard below just stops acting).
        """
        coordinator = getattr(self.group, "_coordinator", None)
        lock = getattr(coordinator, "_lock", None)
        if lock is None:
            return
        with lock, contextlib.suppress(AttributeError):
            if (coordinator.state == _REBALANCING
                    and coordinator._join_task is not None
                    and not coordinator.rejoin_needed):
                coordinator.request_rejoin()

    # -- checkpoints (offset commits) -------------------------------------------------------
    def _commit(self, sync: bool) -> None:
        """The group thread's commit: asynchronous between polls, synchronous at the end."""
        if sync:
            with contextlib.suppress(MQError):
                self._fence(self.d.opts["request_timeout_ms"] / 1000)
        else:
            self._send_checkpoints(None)

    def _checkpoints(self, force: Collection[TopicPartition]
                     ) -> dict[TopicPartition, OffsetAndMetadata]:
        """The checkpoints that changed since last sent, plus those of ``force``."""
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        with self.lock:
            for tp, part in self.parts.items():
                point, meta = part.checkpoint(self.ckpt_limit)
                if point is None:
                    continue
                if point != part.committed or meta != part.meta or tp in force:
                    offsets[tp] = OffsetAndMetadata(point, meta, -1)
                    part.committed, part.meta = point, meta
        return offsets

    def _schedule(self, force: Collection[TopicPartition]) -> tuple[Any, Any] | None:
        """Send the changed checkpoints (plus those of ``force``) as one asynchronous
        commit; return (future, offsets), or None when there was nothing to send.

        Built and scheduled under ``commit_lock``, which is never held while waiting for
        the network: commits are scheduled in the order their contents were read, and
        kafka-python sends scheduled commits in that order on one connection, so a later
        commit never carries an older mark (a synchronous commit is scheduled only after
        its coordinator check and could overtake). Callable from any thread, including
        the rebalance listener on kafka-python's IO thread.
        """
        coordinator = getattr(self.group, "_coordinator", None)
        # Not commit_async: with the coordinator unknown, it returns the lookup's future.
        send = getattr(coordinator, "_do_commit_offsets_async", None)
        with self.commit_lock:
            offsets = self._checkpoints(force)
            if not offsets:
                return None
            try:
                if send is not None:
                    future = send(offsets, self._committed)
                else:  # pragma: no cover - kafka-python changed
                    future = self.group.commit_async(offsets, callback=self._committed)
            except Exception as exc:
                self._committed(offsets, exc)
                raise
        return future, offsets

    def _send_checkpoints(self, force: Collection[TopicPartition] | None) -> None:
        """Commit changed checkpoints without waiting (a failed one is sent again with the
        next)."""
        try:
            self._schedule(force or ())
        except Exception as exc:
            log.debug("kafka: commit of %s not sent: %s", self.spec.name, exc)

    def _stable(self) -> bool:
        """Whether kafka-python considers the membership stable (it refuses commits
        otherwise)."""
        stable = getattr(getattr(self.group, "_coordinator", None), "generation_if_stable", None)
        return stable is None or stable() is not None

    def _fence(self, budget: float, force: Collection[TopicPartition] = ()) -> None:
        """Commit the checkpoints (changed ones and those of ``force``) and wait for them.

        An offset commit is validated against the member id and generation: when it
        succeeds, this consumer was a current member of the group, so nobody else owns
        these partitions, and whoever takes them over later reads these checkpoints (its
        assignment comes after this commit). It is the proof required before records are
        handed out or re-published: a consumer that was frozen past its session, or lost
        the partitions in a rebalance it has not seen yet, gets ``CommitFailedError`` here.

        Raises ``LeaseExpired`` when membership is lost or a rebalance is under way,
        ``Timeout`` / ``ConnectionFailed`` when the coordinator does not answer in time.
        """
        if not self._stable():
            raise LeaseExpired(f"group {self.spec.name!r} is rebalancing")
        try:
            sent = self._schedule(force)
        except Exception as exc:
            raise _native(exc, f"commit of {self.spec.name!r} failed", self.d.url) from exc
        if sent is None:
            return
        future, _ = sent
        landed = threading.Event()
        future.add_both(lambda _: landed.set())
        if not landed.wait(max(0.05, budget)):
            raise Timeout(f"commit of {self.spec.name!r} not confirmed within {budget:.2f}s")
        exc = future.exception
        if exc is None:
            return
        name = type(exc).__name__
        if name == "OffsetMetadataTooLargeError":
            # offset.metadata.max.bytes below Apache Kafka's default 4096: list fewer
            # settled ranges (the rest is delivered again after a takeover).
            self.ckpt_limit //= 2
        if name in ("CommitFailedError", "RebalanceInProgressError", "UnknownMemberIdError",
                    "IllegalGenerationError", "IllegalStateError"):
            raise LeaseExpired(f"consumer of {self.spec.name!r} is no longer a member of the "
                               f"current generation: {name}") from exc
        raise _native(exc, f"commit of {self.spec.name!r} failed", self.d.url) from exc

    def _committed(self, offsets: Mapping[TopicPartition, Any], error: Any) -> None:
        """A commit failed (e.g. during a rebalance): try again with the next one."""
        if isinstance(error, BaseException):
            with self.lock:
                for tp, oam in offsets.items():
                    part = self.parts.get(tp)
                    if (part is not None and part.committed == oam.offset
                            and part.meta == oam.metadata):
                        part.committed, part.meta = part.confirmed, part.sent_meta
            return
        with self.lock:
            for tp, oam in offsets.items():
                part = self.parts.get(tp) or self.suspended.get(tp, (None, None))[0]
                if part is not None:
                    part.confirmed, part.sent_meta = oam.offset, oam.metadata

    # -- rebalance (group consumer) -------------------------------------------------------
    def revoked(self, revoked: Any) -> None:
        slots = {tp.partition for tp in revoked if tp.topic == self.retry}
        with self.cv:
            # Re-publishes that passed their fence finish first, so that the checkpoint
            # below lists their originals as settled (else the next owner delivers the
            # original with the attempt the copy has). Later ones see the new epoch and
            # write nothing. This blocks kafka-python's IO thread (heartbeats) for at
            # most _MOVING_WAIT; the writes go through the producer, not this consumer.
            self.epoch += 1
            end = time.monotonic() + _MOVING_WAIT
            while self.moving and time.monotonic() < end:
                self.cv.wait(max(0.001, end - time.monotonic()))
            gone = {tp for tp in self.parts
                    if tp in set(revoked)
                    or (tp.topic != self.retry and _slot(tp, self.slot_count) in slots)}
        # Scheduled here, on kafka-python's IO thread: sent before the JoinGroup that
        # follows; if it fails, the next owner re-delivers (attempt + 1).
        log.debug("kafka: %s revoked %s", self.spec.name, sorted(gone))
        self._send_checkpoints(gone)
        with self.cv:
            for tp in gone:
                part = self.parts.pop(tp, None)
                if part is None:
                    continue
                stash = [r for r in self.ready if r.tp == tp]
                stash += [r for _, _, r in self.held if r.tp == tp]
                part.revoked_at = (part.committed, part.meta)
                self.suspended[tp] = (part, stash)
            self.ready = deque(r for r in self.ready if r.tp not in gone)
            self.held = [h for h in self.held if h[2].tp not in gone]
            heapq.heapify(self.held)
            self.slots -= slots
            self.slot_version += 1

    def assigned(self, assigned: Any) -> None:
        # Only bookkeeping here: positions are set by the group thread.
        assigned = set(assigned)
        log.debug("kafka: %s assigned %s", self.spec.name, sorted(assigned))
        if assigned:
            self.group.pause(*assigned)
        with self.lock:
            self.new_assignment = assigned

    def _take_assignment(self) -> None:
        with self.lock:
            assigned, self.new_assignment = self.new_assignment, None
            epoch = self.epoch
        if assigned is None:
            return
        try:
            committed = self.d.committed(self.spec.name, assigned) if assigned else {}
        except Exception:
            with self.lock:  # retried by the group thread unless a newer one came
                if self.new_assignment is None:
                    self.new_assignment = assigned
            raise
        fresh = self._adopt(assigned, committed, self.group, epoch=epoch)
        if fresh is None:
            return  # revoked again meanwhile: the next assignment follows
        for tp in fresh:
            self.group.seek_to_beginning(tp)  # the retry topic belongs to the group
            found = committed.get(tp)
            if found is not None:
                self.group.seek(tp, found.offset)
        if assigned:
            self.group.resume(*assigned)
        with self.cv:
            self._forget_suspended([t for t in self.suspended
                                    if t.topic == self.retry and t not in assigned])
            self.slots = {tp.partition for tp in assigned}
            self.slot_version += 1
            self.cv.notify_all()

    def _forget_suspended(self, tps: Collection[TopicPartition]) -> None:
        """Partitions that went to another member for good (lock held): their leases are
        stale, the new owner redelivers from the committed offset."""
        gone = set(tps)
        for tp in gone:
            self.suspended.pop(tp, None)
        if gone:
            for token, rec in list(self.leased.items()):
                if rec.tp in gone:
                    del self.leased[token]

    def _adopt(self, assigned: Collection[TopicPartition],
               committed: Mapping[TopicPartition, OffsetAndMetadata | None],
               consumer: Any, epoch: int | None = None,
               version: int | None = None) -> list[TopicPartition] | None:
        """Take partitions over: keep our in-flight state where nobody committed since we
        had them (the stored checkpoint is still the one we sent: another owner that handed
        anything out would have committed its own first); return the partitions that need
        a start position. A fresh partition starts from its checkpoint (``_Part``).

        None, adopting nothing, when the assignment is stale: revoked again (``epoch``) or
        the slots changed (``version``) since it was read. Adopting it would make this
        member hand out records of partitions another member owns: the coordinator checks
        commits against the generation, not the assignment."""
        fresh: list[TopicPartition] = []
        with self.cv:
            if ((epoch is not None and epoch != self.epoch)
                    or (version is not None and version != self.slot_version)):
                return None
            now = time.time()
            for tp in assigned:
                found = committed.get(tp)
                stored = (found.offset, found.metadata) if found is not None else (None, None)
                old = self.suspended.pop(tp, None)
                if old is not None and old[0].next_fetch and stored in (
                        old[0].revoked_at, (old[0].confirmed, old[0].sent_meta)):
                    log.debug("kafka: %s takes %s back (checkpoint %s)", self.spec.name,
                              tp, stored)
                    part, stash = old
                    if stored != (part.committed, part.meta):
                        part.committed, part.meta = stored
                    self.parts[tp] = part
                    consumer.seek(tp, part.next_fetch)
                    for rec in stash:
                        if rec.due > now:
                            heapq.heappush(self.held, (rec.due, next(self.seq), rec))
                        else:
                            self.ready.append(rec)
                    continue
                self.parts[tp] = _Part(found)
                log.debug("kafka: %s takes %s over (checkpoint %s)", self.spec.name, tp,
                          stored)
                fresh.append(tp)
            # Leases on partitions that are not ours any more are stale now.
            for token, rec in list(self.leased.items()):
                if rec.tp in fresh:
                    del self.leased[token]
            self.cv.notify_all()
        return fresh

    # -- data thread --------------------------------------------------------------------------
    def _run_data(self) -> None:
        pause = 0.0  # back-off while the broker does not answer
        try:
            while not self.stopping:
                if pause:
                    with self.cv:
                        if not self.stopping:
                            self.cv.wait(pause)
                try:
                    self._refresh_data()
                    self._tick()
                    if not self.data_assigned:
                        wait = min(0.2, self._poll_ms() / 1000)
                        with self.cv:
                            if not self.stopping:
                                self.cv.wait(wait)
                        pause = 0.0
                        continue
                    recs = self.data.poll(timeout_ms=self._poll_ms(), max_records=1000)
                    if recs:
                        self._ingest(recs)
                    pause = 0.0
                except Exception as exc:
                    # A broker restart or outage: retry; the subscription recovers with
                    # the broker (the same object, as the contract requires).
                    if not _transient(exc):
                        raise
                    if not pause:
                        log.info("kafka: consumer of %s waits for the broker: %s",
                                 self.spec.name, redact(str(exc))[:300])
                    pause = min(max(pause * 2, 0.1), 2.0)
        except Exception as exc:
            log.warning("kafka: consumer of %s stopped: %s", self.spec.name, redact(str(exc)))
            self.error = exc
        finally:
            with contextlib.suppress(Exception):
                self.data.close(autocommit=False)
            with self.cv:
                self.cv.notify_all()
            self.assigned_once.set()

    def _refresh_data(self) -> None:
        """Assign the data consumer the matching partitions of our slots.

        Pattern matching is ours (kafka-python 3.0's pattern subscription can hang in
        ``poll`` while it waits for metadata, seen against tansu). The topic list is read
        every ``metadata_max_age_ms``, and at once when this process created a topic.
        """
        now = time.monotonic()
        with self.lock:
            version, slots = self.slot_version, set(self.slots)
        topics_changed = self.d.topic_version != self.topic_version
        if version == self.applied_version and now < self.next_refresh and not topics_changed:
            return
        if now >= self.next_refresh or topics_changed:
            self.topic_version = self.d.topic_version
            self.next_refresh = now + self.d.opts["metadata_max_age_ms"] / 1000
            self.matched = {t for t in self.d.topic_names()
                            if self.regex.match(t) and not t.startswith(INTERNAL)}
        wanted: set[TopicPartition] = set()
        for topic in self.matched:
            parts = self.partitions.get(topic)
            if not parts:
                # The producer's per-topic metadata: no full-cluster metadata request.
                parts = self.partitions[topic] = self.d.producer.partitions_for(topic) or set()
            for p in parts:
                tp = TopicPartition(topic, p)
                if _slot(tp, self.slot_count) in slots:
                    wanted.add(tp)
        new = wanted - self.data_assigned
        with self.lock:
            # A rebalance may revoke and give back a slot between two refreshes (a fast
            # join: one poll of the group thread): its data partitions stay assigned to
            # the data consumer but were suspended (no longer in ``parts``). Adopt them
            # again, or their records are dropped and their leases never expire.
            if version == self.slot_version:
                new |= {tp for tp in wanted & self.data_assigned if tp not in self.parts}
        if wanted != self.data_assigned:
            with self.cv:
                for tp in self.data_assigned - wanted:
                    self.parts.pop(tp, None)
                self.ready = deque(r for r in self.ready
                                   if r.tp.topic == self.retry or r.tp in wanted)
                # Leases on partitions revoked for a rebalance (suspended) stay: the
                # partition may come back with them.
                for token, rec in list(self.leased.items()):
                    if (rec.tp.topic != self.retry and rec.tp not in wanted
                            and rec.tp not in self.suspended):
                        del self.leased[token]
            self.data.assign(sorted(wanted))
            self.data_assigned = wanted
            if self.paused and wanted:
                self.data.pause(*wanted)
        if new:
            try:
                committed = self.d.committed(self.spec.name, new)
                start = []
                for tp in self._adopt(new, committed, self.data, version=version) or ():
                    found = committed.get(tp)
                    if found is not None:
                        self.data.seek(tp, found.offset)
                    else:
                        start.append(tp)
                if start:
                    self._seek_start(start)
            except Exception:
                # Not positioned (broker away): unassign them, so that they are neither
                # read from a wrong offset nor left out; the next refresh tries again.
                with self.cv:
                    for tp in new:
                        self.parts.pop(tp, None)
                    self.ready = deque(r for r in self.ready if r.tp not in new)
                    self.held = [h for h in self.held if h[2].tp not in new]
                    heapq.heapify(self.held)
                self.data_assigned = wanted - new
                self.data.assign(sorted(self.data_assigned))
                raise
        with self.cv:
            # Suspended data partitions that did not come back went to another member.
            if version == self.slot_version and slots:
                self._forget_suspended([t for t in self.suspended
                                        if t.topic != self.retry and t not in wanted])
        self.applied_version = version
        if version > 0 and slots:
            self.assigned_once.set()

    def _seek_start(self, tps: Collection[TopicPartition]) -> None:
        """Where a group starts on partitions it never committed: its declaration time.

        The first record at or after the declaration (``offsets_for_times``). When there
        is none, every record present is older, so the group starts at the end offset
        read *before* that query: a record written in between is not skipped (a lazy
        ``seek_to_end`` would skip it). tansu may report an end that is too low after a
        batched produce, and answers ``offsets_for_times`` with offset 0 / timestamp -1
        instead of no offset: both only make us read older records, which ``_decode``
        drops by timestamp, so this is right on Apache Kafka and on tansu.
        """
        ends = self.data.end_offsets(list(tps))
        found = self.data.offsets_for_times({tp: self.declared_ms for tp in tps})
        for tp in tps:
            hit = found.get(tp)
            if hit is not None and hit.timestamp != _TANSU_NO_TS:
                self.data.seek(tp, hit.offset)
            else:
                self.data.seek(tp, ends.get(tp, 0))

    def _poll_ms(self) -> int:
        """Sleep in poll until the next due record, lease end or hand-off check."""
        now = time.time()
        wake = now + 0.2
        with self.lock:
            if self.held:
                wake = min(wake, self.held[0][0])
            for rec in self.leased.values():
                # (an expired lease on a suspended partition waits for the assignment)
                wake = min(wake, max(rec.deadline, now + 0.05))
            if self.ready and not self.waiting:
                wake = min(wake, now + self.d.opts["handoff_ms"] / 2000)
        return int(max(0.005, wake - now) * 1000)

    def _tick(self) -> None:
        now = time.time()
        expired: list[_Rec] = []
        handoff: list[_Rec] = []
        with self.cv:
            for token, rec in list(self.leased.items()):
                if rec.deadline <= now:
                    if rec.tp in self.parts:
                        del self.leased[token]
                        expired.append(rec)
                    elif rec.tp not in self.suspended:
                        del self.leased[token]  # the partition moved: its owner redelivers
                    # else: revoked for a rebalance; decided when the assignment settles
            released = False
            while self.held and self.held[0][0] <= now:
                _, _, rec = heapq.heappop(self.held)
                if rec.tp in self.parts:
                    rec.since = time.monotonic()
                    self.ready.append(rec)
                    released = True
            if released:
                self.cv.notify_all()
            handoff = self._pick_handoff()
            for rec in handoff:
                part = self.parts.get(rec.tp)
                if part is not None and rec.offset + 1 > part.mark:
                    # Counted as handed out: if we die before the original is committed
                    # done, its next owner gives it an attempt above the copy's.
                    part.mark = rec.offset + 1
            buffered = len(self.ready) + len(self.held)
        if expired or handoff:
            expired, handoff = self._fence_tick(expired, handoff)
        if expired or handoff:
            try:
                self._move(expired, handoff)
            finally:
                self._end_move()
            self._send_checkpoints(None)  # the originals are done: a takeover skips them
        limit = self.d.opts["max_buffered"]
        if buffered > limit and not self.paused and self.data_assigned:
            self.data.pause(*self.data_assigned)
            self.paused = True
        elif buffered <= limit // 2 and self.paused:
            self.data.resume(*self.data.paused())
            self.paused = False

    def _fence_tick(self, expired: list[_Rec], handoff: list[_Rec]
                    ) -> tuple[list[_Rec], list[_Rec]]:
        """Before re-publishing expired leases or handing records off: ``_fence``. A
        consumer woken from a freeze longer than its session still has its old leases and
        buffers; its partitions' new owner redelivers those records from the checkpoint,
        so a copy written here would repeat an attempt. On failure nothing is written: the
        leases are kept (tried again shortly, or dropped when the partition turns out to
        have moved) and the hand-offs go back to the ready queue."""
        budget = min(max(0.5, self.spec.lease / 4), self.d.opts["request_timeout_ms"] / 1000)
        with self.lock:
            epoch = self.epoch
        try:
            self._fence(budget, force={rec.tp for rec in (*expired, *handoff)})
            if not self._begin_move(epoch):
                raise LeaseExpired("a rebalance began")
        except MQError as exc:
            log.info("kafka: %d records of %s not re-published: %s",
                     len(expired) + len(handoff), self.spec.name, redact(str(exc))[:300])
            with self.cv:
                retry_at = time.time() + 0.5
                for rec in expired:
                    if rec.tp in self.parts or rec.tp in self.suspended:
                        rec.deadline = retry_at
                        self.leased[next(self.tokens)] = rec
                mono = time.monotonic()
                for rec in reversed(handoff):
                    if rec.tp in self.parts:
                        rec.since = mono
                        self.ready.appendleft(rec)
                self.cv.notify_all()
            return [], []
        return expired, handoff

    def _begin_move(self, epoch: int) -> bool:
        """After a successful ``_fence``: count a re-publish in flight, unless a revocation
        began since ``epoch`` (then write nothing). ``revoked`` waits for those counted."""
        with self.cv:
            if self.epoch != epoch:
                return False
            self.moving += 1
            return True

    def _end_move(self) -> None:
        with self.cv:
            self.moving -= 1
            self.cv.notify_all()

    def _move(self, expired: list[_Rec], handoff: list[_Rec]) -> None:
        for rec in expired:  # the lease ran out: redeliver with attempt + 1
            try:
                self._requeue(rec, rec.n + 1, 0.0, avoid_self=True)
            except MQError:
                self._relapse(rec, None, time.time() + 1.0)  # the next tick tries again
        for rec in handoff:
            try:
                self._requeue(rec, rec.n, 0.0, avoid_self=True, hop=True)
            except MQError:
                with self.cv:  # stays here, ready again
                    rec.n += 1  # the write may have landed: never the same attempt twice
                    if rec.tp in self.parts:
                        rec.since = time.monotonic()
                        self.ready.append(rec)
                        self.cv.notify_all()

    def _pick_handoff(self) -> list[_Rec]:
        """Ready records nobody here asks for go to another consumer of the group.

        A Kafka partition belongs to one consumer; if that consumer stops receiving (busy,
        hung), its fetched records would wait. After ``handoff_ms`` without a receive they
        are re-published to a retry partition owned by another member (back-off doubles
        per hop, so idle groups do not ping-pong).
        """
        if not self.ready or self.waiting or not self._other_retry_partitions():
            return []
        now = time.monotonic()
        base = self.d.opts["handoff_ms"] / 1000
        if now - self.last_receive < base:
            return []
        out = [r for r in self.ready if now - r.since >= base * (2 ** min(r.hops, 6))]
        if out:
            ids = {id(r) for r in out}
            self.ready = deque(r for r in self.ready if id(r) not in ids)
        return out

    def _other_retry_partitions(self) -> list[int]:
        parts = self.d.producer.partitions_for(self.retry) or set()
        mine = {tp.partition for tp in self.parts if tp.topic == self.retry}
        return sorted(set(parts) - mine)

    def _ingest(self, batches: Mapping[TopicPartition, list[Any]]) -> None:
        now = time.time()
        mono = time.monotonic()
        added = False
        with self.cv:
            for tp, records in batches.items():
                part = self.parts.get(tp)
                if part is None or tp in self.pending:
                    continue  # a pending partition is positioned, then fetched again
                retry = tp.topic == self.retry
                inherited = part.inherited
                for r in records:
                    part.fetched(r.offset)
                    if r.offset < inherited and r.offset in part.done:
                        continue  # settled by an earlier owner (its checkpoint says so)
                    rec = self._decode(tp, r, retry)
                    if rec is None:
                        part.done.add(r.offset)
                        continue
                    if r.offset < inherited:
                        # Handed to an application by owners that died, froze or lost the
                        # partition before settling it: one attempt more than any of them
                        # gave, and not before the last of their leases ends.
                        rec.n += part.bump
                        rec.due = max(rec.due, min(part.hold, now + self.d.capabilities.max_lease))
                    if rec.due > now:
                        heapq.heappush(self.held, (rec.due, next(self.seq), rec))
                    else:
                        rec.since = mono
                        self.ready.append(rec)
                        added = True
            if added:
                self.cv.notify_all()

    def _decode(self, tp: TopicPartition, r: Any, retry: bool) -> _Rec | None:
        headers: dict[str, str] = {}
        meta: dict[str, str] = {}
        for k, v in r.headers or ():
            if k.startswith(wire.PREFIX):
                meta[k] = v.decode("utf-8", "replace") if v else ""
            else:
                headers[k] = v.decode("utf-8", "replace") if v else ""
        if retry:
            topic = meta.get(H_TOPIC, "")
        else:
            if r.timestamp < self.declared_ms:
                # Published before the group existed. Also what makes a too-low start
                # offset harmless (tansu's end offsets after batched produce).
                return None
            if tp.topic.startswith(HASHED):
                topic = meta.get(H_TOPIC, "")
                if not topic or not topic_matches(self.spec.pattern, topic):
                    return None
            else:
                topic = self.names.get(tp.topic)
                if topic is None:
                    topic = self.names[tp.topic] = _unescape(tp.topic[len(self.d.prefix):])
        rec = _Rec(tp, r.offset)
        rec.topic = topic
        rec.body = r.value if r.value is not None else b""
        rec.headers = headers
        rec.key = (meta.get(H_KEY) if retry else
                   r.key.decode("utf-8", "replace") if r.key is not None else None)
        if retry and rec.key is None and r.key is not None:
            rec.key = r.key.decode("utf-8", "replace")
        rec.id = meta.get(H_ID) or f"{tp.topic}-{tp.partition}-{r.offset}"
        try:
            rec.published_at = float(meta[H_TS]) if H_TS in meta else r.timestamp / 1000
            rec.n = int(meta.get(H_N, "0"))
            rec.due = float(meta[H_DUE]) if H_DUE in meta else 0.0
            rec.hops = int(meta.get(H_HOPS, "0"))
        except ValueError:
            rec.published_at, rec.n, rec.due = r.timestamp / 1000, 0, 0.0
        return rec

    # -- application side ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise Closed(f"subscription to group {self.spec.name!r} is closed")
        if self.error is not None:
            raise _native(self.error, f"consumer of {self.spec.name!r} failed", self.d.url)

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Hand out ready records, after a fenced commit of their partitions' checkpoints.

        The commit (``_fence``) stores the new delivery mark and lease deadline and the
        acks so far, and succeeds only while this consumer is a current member of the
        group: a consumer woken from a freeze longer than its session, or one that lost the
        partitions in a rebalance it has not seen yet, hands out nothing from its buffers
        (they go back, and are dropped when the revocation arrives). Bounded by a quarter
        lease: the portable layer's lease clock started at the call.
        """
        started = time.monotonic()
        deadline = started + timeout
        while True:
            picked: list[tuple[int, _Rec]] = []
            with self.cv:
                self._check_open()
                self.waiting += 1
                try:
                    while not self.ready:
                        left = deadline - time.monotonic()
                        if left <= 0 or self.closed or self.error is not None:
                            break
                        self.cv.wait(left)
                    lease_until = time.time() + self.spec.lease
                    while self.ready and len(picked) < max_messages:
                        rec = self.ready.popleft()
                        part = self.parts.get(rec.tp)
                        if part is None:
                            continue
                        token = next(self.tokens)
                        rec.deadline = lease_until
                        self.leased[token] = rec
                        if rec.offset + 1 > part.mark:
                            part.mark = rec.offset + 1
                        if lease_until > part.deadline:
                            part.deadline = lease_until
                        picked.append((token, rec))
                finally:
                    self.waiting -= 1
                    self.last_receive = time.monotonic()
            if not picked:
                return []
            budget = min(max(self.spec.lease / 4, 0.25), self.d.opts["request_timeout_ms"] / 1000)
            try:
                self._fence(budget, force={rec.tp for _, rec in picked})
                if time.monotonic() - started > self.spec.lease * 3 / 4:
                    # Frozen (or stalled) before or after the fence: the lease, counted by
                    # the portable layer from the call, is (nearly) over and the partition
                    # may have a new owner already. Hand nothing out (the records are
                    # covered by the mark just committed: attempt + 1 when delivered);
                    # the portable layer's next call starts a lease of its own.
                    deadline = 0.0
                    raise LeaseExpired("the receive call outlived 3/4 of the lease")
            except MQError as exc:
                log.info("kafka: %d records of %s not handed out: %s", len(picked),
                         self.spec.name, redact(str(exc))[:300])
                with self.cv:
                    back = []
                    for token, rec in picked:
                        self.leased.pop(token, None)
                        if rec.tp in self.parts:
                            back.append(rec)
                        elif rec.tp in self.suspended:
                            self.suspended[rec.tp][1].append(rec)
                    self.ready.extendleft(reversed(back))
                    left = deadline - time.monotonic()
                    if left > 0:
                        self.cv.wait(min(0.1, left))
                if time.monotonic() >= deadline:
                    return []
                continue
            return [Delivery(rec.id, rec.topic, rec.body, rec.headers, rec.key, 0, rec.n + 1,
                             rec.published_at, token) for token, rec in picked]

    def _fence_for(self, rec: _Rec, move: bool = True) -> None:
        """``_fence`` before a settle re-publishes ``rec`` (nack, dead letter: ``move``,
        then ``_end_move`` after the write) or extends its lease: wait out a rebalance
        within the lease; ``LeaseExpired`` when the partition is not ours any more."""
        end = time.monotonic() + min(max(0.5, rec.deadline - time.time()),
                                     self.d.opts["request_timeout_ms"] / 1000)
        while True:
            with self.lock:
                owned = rec.tp in self.parts
                suspended = rec.tp in self.suspended
                epoch = self.epoch
            if not owned and not suspended:
                raise LeaseExpired(f"message {rec.id}: its partition moved to another "
                                   "consumer of the group")
            left = end - time.monotonic()
            if owned and self._stable():  # (kafka-python's lock: not under ours)
                self._fence(max(0.05, left), force={rec.tp})
                if not move or self._begin_move(epoch):
                    return
                continue  # a revocation began: wait for the assignment
            if left <= 0:
                raise LeaseExpired(f"message {rec.id}: group {self.spec.name!r} is "
                                   "rebalancing")
            with self.cv:
                self.cv.wait(min(0.05, left))

    def _settle(self, token: Any) -> _Rec | None:
        with self.lock:
            return self.leased.pop(token, None)

    def _done(self, rec: _Rec) -> None:
        with self.lock:
            part = self.parts.get(rec.tp)
            if part is None:
                part = self.suspended.get(rec.tp, (None, None))[0]
            if part is not None:
                part.done.add(rec.offset)

    def ack(self, receipts: Sequence[Any]) -> None:
        with self.lock:
            for token in receipts:
                rec = self.leased.pop(token, None)
                if rec is None:
                    continue  # stale: the lease expired or the partition moved
                part = self.parts.get(rec.tp) or self.suspended.get(rec.tp, (None, None))[0]
                if part is not None:
                    part.done.add(rec.offset)

    def _relapse(self, rec: _Rec, token: Any, deadline: float) -> None:
        """A re-publish or dead-letter write of a settled record failed (broker away):
        lease it again, so that it is retried when the lease runs out (or by the caller
        with the same receipt) instead of waiting for a rebalance. The failed write may
        have landed all the same, so the next one counts one more delivery: attempts may
        skip a number, never repeat."""
        with self.cv:
            rec.n += 1
            if rec.tp in self.parts or rec.tp in self.suspended:
                rec.deadline = deadline
                self.leased[token if token is not None else next(self.tokens)] = rec

    def _keep(self, rec: _Rec, token: Any) -> None:
        """A settle that was refused before anything was written (``_fence_for`` failed):
        the record stays leased under its receipt; when the lease runs out it is
        re-published (if the partition is still ours) or left to the new owner."""
        with self.cv:
            if rec.tp in self.parts or rec.tp in self.suspended:
                self.leased[token] = rec

    def nack(self, receipt: Any, delay: float) -> None:
        rec = self._settle(receipt)
        if rec is None:
            return
        try:
            # A consumer woken from a freeze (or that lost the partition) must not write a
            # copy: the partition's new owner delivers the original with the same attempt.
            self._fence_for(rec)
        except MQError:
            self._keep(rec, receipt)
            raise
        try:
            self._requeue(rec, rec.n + 1, delay)
        except MQError:
            self._relapse(rec, receipt, rec.deadline)
            raise
        finally:
            self._end_move()
        self._send_checkpoints(None)  # the original is done: a takeover skips it

    def extend(self, receipt: Any, seconds: float) -> None:
        """Renew a lease. A longer deadline than the partition's checkpoint records is
        committed (fenced) first: a new owner of the partition (after a freeze or a
        rebalance) holds the record until then. On failure the lease is not renewed."""
        until = time.time() + seconds
        with self.lock:
            rec = self.leased.get(receipt)
            if rec is None:
                return  # stale: the lease expired or the partition moved
            part = self.parts.get(rec.tp)
            if part is not None and part.deadline >= until:
                rec.deadline = until
                return
            if part is not None:
                part.deadline = until
        self._fence_for(rec, move=False)
        with self.lock:
            if self.leased.get(receipt) is rec:
                rec.deadline = until

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        rec = self._settle(receipt)
        if rec is None:
            return
        headers = [(k, v.encode()) for k, v in rec.headers.items()]
        headers += [
            (H_ID, rec.id.encode()),
            (H_TS, repr(rec.published_at).encode()),
            (H_TOPIC, rec.topic.encode()),
            (H_N, str(attempts).encode()),
            (H_REASON, reason.encode()),
            (H_DEAD_AT, repr(time.time()).encode()),
        ]
        if rec.key is not None:
            headers.append((H_KEY, rec.key.encode()))
        topic = self.d.dead_topic(self.spec.name)
        try:
            self._fence_for(rec)  # as in nack: no copy once the partition is not ours
        except MQError:
            self._keep(rec, receipt)
            raise
        try:
            self.d.send_one(topic, rec.body, uuid.uuid4().hex.encode(), headers)
            self._done(rec)
        except MQError:
            self._relapse(rec, receipt, rec.deadline)
            raise
        finally:
            self._end_move()
        self._send_checkpoints(None)

    def _requeue(self, rec: _Rec, n: int, delay: float, avoid_self: bool = False,
                 hop: bool = False) -> None:
        """Write the record to the group's retry topic, then mark the original done."""
        headers = [(k, v.encode()) for k, v in rec.headers.items()]
        headers += [
            (H_ID, rec.id.encode()),
            (H_TS, repr(rec.published_at).encode()),
            (H_TOPIC, rec.topic.encode()),
            (H_N, str(n).encode()),
            (H_HOPS, str(rec.hops + 1 if hop else 0).encode()),
        ]
        due = time.time() + delay if delay > 0 else rec.due
        if due > time.time():
            headers.append((H_DUE, repr(due).encode()))
        if rec.key is not None:
            headers.append((H_KEY, rec.key.encode()))
        partition = None
        if avoid_self:
            others = self._other_retry_partitions()
            if others:
                partition = random.choice(others)
        try:
            self.d.send_one(self.retry, rec.body,
                            rec.key.encode() if rec.key is not None else None,
                            headers, partition)
        except MQError as exc:
            log.warning("kafka: could not requeue %s (retried): %s", rec.id,
                        redact(str(exc))[:300])
            raise
        self._done(rec)

    def close(self) -> None:
        with self.cv:
            if self.closed:
                return
            self.closed = True
            self.cv.notify_all()
        self.stopping = True
        me = threading.current_thread()
        if self.data_thread is not me:
            self.data_thread.join(30)
        with self.lock:
            # Closing gives unsettled messages back: the next owner of our partitions need
            # not wait for their leases (their attempt still counts, through the mark).
            for part in self.parts.values():
                part.deadline = 0.0
        # The group thread last: its final commit covers what the data thread settled.
        self.group_stopping = True
        if self.group_thread is not me:
            self.group_thread.join(30)
