"""The small client surface the Kafka driver is written against, and how one is chosen.

The driver's logic (slots, retry and delay topics, leases, checkpoints, dead letters)
is written once over these classes; ``kp`` implements them on kafka-python and ``ck`` on
confluent-kafka (librdkafka). An implementation translates every native exception at
its boundary into :class:`ClientError` with one of the :class:`Kind` values below, so the
driver never looks at a native error type.

Concurrency duties of an implementation: the producer and admin are shared by all
threads of a driver; a :class:`Reader` or :class:`Member` is used by the one thread that
polls it, except :meth:`Member.commit` and :meth:`Member.stable`, which any thread may call.
Clients are created lazily by the driver in the process that uses them (fork safety).
"""

from __future__ import annotations

import abc
import enum
import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from mqabstract import wire

__all__ = ["TP", "Admin", "Client", "ClientError", "Created", "Fetched", "Kind", "Member",
           "Mover", "Outgoing", "Pending", "Producer", "Reader", "Settings", "available",
           "load"]


class TP(NamedTuple):
    """A topic partition (hashable; implementations convert to their native type)."""

    topic: str
    partition: int


class Kind(enum.Enum):
    """What a failure means to the driver."""

    TRANSIENT = "transient"  # the broker is away, restarting or moving: retry later
    FENCED = "fenced"  # not a member of the group's current generation any more
    TOO_LARGE = "too_large"  # a record or request over the broker's limits
    METADATA_TOO_LARGE = "metadata_too_large"  # commit metadata over offset.metadata.max.bytes
    TIMEOUT = "timeout"
    BAD_SESSION = "bad_session"  # the broker refuses the session timeout
    FATAL = "fatal"  # this producer can send nothing more: make a new one
    OTHER = "other"  # not retriable, about the request


class Created(enum.Enum):
    """What ``Admin.create_topics`` did with a topic it did not fail on."""

    NEW = "new"  # created by this call, as asked
    EXISTED = "existed"  # there already (its partitions and replication are whatever they are)


class ClientError(Exception):
    """A client failure, classified. ``native`` names the client's own error type."""

    def __init__(self, kind: Kind, text: str, native: str = "", doubt: bool = False,
                 broker: bool = False) -> None:
        super().__init__(text)
        self.kind = kind
        self.native = native
        #: an error code of the protocol or of the client library (not an exception of
        #: the client's own code, such as an internal assertion)
        self.broker = broker
        #: (``Mover.move``) whether the transaction may have committed all the same: its
        #: outcome is not known (the caller reads the committed offsets back).
        self.doubt = doubt

    @property
    def retriable(self) -> bool:
        return self.kind in (Kind.TRANSIENT, Kind.TIMEOUT)


@dataclass(frozen=True)
class Settings:
    """Connection settings in neutral form; each implementation maps them to its config."""

    servers: tuple[str, ...]
    client_id: str
    request_timeout_ms: int
    connect_timeout: float
    security_protocol: str | None = None
    sasl_mechanism: str | None = None
    sasl_username: str | None = field(default=None, repr=False)
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = field(default=None, repr=False)
    ssl_check_hostname: bool = True
    linger_ms: int = 2
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1000
    max_poll_interval_ms: int = 30000
    fetch_max_wait_ms: int = 100
    prefetch_kbytes: int = 16384


class Outgoing(NamedTuple):
    """A record to produce."""

    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    partition: int | None = None
    timestamp_ms: int | None = None


class Fetched(Protocol):
    """A fetched record as the driver reads it (kafka-python's records already are)."""

    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes | None]] | None: ...
    @property
    def timestamp(self) -> int: ...


class Producer(abc.ABC):
    """Writes records with acks from all in-sync replicas, idempotently."""

    @abc.abstractmethod
    def send(self, records: Sequence[Outgoing], timeout: float) -> list[ClientError | None]:
        """Write ``records`` (pipelined, in order per partition) and wait up to ``timeout``
        for every acknowledgement; the result says, per record, None (acknowledged) or why
        not. Never raises for a single record's failure."""

    def send_rows(self, topic: str, values: Sequence[bytes], keys: Sequence[bytes | None] | None,
                  ids: Sequence[str], headers: list[tuple[str, bytes]],
                  row_headers: Sequence[list[tuple[str, bytes]] | None] | None,
                  timestamp_ms: int, timeout: float) -> list[ClientError | None]:
        """``send`` for rows of one topic given as columns: row ``i`` carries ``headers``,
        then ``row_headers[i]``, then its ``mq-id`` (``ids[i]``); ``keys`` None: no keys.
        Implementations with a tighter produce loop override it (building each row's header
        list inside the loop keeps it short-lived: a batch of them alive at once makes the
        cyclic garbage collector run over and over)."""
        n = len(values)
        ks: Sequence[bytes | None] = keys if keys is not None else [None] * n
        rows: Sequence[list[tuple[str, bytes]] | None] = row_headers or [None] * n
        return self.send([
            Outgoing(topic, v, k, [*headers, *(own or ()), (wire.ID, mid.encode())], None,
                     timestamp_ms)
            for v, k, mid, own in zip(values, ks, ids, rows, strict=True)], timeout)

    @abc.abstractmethod
    def partitions(self, topic: str) -> set[int] | None:
        """The topic's partitions from (cached) metadata; None when unknown."""

    def forget(self, topics: Collection[str]) -> None:
        """Stop tracking deleted topics' metadata (kafka-python asks for them forever)."""
        return None

    @abc.abstractmethod
    def close(self, timeout: float) -> None: ...


