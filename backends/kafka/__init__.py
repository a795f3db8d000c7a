"""Kafka backend (``kafka://host:9092[,host2:9092]``) on confluent-kafka or kafka-python.

Mapping (details and reasons in ``docs/backends/kafka.md``):

* one Kafka topic per mqabstract topic, created on demand with ``partitions`` partitions;
  ``key`` is the Kafka key, so per-key order is the partition's order;
* a group is a Kafka consumer group whose members subscribe to the group's retry topic
  ``__mqa..r..<group>`` only; each member reads, by manual assignment, the partitions of
  the topics matching the pattern (our regex) that map to the retry partitions it owns
  (``names.slot``), so new topics need no rebalance; dead letters live in
  ``__mqa..d..<group>``;
* the group's declaration time is stored as a committed offset of a shadow group on the
  internal topic ``__mqa..groups`` (durable, shared between processes);
* per-message ack on top of offsets: only the contiguous acked prefix of each partition is
  committed; auto-commit is off;
* the lease rule across freezes and crashes: each offset commit carries the partition's
  checkpoint as metadata (``state.Checkpoint``). The coordinator validates commits against
  member id and generation, so records are handed out, and anything re-published, only
  after such a commit succeeded (a consumer woken from a freeze past its session writes
  nothing); a new owner holds inherited records until the recorded deadline and delivers
  them with a higher attempt than any earlier owner gave;
* nack, lease expiry, delay and replay re-publish the message to the group's retry topic
  with its due time and delivery count in headers (the wire schema); a background thread
  per consumer holds records that are not due yet and hands them out when they are.

Layout: ``client`` (the client surface, and the choice ``?client=confluent|kafka-python``,
default the fastest installed), ``kp`` and ``ck*`` (its two implementations), ``errors``,
``names`` (topic mapping, slots), ``state`` (checkpoints), ``cluster`` (clients, topics,
offsets, writes), ``driver``, ``subscription`` (a consumer: ``sub_state`` fields shared by
``sub_member``, ``sub_reader`` and ``sub_app``; see ``docs/architecture.md``).
"""

from __future__ import annotations

from .driver import KafkaDriver
from .names import kafka_topic_name, topic_regex
from .subscription import KafkaSubscription

__all__ = ["KafkaDriver", "KafkaSubscription", "kafka_topic_name", "topic_regex"]
