"""The admin client on confluent-kafka: topics, the cluster's size, and groups' committed
offsets (read and written through a consumer of the group, see ``_group_consumer``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Collection, Mapping
from typing import Any

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from .ck_base import _config, _error, _native, classify
from .client import TP, Admin, ClientError, Created, Kind, Settings

__all__ = ["_Admin"]


def _result(future: Any, timeout: float) -> Any:
    try:
        return future.result(timeout=timeout)
    except ck.KafkaException as exc:
        raise classify(exc) from exc
    except TimeoutError as exc:
        raise ClientError(Kind.TIMEOUT, "admin request not answered") from exc


def _outcomes(futures: Mapping[str, Any], timeout: float, fine: Collection[str] = ()
              ) -> dict[str, ClientError | None]:
    """Each admin future's outcome: None when it succeeded or failed with an error named in
    ``fine`` (e.g. "already exists" for a create)."""
    out: dict[str, ClientError | None] = {}
    for name, future in futures.items():
        try:
            _result(future, timeout)
            out[name] = None
        except ClientError as err:
            out[name] = None if err.native in fine else err
    return out


class _Admin(Admin):
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.timeout = s.request_timeout_ms / 1000
        self.a = AdminClient(_config(s))
        self.lock = threading.Lock()
        self.groups: collections.OrderedDict[str, tuple[Any, threading.Lock]] = (
            collections.OrderedDict())

    def create_topics(self, names: Collection[str], partitions: int, replication: int,
                      configs: Mapping[str, str]) -> dict[str, Created | ClientError]:
        new = [NewTopic(n, num_partitions=partitions, replication_factor=replication,
                        config=dict(configs)) for n in names]
        try:
            futures = self.a.create_topics(new, operation_timeout=self.timeout,
                                           request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[str, Created | ClientError] = {}
        for name, err in _outcomes(futures, self.timeout + 5).items():
            if err is not None and err.retriable:
                raise err  # the driver retries the whole call
            out[name] = (Created.NEW if err is None else Created.EXISTED
                         if err.native == "TOPIC_ALREADY_EXISTS" else err)
        return out

    def cluster_size(self) -> int:
        # DescribeCluster: the brokers without every topic's metadata (a full listing
        # costs ~0.1 s on a broker with hundreds of topics).
        try:
            future = self.a.describe_cluster(request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        return len(_result(future, self.timeout + 5).nodes)

    def _describe(self, names: Collection[str]) -> dict[str, Any]:
        """DescribeTopics (not a metadata request naming a topic: that may create it): per
        name, its description, or the ``ClientError`` it was answered with."""
        try:
            futures = self.a.describe_topics(ck.TopicCollection(list(names)),
                                             request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[str, Any] = {}
        for name, future in futures.items():
            try:
                out[name] = _result(future, self.timeout + 5)
            except ClientError as err:
                out[name] = err
        return out

    def replication(self, names: Collection[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, desc in self._describe(names).items():
            if isinstance(desc, ClientError):
                if desc.native == "UNKNOWN_TOPIC_OR_PART":
                    continue
                raise desc
            if desc.partitions:
                out[name] = min(len(p.replicas) for p in desc.partitions)
        return out

    def unready(self, names: Collection[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, desc in self._describe(names).items():
            if isinstance(desc, ClientError):
                if desc.native != "UNKNOWN_TOPIC_OR_PART" and desc.kind is not Kind.TRANSIENT:
                    raise desc
                out[name] = desc.native or str(desc)
            elif not desc.partitions:
                out[name] = "no partitions"
            elif any(p.leader is None or p.leader.id < 0 for p in desc.partitions):
                out[name] = "a partition without a leader"
        return out

    def list_topics(self) -> set[str]:
        try:
            return set(self.a.list_topics(timeout=self.timeout).topics)
        except Exception as exc:
            raise classify(exc) from exc

    # Group offsets go through a consumer of the group that never joins it, not through
    # AdminClient: librdkafka 2.16's ListConsumerGroupOffsets crashes the process (SIGSEGV in
    # rd_kafka_cgrp_op, an admin client has no group) when the coordinator answers with an
    # error, as it does while a broker restarts. A consumer's committed()/commit() take the
    # group's own code path; a commit from a non-member is accepted for a group without
    # members (the declaration shadow group).
    def _group_consumer(self, group: str) -> tuple[Any, threading.Lock]:
        with self.lock:
            found = self.groups.get(group)
            if found is None:
                while len(self.groups) >= 16:
                    _, (old, _lock) = self.groups.popitem(last=False)
                    old.close()
                cfg = _config(self.s)
                cfg.update({"group.id": group, "enable.auto.commit": False,
                            "enable.auto.offset.store": False})
                found = self.groups[group] = (ck.Consumer(cfg), threading.Lock())
            else:
                self.groups.move_to_end(group)
            return found

    def group_offsets(self, group: str, tps: Collection[TP]
                      ) -> dict[TP, tuple[int, str] | None]:
        consumer, lock = self._group_consumer(group)
        try:
            with lock:
                found = consumer.committed(_native(tps), timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[TP, tuple[int, str] | None] = {tp: None for tp in tps}
        for item in found:
            if item.error is not None:
                raise _error(item.error, f"{item.topic}[{item.partition}]: ")
            if item.offset >= 0:
                out[TP(item.topic, item.partition)] = (item.offset, item.metadata or "")
        return out

    def set_group_offsets(self, group: str, offsets: Mapping[TP, tuple[int, str]]) -> None:
        consumer, lock = self._group_consumer(group)
        native = [ck.TopicPartition(t, p, o, metadata=m) for (t, p), (o, m) in offsets.items()]
        try:
            with lock:
                done = consumer.commit(offsets=native, asynchronous=False)
        except Exception as exc:
            raise classify(exc) from exc
        for item in done or ():
            if item.error is not None:
                raise _error(item.error)

    def delete_topics(self, names: Collection[str]) -> None:
        try:
            futures = self.a.delete_topics(list(names), operation_timeout=self.timeout,
                                           request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        self._raise_first(_outcomes(futures, self.timeout + 5, ("UNKNOWN_TOPIC_OR_PART",)))

    def delete_groups(self, groups: Collection[str]) -> None:
        try:
            futures = self.a.delete_consumer_groups(list(groups),
                                                    request_timeout=self.timeout)
        except Exception as exc:
            raise classify(exc) from exc
        self._raise_first(_outcomes(futures, self.timeout + 5,
                                    ("GROUP_ID_NOT_FOUND", "NON_EMPTY_GROUP")))

    @staticmethod
    def _raise_first(outcomes: Mapping[str, ClientError | None]) -> None:
        for err in outcomes.values():
            if err is not None:
                raise err

    def close(self) -> None:
        # (AdminClient has no close: it is freed with its last reference)
        with self.lock:
            groups = list(self.groups.values())
            self.groups.clear()
        for consumer, lock in groups:
            with lock:
                consumer.close()
