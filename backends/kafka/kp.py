"""The client surface (``client.py``) on kafka-python 3.0 (pure Python).

kafka-python's own quirks are handled here, each where it bites: it never hands
``allow_auto_create_topics`` to its metadata, its admin client caches group coordinators
forever, its rejoin can be abandoned mid-flight, and its consumer calls rebalance
listeners on its I/O thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

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

from mqabstract.url import redact

from .client import (
    TP,
    TXN_TIMEOUT_MS,
    Admin,
    Client,
    ClientError,
    Created,
    Fetched,
    Kind,
    Listener,
    Member,
    Mover,
    Outgoing,
    Pending,
    Producer,
    Reader,
    Settings,
)

__all__ = ["CLIENT"]

_REBALANCING = getattr(getattr(_kstructs, "MemberState", None), "REBALANCING", "<rebalancing>")
_FENCED = ("CommitFailedError", "RebalanceInProgressError", "UnknownMemberIdError",
           "IllegalGenerationError", "IllegalStateError")
_DOWN = ("NoBrokersAvailable", "KafkaConnectionError", "NodeNotReadyError")


def classify(exc: BaseException) -> ClientError:
    """kafka-python's exceptions as :class:`ClientError`."""
    if isinstance(exc, ClientError):
        return exc
    name = type(exc).__name__
    text = redact(f"{name}: {exc}")[:1500]
    if name == "InvalidSessionTimeoutError":
        kind = Kind.BAD_SESSION
    elif name == "OffsetMetadataTooLargeError":
        kind = Kind.METADATA_TOO_LARGE
    elif "TooLarge" in name:
        kind = Kind.TOO_LARGE
    elif name in _FENCED:
        kind = Kind.FENCED
    elif "Timeout" in name:
        kind = Kind.TIMEOUT
    elif isinstance(exc, KafkaError):
        if getattr(exc, "retriable", False) or name in _DOWN:
            kind = Kind.TRANSIENT
        elif "Invalid" in name:
            kind = Kind.OTHER  # about the record or request, not the producer
        else:
            kind = Kind.FATAL
    elif isinstance(exc, (ConnectionError, TimeoutError)):
        kind = Kind.TRANSIENT
    else:
        kind = Kind.OTHER
    return ClientError(kind, text, name, broker=isinstance(exc, KafkaError))


def _config(s: Settings, admin: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "bootstrap_servers": list(s.servers),
        "client_id": s.client_id,
        "request_timeout_ms": s.request_timeout_ms,
    }
    if not admin:
        # Every topic is created explicitly (partitions, compaction): a metadata request
        # for a deleted topic must not create it again with the broker's defaults.
        cfg["allow_auto_create_topics"] = False
    if s.sasl_username is not None:
        cfg["sasl_plain_username"] = s.sasl_username
        cfg["sasl_plain_password"] = s.sasl_password
    if s.sasl_mechanism:
        cfg["sasl_mechanism"] = s.sasl_mechanism
    if s.security_protocol:
        cfg["security_protocol"] = s.security_protocol
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password"):
        if getattr(s, name):
            cfg[name] = getattr(s, name)
    if not s.ssl_check_hostname:
        cfg["ssl_check_hostname"] = False
    return cfg


def _no_auto_create(client: Any) -> Any:
    """kafka-python 3.0.12 takes ``allow_auto_create_topics`` but never hands it to the
    cluster metadata that builds the requests: set it there too."""
    for attr in ("_cluster", "_metadata"):
        cluster = getattr(client, attr, None)
        config = getattr(cluster, "config", None)
        if isinstance(config, dict) and "allow_auto_create_topics" in config:
            config["allow_auto_create_topics"] = False
    return client


def _native(tps: Collection[TP]) -> list[TopicPartition]:
    return [TopicPartition(t, p) for t, p in tps]