#: How long a transaction of ``Mover`` may stay open before the broker aborts it (it then
#: also stops a new owner of its partitions from reading their checkpoints: require_stable).
TXN_TIMEOUT_MS = 10_000


class Mover(abc.ABC):
    """A transactional producer (one ``transactional.id``, one user at a time).

    ``move`` writes records *and* commits group offsets in one Kafka transaction, the
    offsets fenced by the consumer group's generation (KIP-447: ``group_meta`` is the
    member's snapshot, checked by the group coordinator in TxnOffsetCommit). Either the
    records become visible to ``read_committed`` readers and the offsets are committed,
    or neither: a member evicted while frozen gets ``Kind.FENCED`` and its records are
    aborted. Offsets fetched with require_stable wait while such a transaction is open.
    """

    @abc.abstractmethod
    def move(self, records: Sequence[Outgoing], offsets: Mapping[TP, tuple[int, str]],
             group_meta: object, timeout: float) -> None:
        """Raises ``ClientError``; the transaction is then aborted, unless the error's
        ``doubt`` says the outcome is unknown (the mover has then been replaced by one
        with the same ``transactional.id``, which completed the old transaction)."""

    @abc.abstractmethod
    def close(self, timeout: float) -> None: ...


class Admin(abc.ABC):
    """Cluster administration: topics and group offsets. Thread-safe."""

    @abc.abstractmethod
    def create_topics(self, names: Collection[str], partitions: int, replication: int,
                      configs: Mapping[str, str]) -> dict[str, Created | ClientError]:
        """Create topics (``replication`` -1: the broker's default); per name, whether it is
        new, existed already, or why it could not be created."""

    @abc.abstractmethod
    def cluster_size(self) -> int:
        """How many brokers the cluster metadata lists (the live, unfenced ones)."""

    @abc.abstractmethod
    def replication(self, names: Collection[str]) -> dict[str, int]:
        """Per existing topic of ``names``, the fewest replicas any of its partitions has
        (topics the metadata does not describe are left out). Never creates a topic."""

    @abc.abstractmethod
    def unready(self, names: Collection[str]) -> dict[str, str]:
        """Per topic of ``names`` not yet usable, why: unknown to the broker answering, or a
        partition without a leader (a topic created a moment ago, on KRaft). Never
        creates a topic."""

    @abc.abstractmethod
    def list_topics(self) -> set[str]: ...

    @abc.abstractmethod
    def group_offsets(self, group: str, tps: Collection[TP]
                      ) -> dict[TP, tuple[int, str] | None]:
        """Committed (offset, metadata) of ``group`` per partition; None where none."""

    @abc.abstractmethod
    def set_group_offsets(self, group: str, offsets: Mapping[TP, tuple[int, str]]) -> None:
        """Commit offsets for a group without members."""

    @abc.abstractmethod
    def delete_topics(self, names: Collection[str]) -> None: ...

    @abc.abstractmethod
    def delete_groups(self, groups: Collection[str]) -> None: ...

    def forget_coordinators(self, groups: Collection[str]) -> None:
        """Drop cached coordinators of ``groups`` before a retry (they may have moved)."""
        return None

    @abc.abstractmethod
    def close(self) -> None: ...


