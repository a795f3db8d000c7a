"""The Kafka driver: options and capabilities, publishing, groups' registry, dead letters
and stats, over the cluster connection it shares with its subscriptions (``cluster``)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from mqabstract import wire
from mqabstract.capabilities import Capabilities, Feature, Support
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.emulation import dead_letter_from, pick, replay_headers
from mqabstract.errors import InvalidArgument, NotFound
from mqabstract.model import Columns, DeadLetter, Envelope, GroupSpec, GroupStats
from mqabstract.options import Option, parse_options
from mqabstract.url import BrokerURL

from . import client as _client
from .client import TP, Client, ClientError, Fetched, Outgoing
from .cluster import AUTO, BROKER_DEFAULT, KafkaCluster, replication_plan
from .errors import native
from .names import (
    HASHED,
    INTERNAL,
    REGISTRY,
    declared_key,
    topic_regex,
    unescape,
)
from .subscription import KafkaSubscription

__all__ = ["AUTO", "BROKER_DEFAULT", "KafkaDriver", "native", "replication_plan"]

log = logging.getLogger("mqabstract.kafka")

#: Seconds between a frozen or dead member's eviction (its session after its last heartbeat)
#: and the first delivery by the partitions' new owner: the join, positioning, a fetch.
#: Measured up to 0.6 s after the session on a loaded two-core machine; 2.5 s of headroom.
RELEASE_SLACK = 2.5

#: Commit metadata of a group's declaration (the shadow group's offset on ``REGISTRY``):
#: this prefix, then the group's pattern (which ``stats`` needs to find its topics).
PATTERN_META = "mqp1 "

#: librdkafka's upper bound of queued.max.messages.kbytes.
PREFETCH_KBYTES_MAX = 2_097_151




def survives(replication_factor: int, min_insync_replicas: int) -> str:
    """``Capabilities.confirmed_survives`` for these options (acks=all, idempotent)."""
    if (replication_factor, min_insync_replicas) == (AUTO, AUTO):
        return ("the loss of any one broker once the cluster has three or more (its topics "
                "get 3 replicas, min.insync.replicas 2: a publish is confirmed when two "
                "brokers have it, and goes on while one is down); on two brokers a "
                "confirmed record may be on one only, on one broker it is that broker's "
                "disk. Written to the brokers' page cache, not fsynced: a power loss of "
                "every replica at once can lose the newest")
    isr = min_insync_replicas
    if isr == AUTO and replication_factor > 0:
        isr = replication_plan(replication_factor, replication_factor)[1] or isr
    if isr > 1:
        return (f"the loss of {isr - 1} broker(s) holding it: a publish is confirmed when "
                f"{isr} in-sync replicas have it (min.insync.replicas); written to the "
                "page cache, not fsynced")
    return ("what the topics' replication and min.insync.replicas allow (set by the "
            "options or the broker's defaults, not chosen by the driver): with one "
            "in-sync replica, a confirmed record may be on one broker only")


def _record(env: Envelope, name: str) -> Outgoing:
    """An envelope as a record of Kafka topic ``name``: only what the wire schema needs.
    The headers are ``wire.encode``'s without ``mq-published-at``, built here as bytes pairs
    (through ``wire.encode`` a batch publishes measurably slower): the publish time is the
    record's timestamp (ms), Kafka's own field for it (docs/decisions.md, "Kafka's wire")."""
    headers = [(k, v.encode()) for k, v in env.headers.items()] if env.headers else []
    headers.append((wire.ID, env.id.encode()))
    if env.deliver_at is not None:
        headers.append((wire.DELIVER_AT, wire.value(env.deliver_at).encode()))
    if name.startswith(HASHED):
        headers.append((wire.TOPIC, env.topic.encode()))
    return Outgoing(name, env.body, env.key.encode() if env.key is not None else None,
                    headers, None, int(env.published_at * 1000))


class KafkaDriver(KafkaCluster, Driver):
    """Kafka through confluent-kafka or kafka-python: topics, partitions, consumer groups,
    emulated leases. The logic is written once over ``client.py``."""

    name: ClassVar[str] = "kafka"

    OPTIONS: ClassVar[dict[str, Option]] = {
        "client": Option(str, "auto", "confluent, kafka-python, or auto: the fastest installed"),
        "partitions": Option(int, 4, "partitions of topics this driver creates", min=1),
        "replication_factor": Option(int, AUTO, "replication of created topics (0: "
                                     "min(3, brokers); -1: the broker's default)",
                                     min=BROKER_DEFAULT),
        "min_insync_replicas": Option(int, AUTO, "min.insync.replicas of created topics (0: "
                                      "replication - 1, between 1 and 2; -1: the broker's "
                                      "default); with acks=all, a publish is confirmed once "
                                      "that many replicas have it", min=BROKER_DEFAULT),
        "topic_prefix": Option(str, "", "prefix of every mapped topic name"),
        # Apache Kafka refuses sessions below group.min.session.timeout.ms (6000 by default).
        "session_timeout_ms": Option(int, 6000, "consumer session (broker: 6000 or more)",
                                     min=1),
        "heartbeat_interval_ms": Option(int, 1000, "consumer heartbeat (< session / 3)",
                                        min=1),
        "max_poll_interval_ms": Option(int, 30000, "rebalance timeout of the group", min=1),
        "metadata_max_age_ms": Option(int, 1000, "how soon new topics reach pattern groups",
                                      min=0),
        "request_timeout_ms": Option(int, 15000, "per request", min=1),
        "connect_timeout": Option(float, 10.0, "seconds to reach the cluster at open",
                                  above=0),
        "linger_ms": Option(int, 2, "producer batching delay", min=0),
        "fetch_max_wait_ms": Option(int, 100, "longest a fetch waits for new records", min=0),
        "handoff_ms": Option(int, 500, "idle consumer hands ready messages to the group",
                             min=0),
        "max_buffered": Option(int, 20000, "records waiting for receive before a consumer "
                               "stops polling for more (delayed ones: 10x)", min=1),
        "prefetch_kbytes": Option(int, 16384, "what librdkafka reads ahead per consumer, KiB "
                                  "(queued.max.messages.kbytes; confluent-kafka only)",
                                  min=1, max=PREFETCH_KBYTES_MAX),
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
            Feature.ORDERING: Support.EMULATED,
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
        max_ttl=6 * 86400.0,  # records live for the topics' retention (7 days by default)
        max_batch=10_000,
        max_priority=0,
        max_receive=1000,
        min_lease=1.0,  # a lease that runs out is a re-publish to the retry topic
        # A frozen or killed member is evicted one session (6 s) after its last heartbeat,
        # so at most one session after its lease deadline; its partitions' new owner
        # delivers after a join (measured: at most 6.1 s after the deadline,
        # docs/backends/kafka.md). The instance value follows session_timeout_ms.
        release_margin=RELEASE_SLACK + 6.0,
        max_consumers_per_group=4,  # the default ``partitions``
        # Ready, leased and delayed records live in the consumers' processes; lag is the
        # committed offsets against the end offsets (as Kafka tools report it).
        stats={"dead": "exact", "lag": "exact"},
        notes={
            Feature.ORDERING: "a key's records are in its partition's order; one at a time "
            "is the portable layer's gate, and a nacked or expired record of an ordered "
            "group is re-published to a retry partition of the same member",
            Feature.PRIORITY: "a Kafka partition is an ordered log; ordering a group's "
            "partitions by priority would only reorder what one consumer has fetched",
        },
    )

    def __init__(self, url: BrokerURL, opts: dict[str, Any]) -> None:
        try:
            client: Client = _client.load(opts["client"])
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        except ImportError as exc:
            raise InvalidArgument(f"Kafka client {opts['client']!r} is not installed: "
                                  f"{exc}") from exc
        if opts["replication_factor"] > 0:
            try:
                replication_plan(opts["replication_factor"], opts["replication_factor"],
                                 opts["min_insync_replicas"])
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
        super().__init__(url, opts, client)
        self._declared: dict[str, int] = {}
        self._patterns: dict[str, str] = {}
        # Instance refinements: competing consumers are bounded by the partitions this
        # driver creates (retry topics included, whose partitions are the slots); the
        # release margin follows the session.
        self._caps = replace(self.CAPABILITIES, max_consumers_per_group=self.partitions,
                             release_margin=opts["session_timeout_ms"] / 1000 + RELEASE_SLACK,
                             confirmed_survives=survives(opts["replication_factor"],
                                                         opts["min_insync_replicas"]))

    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> KafkaDriver:
        return cls(url, parse_options(url, options, cls.OPTIONS, cls.name))

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    # -- publishing ----------------------------------------------------------------------------
    def publish(self, envelopes: Sequence[Envelope]) -> None:
        """One record per envelope (``_record``), written and waited for at once."""
        self._check()
        records = [_record(env, self.topic(env.topic)) for env in envelopes]
        self.ensure_topics({r.topic for r in records})
        self.send(records, [e.id for e in envelopes])

    def publish_columns(self, columns: Columns) -> None:
        """The column path: the wire-schema headers every row shares are built once, then
        each row is one ``produce`` (librdkafka) with its id header added; the publish
        time is the records' timestamp, as in ``publish``."""
        self._check()
        name = self.topic(columns.topic)
        self.ensure_topics({name})
        base = [(k, v.encode()) for k, v in columns.headers.items()]
        if name.startswith(HASHED):
            base.append((wire.TOPIC, columns.topic.encode()))
        rows = None if columns.row_headers is None else [
            [(k, v.encode()) for k, v in own.items()] if own else None
            for own in columns.row_headers]
        keys = None if columns.keys is None else [
            k.encode() if k is not None else None for k in columns.keys]
        timeout = self.opts["request_timeout_ms"] / 1000 * 2
        try:
            results = self.producer.send_rows(name, columns.bodies, keys, columns.ids, base,
                                              rows, int(columns.published_at * 1000), timeout)
        except Exception as exc:  # the producer could not be made: nothing was sent
            raise native(exc, "publish failed", self.url) from exc
        self._confirmed(results, columns.ids)

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
        self.declared_ms(spec.name, create=True, pattern=spec.pattern)

    def declared_ms(self, group: str, create: bool = False,
                    pattern: str | None = None) -> int | None:
        """When the group was declared (epoch ms), stored as a committed offset on the
        registry topic: durable, visible to every process, no extra topic per group.

        It is committed by a shadow group ``<group>..mqa-declared`` that never has members:
        Apache Kafka refuses an admin offset commit for a group with active members
        (UNKNOWN_MEMBER_ID), so writing it as the group's own offset fails when another
        process's consumer is already in the group. Groups declared by older versions have
        it as the group's own offset: read there when the shadow has none.

        The commit's metadata carries the group's pattern (``PATTERN_META``; ``stats``
        finds the group's topics with it). With ``create`` and a ``pattern``, a
        declaration without it (older versions) or with another pattern (the group was
        declared again on a new one) is written again, keeping its time.
        """
        if group in self._declared and (pattern is None or self._patterns.get(group) == pattern):
            return self._declared[group]
        value, stored = self._declaration(group)
        if create and (value is None or (pattern is not None and stored != pattern)):
            if value is None:
                value = int(time.time() * 1000)
            meta = PATTERN_META + pattern if pattern is not None else ""
            key = declared_key(group)
            try:
                self.call(self.admin.set_group_offsets, key, {TP(REGISTRY, 0): (value, meta)},
                          groups=(key,))
            except Exception as exc:
                raise native(exc, f"cannot declare group {group!r}", self.url) from exc
            stored = pattern
        if value is not None:
            self._declared[group] = value
        if stored is not None:
            self._patterns[group] = stored
        return value

    def _declaration(self, group: str) -> tuple[int | None, str | None]:
        """The group's stored declaration: (time in epoch ms, pattern); None where none
        (the pattern is None for groups declared by versions that did not store it)."""
        tp = TP(REGISTRY, 0)
        try:
            for name in (declared_key(group), group):
                found = self.call(self.admin.group_offsets, name, [tp], groups=(name,))
                hit = found.get(tp)
                if hit is not None:
                    value, meta = hit
                    pattern = meta[len(PATTERN_META):] if meta.startswith(PATTERN_META) \
                        else None
                    return value, pattern or None
        except Exception as exc:
            raise native(exc, f"cannot read group {group!r}", self.url) from exc
        return None, None

    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        self._check()
        declared = self.declared_ms(spec.name, create=True)
        assert declared is not None
        return KafkaSubscription(self, spec, declared)

    # -- dead letters ----------------------------------------------------------------------------
    def _read_all(self, topic: str) -> list[Fetched]:
        """Every record of a one-partition topic, oldest first, up to its end offset.

        tansu reports a wrong (too low) end offset after a batched produce, so every write
        to dead-letter topics is a one-record batch (``send_one``); right on Apache Kafka.
        """
        reader = None
        try:
            reader = self.client.reader(self.settings)
            tp = TP(topic, 0)
            reader.assign([tp])
            reader.seek({tp: None})
            end = reader.end_offsets([tp])[tp]
            out: list[Fetched] = []
            deadline = time.monotonic() + self.opts["request_timeout_ms"] / 1000
            while reader.position(tp) < end and time.monotonic() < deadline:
                for recs in reader.poll(0.2, 1000).values():
                    out.extend(recs)
            return out
        except Exception as exc:
            raise native(exc, f"cannot read {topic}", self.url) from exc
        finally:
            if reader is not None:
                reader.close()

    def _dead_entries(self, group: str) -> list[Fetched]:
        topic = self.dead_topic(group)
        if topic not in self._known:
            try:
                exists = topic in self.admin.list_topics()
            except Exception as exc:
                raise native(exc, "cannot list topics", self.url) from exc
            if not exists:
                raise NotFound(f"no group {group!r} on {self.url.redacted()}")
            self._known.add(topic)
        live: dict[bytes | None, Fetched] = {}
        for rec in self._read_all(topic):
            if rec.value is None:  # tombstone: purged or replayed
                live.pop(rec.key, None)
            else:
                live[rec.key] = rec
        return list(live.values())

    @staticmethod
    def _headers(rec: Fetched) -> dict[str, bytes]:
        return {k: v or b"" for k, v in rec.headers or ()}

    def _dead_letter(self, rec: Fetched) -> DeadLetter:
        headers = self._headers(rec)
        return dead_letter_from(headers, rec.value or b"",
                                published_at=rec.timestamp / 1000)

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        self._check()
        return [self._dead_letter(r) for r in self._dead_entries(group)[:limit]]

    def _pick(self, group: str, ids: Collection[str] | None) -> list[Fetched]:
        return pick(self._dead_entries(group), ids,
                    lambda r: self._headers(r).get(wire.ID, b"").decode("utf-8", "replace"))

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        self._check()
        picked = self._pick(group, ids)
        retry = self.retry_topic(group)
        self.ensure_topics([retry])
        for rec in picked:
            headers = replay_headers(self._headers(rec))
            key = headers.pop(wire.KEY, None)
            headers.pop(wire.HOPS, None)
            headers[wire.ATTEMPT] = b"0"
            self.send_one(Outgoing(retry, rec.value, key, list(headers.items())))
            self.send_one(Outgoing(self.dead_topic(group), None, rec.key, []))
        return len(picked)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        # Kafka cannot delete single records (and tansu has no delete_records): a purge
        # writes a tombstone for the entry; the topic is compacted, so Apache Kafka drops
        # both eventually, and readers skip tombstoned entries at once.
        self._check()
        picked = self._pick(group, ids)
        for rec in picked:
            self.send_one(Outgoing(self.dead_topic(group), None, rec.key, []))
        return len(picked)

    def ping(self) -> None:
        """A metadata request (the topic list): one round trip to a broker of the cluster."""
        self._check()
        self.admin.list_topics()

    def stats(self, group: str) -> GroupStats:
        """Dead letters, and the group's lag (``lag``); ready, leased and delayed records
        live in the consumers' processes: None. ``NotFound`` for an undeclared group."""
        self._check()
        dead = len(self._dead_entries(group))
        return GroupStats(group, None, None, None, dead, lag=self._lag(group))

    def _lag(self, group: str) -> int | None:
        """The group's consumer lag: over the partitions it consumes, end offset minus its
        committed offset. Those partitions are its retry topic's and the data partitions of
        the topics matching its pattern (stored with its declaration; None when it was
        declared by a version that did not store it). Where it has committed nothing yet,
        the start is where a subscription starts: the retry topic's beginning; a data
        partition's first record at or after the declaration, else its end.

        As Kafka's tools count it: records settled out of order past the committed offset
        (acked, nacked, dead-lettered while an earlier one is leased) count until the
        offset passes them; a nacked or expired record counts twice until its original
        is committed (the original and its retry copy). Hashed (over-long) topics are
        counted for a pattern without wildcards only: which pattern a hashed topic
        matches is only in its records' headers.
        """
        declared, pattern = self._declaration(group)
        if pattern is None:
            pattern = self._patterns.get(group)
        if pattern is None:
            return None
        if declared is None:
            declared = self._declared.get(group, int(time.time() * 1000))
        retry = self.retry_topic(group)
        words = pattern.split(".")
        wildcard = "*" in words or "#" in words
        regex = re.compile(topic_regex(pattern, self.prefix))
        try:
            names = self.call(self.admin.list_topics) | self._known
        except Exception as exc:
            raise native(exc, "cannot list topics", self.url) from exc
        data = sorted(t for t in names if regex.match(t) and not t.startswith(INTERNAL)
                      and not (wildcard and t.startswith(HASHED)))
        tps: list[TP] = []
        for topic in [retry, *data] if retry in names else data:
            tps.extend(TP(topic, p) for p in sorted(self.partitions_for(topic)))
        if not tps:
            return 0
        committed = self.committed(group, tps)
        fresh = [tp for tp in tps if committed.get(tp) is None]
        reader = None
        try:
            reader = self.client.reader(self.settings)
            # End offsets before the start query, as the subscription reads them.
            ends = self.call(reader.end_offsets, tps)
            starts: dict[TP, int | None] = {}
            for since, part in ((0, [tp for tp in fresh if tp.topic == retry]),
                                (declared, [tp for tp in fresh if tp.topic != retry])):
                if part:
                    starts.update(self.call(reader.offsets_for_times, part, since))
        except Exception as exc:
            raise native(exc, f"cannot read the offsets of group {group!r}", self.url) from exc
        finally:
            if reader is not None:
                reader.close()
        total = 0
        for tp in tps:
            end = ends.get(tp, 0)
            found = committed.get(tp)
            start = found[0] if found is not None else starts.get(tp)
            total += max(0, end - (start if start is not None else end))
        return total

    def groups(self) -> list[str]:
        """The groups whose retry topic exists (``declare`` makes it): its name is the
        group's, escaped; a hashed (over-long) name cannot be read back and is left out."""
        self._check()
        try:
            names = self.call(self.admin.list_topics)
        except Exception as exc:
            raise native(exc, "cannot list topics", self.url) from exc
        head = self.retry_topic("")
        found = (unescape(t[len(head):]) for t in names if t.startswith(head))
        return [g for g in found if self.retry_topic(g) in names]

    def delete_group(self, group: str) -> None:
        self._check()
        topics = [self.retry_topic(group), self.dead_topic(group)]
        admin = self.admin
        for call, args in ((admin.delete_topics, topics),
                           # (..mqa-delivered / ..mqa-takeovers: delivery marks of versions
                           # before the partition checkpoint)
                           (admin.delete_groups, [group, declared_key(group),
                                                  group + "..mqa-delivered",
                                                  group + "..mqa-takeovers"])):
            try:
                call(args)
            except ClientError as exc:
                log.debug("kafka: delete_group %s: %s", group, exc)
        self._known.difference_update(topics)
        self._declared.pop(group, None)
        self._patterns.pop(group, None)
        self.producer.forget(topics)