class _Producer(Producer):
    def __init__(self, s: Settings) -> None:
        self.timeout = s.request_timeout_ms / 1000
        self.p = _no_auto_create(KafkaProducer(
            **_config(s),
            max_block_ms=s.request_timeout_ms,
            acks="all",
            enable_idempotence=True,
            linger_ms=s.linger_ms,
            max_request_size=1_048_576,
            batch_size=256 * 1024,
            bootstrap_timeout_ms=int(s.connect_timeout * 1000),
        ))

    def send(self, records: Sequence[Outgoing], timeout: float) -> list[ClientError | None]:
        futures: list[Any] = []
        send = self.p.send
        for r in records:
            try:
                futures.append(send(r.topic, value=r.value, key=r.key, headers=r.headers,
                                    partition=r.partition, timestamp_ms=r.timestamp_ms))
            except Exception as exc:
                futures.append(classify(exc))
        with contextlib.suppress(Exception):
            self.p.flush(timeout=timeout)
        out: list[ClientError | None] = []
        for fut in futures:
            if isinstance(fut, ClientError):
                out.append(fut)
                continue
            try:
                fut.get(timeout=max(0.0, timeout))
                out.append(None)
            except Exception as exc:
                out.append(classify(exc))
        return out

    def partitions(self, topic: str) -> set[int] | None:
        try:
            found = self.p.partitions_for(topic)
        except Exception as exc:
            raise classify(exc) from exc
        return set(found) if found else None

    def forget(self, topics: Collection[str]) -> None:
        # kafka-python's producer asks for the metadata of every topic it ever wrote to,
        # forever, and retries at once on "unknown topic".
        with contextlib.suppress(Exception):
            self.p._metadata._topics.difference_update(topics)

    def close(self, timeout: float) -> None:
        with contextlib.suppress(Exception):
            self.p.flush(timeout=timeout)
        with contextlib.suppress(Exception):
            self.p.close(timeout=timeout)


