"""A subscription: one consumer of a group, on a group member and a group-less reader."""

from __future__ import annotations

import re
import threading

from mqabstract.model import GroupSpec

from .cluster import KafkaCluster
from .errors import native
from .names import topic_regex
from .sub_app import ApplicationSide
from .sub_reader import DataReader
from .sub_state import HELD_FACTOR

__all__ = ["HELD_FACTOR", "KafkaSubscription"]


class KafkaSubscription(ApplicationSide, DataReader):
    """One consumer of a group, on two consumers owned by two background threads.

    * The *group* consumer (``Member``) is the Kafka consumer-group member. It subscribes
      to the group's retry topic only, a fixed list: the group rebalances when members
      come and go, never because a topic matching the pattern appeared. Its retry
      partitions are this member's *slots*. Its thread does nothing but poll (keeping the
      membership), take new assignments and commit offsets (for the data partitions too:
      an offset commit is checked against the member's generation, not its assignment, on
      Apache Kafka and tansu alike).
    * The *data* consumer has no group: it is assigned, by hand, the partitions of the
      topics matching the pattern whose slot (``names.slot``) this member owns, and refreshes
      that list when topics appear, so a new topic is read from its first message without
      a rebalance. Its thread also expires leases, releases delayed records and hands
      idle records to other members.

    Threads: the application calls receive/settles from any thread; ``lock`` guards the
    shared state (``SubscriptionState``); ``commit_lock`` orders commits. Settles that
    write (nack, dead letter, lease expiry) are fenced by a commit first (``_fence``) and
    retried by the caller.

    Made of three classes over that state, one per side: ``GroupMember`` (``sub_member``),
    ``DataReader`` (``sub_reader``), ``ApplicationSide`` (``sub_app``); this one only
    starts the consumers and their threads.
    """

    def __init__(self, driver: KafkaCluster, spec: GroupSpec, declared_ms: int) -> None:
        super().__init__(driver, spec, declared_ms)
        opts = driver.opts
        try:
            self.slot_count = len(driver.partitions_for(self.retry)) or 1
            self.regex = re.compile(topic_regex(spec.pattern, driver.prefix))
            self.group = driver.client.member(driver.settings, spec.name, self.retry,
                                              self.revoked, self.assigned)
            self.group.await_metadata(opts["request_timeout_ms"] / 1000)
            self.data = driver.client.reader(driver.settings)
        except Exception as exc:
            for consumer in (self.group, self.data):
                if consumer is not None:
                    consumer.close()
            raise native(exc, f"cannot join group {spec.name!r}", driver.url) from exc
        self.group_thread = threading.Thread(
            target=self._run_group, name=f"mqa-kafka-g-{spec.name}", daemon=True)
        self.data_thread = threading.Thread(
            target=self._run_data, name=f"mqa-kafka-d-{spec.name}", daemon=True)
        self.group_thread.start()
        self.data_thread.start()
        threading.Thread(target=self.warm_mover, name=f"mqa-kafka-txn-{spec.name}",
                         daemon=True).start()
        # Wait for the first assignment so that consumers subscribed one after another
        # settle before they receive (fewer rebalances that take in-flight messages away).
        self.assigned_once.wait(opts["session_timeout_ms"] / 1000 * 3 + 5)
        if self.error is not None:  # e.g. the broker refused the session timeout
            failure = self.error
            self.close()
            raise native(failure, f"cannot join group {spec.name!r}", driver.url) from failure