class Reader(abc.ABC):
    """A consumer without group membership: manual assignment and positions."""

    #: Whether the subscription watches it for a silent stop of fetching after a broker
    #: restart (``KafkaSubscription._check_stalled``): seen once with librdkafka.
    watched = False

    @abc.abstractmethod
    def assign(self, tps: Collection[TP]) -> None:
        """Read exactly ``tps`` (positions of partitions kept stay where they were)."""

    @abc.abstractmethod
    def poll(self, timeout: float, max_records: int) -> dict[TP, list[Fetched]]: ...

    @abc.abstractmethod
    def seek(self, positions: Mapping[TP, int | None]) -> None:
        """Set positions of assigned partitions; None: the partition's beginning."""

    @abc.abstractmethod
    def position(self, tp: TP) -> int:
        """The offset of the next record ``poll`` returns for ``tp``."""

    def known_position(self, tp: TP) -> int | None:
        """``position`` if this consumer knows it without asking a broker, else None
        (then it reads ``tp`` from the beginning): what a replacement is seeked to."""
        return self.position(tp)

    @abc.abstractmethod
    def end_offsets(self, tps: Collection[TP], timeout: float | None = None
                    ) -> dict[TP, int]:
        """The end offset (high watermark) per partition, waiting at most ``timeout``
        seconds (None: the request timeout)."""

    @abc.abstractmethod
    def offsets_for_times(self, tps: Collection[TP], ms: int) -> dict[TP, int | None]:
        """The first offset at or after ``ms`` per partition; None where there is none."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Pending(abc.ABC):
    """An offset commit on its way."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> ClientError | None:
        """The commit's outcome: None when the coordinator accepted it. A commit not
        answered within ``timeout`` gives ``Kind.TIMEOUT``."""


#: ``revoked(tps)`` and ``assigned(tps)``: called by the member during ``poll`` (possibly
#: on the client's own I/O thread, where they must not block on the consumer).
Listener = Callable[[Collection[TP]], None]


class Member(Reader):
    """A consumer-group member subscribed to one topic (the group's retry topic).

    ``poll`` keeps the membership (heartbeats, joins) and calls the listeners. Newly
    assigned partitions are paused until :meth:`start` gives them positions.
    """

    @abc.abstractmethod
    def await_metadata(self, timeout: float) -> None:
        """Return once the subscribed topic's partitions are known (before the first join
        matters: a leader that joins without them assigns nothing)."""

    @abc.abstractmethod
    def start(self, positions: Mapping[TP, int | None]) -> None:
        """Position newly assigned partitions (None: beginning) and resume them."""

    @abc.abstractmethod
    def stable(self) -> bool:
        """Whether the membership is stable (no rebalance under way): commits can land."""

    @abc.abstractmethod
    def group_meta(self) -> tuple[object, int | None]:
        """A snapshot of this member's group membership for ``Mover.move`` and its
        generation (None where the client does not tell; negative: not a member)."""

    @abc.abstractmethod
    def commit(self, offsets: Mapping[TP, tuple[int, str]],
               done: Callable[[ClientError | None], None],
               expect: object = None) -> Pending:
        """Schedule an asynchronous commit of (offset, metadata) per partition, in order
        with earlier ones; any thread. ``done`` is called with its outcome. Partitions need
        not be assigned to this member: the coordinator checks member id and generation.

        ``expect``: the membership snapshot (``group_meta``) the offsets were read under.
        When the membership has changed by the time the commit would be sent, it is not
        sent (``Kind.FENCED``): sent under a later generation (after a rejoin) it would be
        accepted, also for partitions that another member owned in between."""


class Client(abc.ABC):
    """Makes the native objects of one client library."""

    name: str

    @abc.abstractmethod
    def producer(self, settings: Settings) -> Producer: ...

    @abc.abstractmethod
    def admin(self, settings: Settings) -> Admin: ...

    @abc.abstractmethod
    def reader(self, settings: Settings) -> Reader: ...

    @abc.abstractmethod
    def member(self, settings: Settings, group: str, topic: str, revoked: Listener,
               assigned: Listener) -> Member: ...

    @abc.abstractmethod
    def mover(self, settings: Settings, transactional_id: str) -> Mover: ...


#: Client names and their modules, in order of preference (the fastest first).
_CLIENTS = {"confluent": ("confluent_kafka", ".ck"), "kafka-python": ("kafka", ".kp")}


def available() -> list[str]:
    """Installed clients, fastest first."""
    found = []
    for name, (module, _) in _CLIENTS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        found.append(name)
    return found


def load(name: str | None) -> Client:
    """The client named ``name`` (``confluent`` / ``kafka-python``), or the fastest one
    installed. ``ImportError`` when it is not installed, ``ValueError`` for an unknown
    name."""
    if name in (None, "", "auto"):
        names = available()
        if not names:
            raise ImportError("no Kafka client installed: pip install "
                              "'mqabstract[kafka]' (confluent-kafka) or "
                              "'mqabstract[kafka-python]'")
        name = names[0]
    if name not in _CLIENTS:
        raise ValueError(f"unknown Kafka client {name!r}: use one of {', '.join(_CLIENTS)}")
    module = importlib.import_module(_CLIENTS[name][1], __package__)
    client: Client = module.CLIENT
    return client