class _Admin(Admin):
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.lock = threading.Lock()
        try:
            self.a = KafkaAdminClient(**_config(s, admin=True),
                                      bootstrap_timeout_ms=int(s.connect_timeout * 1000))
        except Exception as exc:
            raise classify(exc) from exc

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            with self.lock:
                return fn(*args, **kw)
        except Exception as exc:
            raise classify(exc) from exc

    def create_topics(self, names: Collection[str], partitions: int, replication: int,
                      configs: Mapping[str, str]) -> dict[str, Created | ClientError]:
        new = [NewTopic(n, partitions, replication, topic_configs=dict(configs))
               for n in names]
        result = self._call(self.a.create_topics, new, raise_errors=False)
        out: dict[str, Created | ClientError] = dict.fromkeys(names, Created.NEW)
        for item in result.get("topics", []):
            code = item.get("error_code", 0)
            if code == 36:  # TOPIC_ALREADY_EXISTS
                out[item.get("name")] = Created.EXISTED
            elif code != 0:
                out[item.get("name")] = ClientError(
                    Kind.OTHER, f"error {code} {item.get('error_message') or ''}")
        return out

    def cluster_size(self) -> int:
        found = self._call(self.a.describe_cluster)
        return sum(1 for b in found.get("brokers", ()) if not b.get("is_fenced"))

    def replication(self, names: Collection[str]) -> dict[str, int]:
        # A metadata request with allow_auto_topic_creation=false (the admin client's).
        out: dict[str, int] = {}
        for topic in self._call(self.a.describe_topics, list(names)):
            parts = topic.get("partitions") or ()
            if topic.get("error_code", 0) == 0 and parts:
                out[topic["name"]] = min(len(p.get("replica_nodes") or ()) for p in parts)
        return out

    def unready(self, names: Collection[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        found = {t.get("name"): t for t in self._call(self.a.describe_topics, list(names))}
        for name in names:
            topic = found.get(name)
            if topic is None:
                out[name] = "not in the metadata"
            elif topic.get("error_code", 0) != 0:
                out[name] = f"error {topic['error_code']}"
            elif not topic.get("partitions"):
                out[name] = "no partitions"
            elif any(p.get("error_code", 0) != 0 or p.get("leader_id", -1) < 0
                     for p in topic["partitions"]):
                out[name] = "a partition without a leader"
        return out

    def list_topics(self) -> set[str]:
        # Every name in a full metadata answer, a topic whose answer carries an error
        # included: a topic created a moment ago answers LEADER_NOT_AVAILABLE until its
        # leader is elected, and a consumer's ``topics()`` (its cluster cache) leaves such
        # a topic out, so ``groups()`` missed a group declared just before (CI, loaded).
        return set(self._call(self.a.list_topics))

    def group_offsets(self, group: str, tps: Collection[TP]
                      ) -> dict[TP, tuple[int, str] | None]:
        """Committed offsets, stable ones only (require_stable, KIP-447): while a
        transaction that commits offsets of these partitions is open (``Mover``), the
        coordinator answers UNSTABLE_OFFSET_COMMIT (retriable: the driver asks again)
        instead of the offsets before it. kafka-python's ``list_group_offsets`` never
        asks for stable offsets; this is its request with the flag set."""
        found = self._call(self.a._manager.run, self._stable_offsets, group, list(tps))
        out: dict[TP, tuple[int, str] | None] = {}
        for tp in tps:
            oam = found.get(TopicPartition(*tp))
            out[tp] = (oam.offset, oam.metadata or "") if oam is not None and oam.offset >= 0 \
                else None
        return out

    async def _stable_offsets(self, group: str, tps: list[TP]) -> Any:
        (node,) = (await self.a._find_coordinator_ids([group])).values()
        requests = list(self.a._list_group_offsets_requests({group: tps}))
        (_, request), = requests
        request.require_stable = True
        response = await self.a._manager.send(request, node_id=node)
        return self.a._list_group_offsets_process_response(response, group_id=group)[group]

    def set_group_offsets(self, group: str, offsets: Mapping[TP, tuple[int, str]]) -> None:
        self._call(self.a.alter_group_offsets, group,
                   {TopicPartition(*tp): OffsetAndMetadata(o, m, -1)
                    for tp, (o, m) in offsets.items()})

    def delete_topics(self, names: Collection[str]) -> None:
        self._call(self.a.delete_topics, list(names), raise_errors=False)

    def delete_groups(self, groups: Collection[str]) -> None:
        self._call(self.a.delete_groups, list(groups))

    def forget_coordinators(self, groups: Collection[str]) -> None:
        # Its Java clients look a moved coordinator up again; kafka-python keeps it cached.
        with self.lock, contextlib.suppress(Exception):
            cache = self.a._manager.cluster._coordinators
            for key in [k for k in cache if k[1] in groups]:
                del cache[key]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.a.close()


class _Reader(Reader):
    def __init__(self, s: Settings, **extra: Any) -> None:
        try:
            self.c = _no_auto_create(KafkaConsumer(
                **_config(s),
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_poll_records=1000,
                fetch_max_wait_ms=s.fetch_max_wait_ms,
                **({"group_id": None} | extra),
            ))
        except Exception as exc:
            raise classify(exc) from exc

    def assign(self, tps: Collection[TP]) -> None:
        self.c.assign(sorted(_native(tps)))

    def poll(self, timeout: float, max_records: int) -> dict[TP, list[Fetched]]:
        try:
            return cast(dict[TP, list[Fetched]],
                        self.c.poll(timeout_ms=int(timeout * 1000), max_records=max_records))
        except Exception as exc:
            raise classify(exc) from exc

    def seek(self, positions: Mapping[TP, int | None]) -> None:
        try:
            for tp, offset in positions.items():
                native = TopicPartition(*tp)
                if offset is None:
                    self.c.seek_to_beginning(native)
                else:
                    self.c.seek(native, offset)
        except Exception as exc:
            raise classify(exc) from exc

    def position(self, tp: TP) -> int:
        try:
            return int(self.c.position(TopicPartition(*tp)))
        except Exception as exc:
            raise classify(exc) from exc

    def end_offsets(self, tps: Collection[TP], timeout: float | None = None
                    ) -> dict[TP, int]:
        try:
            found = self.c.end_offsets(_native(tps))  # (kafka-python: its request timeout)
        except Exception as exc:
            raise classify(exc) from exc
        return {TP(t.topic, t.partition): o for t, o in found.items()}

    def offsets_for_times(self, tps: Collection[TP], ms: int) -> dict[TP, int | None]:
        try:
            found = self.c.offsets_for_times({TopicPartition(*tp): ms for tp in tps})
        except Exception as exc:
            raise classify(exc) from exc
        out: dict[TP, int | None] = {}
        for tp in tps:
            hit = found.get(TopicPartition(*tp))
            # tansu answers offset 0 / timestamp -1 instead of no offset.
            out[tp] = hit.offset if hit is not None and hit.timestamp != -1 else None
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.c.close(autocommit=False)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Called on kafka-python's I/O thread, where blocking consumer calls are refused."""

    def __init__(self, member: _Member, revoked: Listener, assigned: Listener) -> None:
        self.member = member
        self.on_revoked = revoked
        self.on_assigned = assigned

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.on_revoked([TP(t.topic, t.partition) for t in revoked])

    def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned:
            self.member.c.pause(*assigned)  # until start() positions them
        self.on_assigned([TP(t.topic, t.partition) for t in assigned])


class _Pending(Pending):
    def __init__(self, future: Any) -> None:
        self.future = future
        self.landed = threading.Event()
        future.add_both(lambda _: self.landed.set())

    def wait(self, timeout: float) -> ClientError | None:
        if not self.landed.wait(max(0.0, timeout)):
            return ClientError(Kind.TIMEOUT, f"commit not confirmed within {timeout:.2f}s")
        exc = self.future.exception
        return None if exc is None else classify(exc)


class _Member(_Reader, Member):
    def __init__(self, s: Settings, group: str, topic: str, revoked: Listener,
                 assigned: Listener) -> None:
        # read_committed: the retry topic is written in transactions (``Mover``); an
        # aborted copy (a zombie's) is never read.
        super().__init__(s, group_id=group, isolation_level="read_committed",
                         session_timeout_ms=s.session_timeout_ms,
                         heartbeat_interval_ms=s.heartbeat_interval_ms,
                         max_poll_interval_ms=s.max_poll_interval_ms)
        self.topic = topic
        try:
            self.c.subscribe(topics=[topic], listener=_Listener(self, revoked, assigned))
        except Exception as exc:
            self.close()
            raise classify(exc) from exc

    def await_metadata(self, timeout: float) -> None:
        """Apache Kafka creates a topic in the controller first; a broker's metadata may
        miss it for a moment after CreateTopics returned. A leader that joins then assigns
        nothing, and its rejoin for the late metadata hits the bug ``_keep_join_alive``
        works around. After subscribe, this metadata update also refreshes kafka-python's
        snapshot of the subscribed topics, so the first assignment is not followed by a
        rebalance."""
        deadline = time.monotonic() + timeout
        while not self.c.partitions_for_topic(self.topic):
            if time.monotonic() >= deadline:
                raise ClientError(Kind.TIMEOUT,
                                  f"topic {self.topic} not in the broker's metadata")
            time.sleep(0.05)

    def poll(self, timeout: float, max_records: int) -> dict[TP, list[Fetched]]:
        out = super().poll(timeout, max_records)
        self._keep_join_alive()
        return out

    def _keep_join_alive(self) -> None:
        """Work around a kafka-python 3.0 bug that leaves a member without partitions.

        A rejoin triggered by a metadata change (not by the coordinator) is driven by
        ``need_rejoin()``, which compares snapshots the leader's own assignment updates
        while its JoinGroup/SyncGroup is in flight. If ``poll`` times out before SyncGroup
        answers (a join round often takes longer than one 200 ms poll on a busy Apache
        Kafka), the next ``poll`` sees nothing to do and the finished join is never
        completed: no assignment, no listener call, no heartbeats; the session expires and
        the member stays without slots, for good. While a join is in flight, keep the
        rejoin flag up so the next ``poll`` awaits it to the end (private attributes of
        kafka-python 3.0; harmless if they change: the guard just stops acting).
        """
        coordinator: Any = getattr(self.c, "_coordinator", None)
        lock = getattr(coordinator, "_lock", None)
        if lock is None:
            return
        with lock, contextlib.suppress(AttributeError):
            if (coordinator.state == _REBALANCING
                    and coordinator._join_task is not None
                    and not coordinator.rejoin_needed):
                coordinator.request_rejoin()

    def start(self, positions: Mapping[TP, int | None]) -> None:
        self.seek(positions)
        if positions:
            self.c.resume(*_native(positions))

    def stable(self) -> bool:
        """kafka-python refuses commits while the membership is not stable."""
        check = getattr(getattr(self.c, "_coordinator", None), "generation_if_stable", None)
        return check is None or check() is not None

    def group_meta(self) -> tuple[object, int | None]:
        meta = self.c.group_metadata()
        return meta, meta.generation_id if meta.member_id else -1

    def commit(self, offsets: Mapping[TP, tuple[int, str]],
               done: Callable[[ClientError | None], None],
               expect: object = None) -> Pending:
        native = {TopicPartition(*tp): OffsetAndMetadata(o, m, -1)
                  for tp, (o, m) in offsets.items()}
        # (sent right here, under the caller's commit lock: checked just before)
        if expect is not None and _identity(self.c.group_metadata()) != _identity(expect):
            err = ClientError(Kind.FENCED, "the group membership changed since the offsets "
                                           "were read: not sent")
            done(err)
            raise err

        def landed(_offsets: Any, result: Any) -> None:
            done(classify(result) if isinstance(result, BaseException) else None)

        # Not commit_async: with the coordinator unknown, it returns the lookup's future.
        # Scheduled commits are sent in order on one connection.
        coordinator = getattr(self.c, "_coordinator", None)
        send = getattr(coordinator, "_do_commit_offsets_async", None)
        try:
            if send is not None:
                future = send(native, landed)
            else:  # pragma: no cover - kafka-python changed
                future = self.c.commit_async(native, callback=landed)
        except Exception as exc:
            err = classify(exc)
            done(err)
            raise err from exc
        return _Pending(future)


def _identity(meta: object) -> tuple[object, object]:
    """Generation and member id of a ``group_metadata()`` snapshot (not its state)."""
    return getattr(meta, "generation_id", None), getattr(meta, "member_id", None)


class _Mover(Mover):
    """A transactional KafkaProducer. kafka-python's ``commit_transaction`` and
    ``send_offsets_to_transaction`` wait without a time limit: their requests are made
    on its transaction manager and waited for with one here."""

    def __init__(self, s: Settings, transactional_id: str) -> None:
        self.s = s
        self.tid = transactional_id
        self.p: Any = None
        self._open()

    def _open(self) -> None:
        try:
            p = _no_auto_create(KafkaProducer(
                **_config(self.s), acks="all", enable_idempotence=True, linger_ms=0,
                max_block_ms=self.s.request_timeout_ms, max_request_size=1_048_576,
                transactional_id=self.tid, transaction_timeout_ms=TXN_TIMEOUT_MS,
                # (see ck: CONCURRENT_TRANSACTIONS right after a commit; asked again soon)
                retry_backoff_ms=10,
                bootstrap_timeout_ms=int(self.s.connect_timeout * 1000)))
        except Exception as exc:
            raise classify(exc) from exc
        try:
            # Completes (or aborts) what an earlier producer with this id left open.
            p.init_transactions()
        except Exception as exc:
            with contextlib.suppress(Exception):
                p.close(timeout=0)
            raise classify(exc) from exc
        self.p = p

    def _await(self, result: Any, timeout: float) -> None:
        self.p._sender.wakeup()
        if not result.wait(timeout_ms=max(1, int(timeout * 1000))):
            raise ClientError(Kind.TIMEOUT, f"transaction step not done within {timeout:.2f}s")

    def move(self, records: Sequence[Outgoing], offsets: Mapping[TP, tuple[int, str]],
             group_meta: object, timeout: float) -> None:
        if self.p is None:
            self._open()
        p = self.p
        tm = p._transaction_manager
        end = time.monotonic() + timeout
        try:
            p.begin_transaction()
            futures = [p.send(r.topic, value=r.value, key=r.key, headers=r.headers,
                              partition=r.partition, timestamp_ms=r.timestamp_ms)
                       for r in records]
            self._await(tm.send_offsets_to_transaction(
                {TopicPartition(*tp): OffsetAndMetadata(o, m, -1)
                 for tp, (o, m) in offsets.items()}, group_meta), end - time.monotonic())
            p.flush(timeout=max(0.0, end - time.monotonic()))
            for fut in futures:
                fut.get(timeout=max(0.0, end - time.monotonic()))
            self._await(tm.begin_commit(), end - time.monotonic())
        except Exception as exc:
            err = classify(exc)
            try:  # (refused once the commit began: then the outcome is not known)
                self._await(tm.begin_abort(), max(0.5, end - time.monotonic()))
            except Exception:
                err.doubt = True
                self._replace()
            raise err from exc

    def _replace(self) -> None:
        """A new producer with the same transactional.id: its init_transactions completes
        or aborts the transaction this one left, so its outcome can be read back."""
        old, self.p = self.p, None
        with contextlib.suppress(Exception):
            old.close(timeout=0)
        with contextlib.suppress(ClientError):
            self._open()  # (else at the next move)

    def close(self, timeout: float) -> None:
        if self.p is not None:
            with contextlib.suppress(Exception):
                self.p.close(timeout=timeout)


class _Client(Client):
    name = "kafka-python"

    def producer(self, settings: Settings) -> Producer:
        try:
            return _Producer(settings)
        except Exception as exc:
            raise classify(exc) from exc

    def admin(self, settings: Settings) -> Admin:
        return _Admin(settings)

    def reader(self, settings: Settings) -> Reader:
        return _Reader(settings)

    def member(self, settings: Settings, group: str, topic: str, revoked: Listener,
               assigned: Listener) -> Member:
        return _Member(settings, group, topic, revoked, assigned)

    def mover(self, settings: Settings, transactional_id: str) -> Mover:
        return _Mover(settings, transactional_id)


CLIENT = _Client()
