"""What a backend can do, declared per feature and tested as declared.

The conformance suite reads these values: a feature's tests run wherever it is not
UNSUPPORTED, and where it is UNSUPPORTED the portable layer raises ``Unsupported``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from .errors import Unsupported

__all__ = ["Capabilities", "Feature", "Support"]


class Support(enum.Enum):
    """How a backend provides a feature."""

    NATIVE = "native"  #: the broker does it
    EMULATED = "emulated"  #: the driver builds it from other broker features, keeping the contract
    UNSUPPORTED = "unsupported"  #: using it raises ``Unsupported``


class Feature(enum.Enum):
    """Contract features that a backend may lack. The gate used by the conformance suite."""

    WILDCARDS = "wildcards"  #: ``*`` and ``#`` in group patterns
    FANOUT = "fanout"  #: every group of a matching pattern gets every message
    COMPETING = "competing"  #: consumers of one group share its messages
    LEASE_EXTEND = "lease_extend"  #: ``Message.extend(seconds)``
    NACK_DELAY = "nack_delay"  #: ``Message.nack(delay>0)``
    DELAY = "delay"  #: ``publish(delay=...)`` / ``deliver_at=...``
    PRIORITY = "priority"  #: ``publish(priority=1..9)`` delivered highest first
    ORDERING = "ordering"  #: same-key messages in publish order (``declare(ordered=True)``)
    DEAD_LETTER = "dead_letter"  #: dead-letter store with list / replay / purge
    BATCH = "batch"  #: ``publish_batch`` sends many messages per broker round trip
    TTL = "ttl"  #: ``publish(ttl=…)``: expired messages dead-lettered (reason ``expired``)
    REQUEST_REPLY = "request_reply"  #: ``Broker.request`` / ``Message.reply``

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Feature.WILDCARDS: "`*` / `#` patterns",
    Feature.FANOUT: "fan-out to groups",
    Feature.COMPETING: "competing consumers",
    Feature.LEASE_EXTEND: "lease extend",
    Feature.NACK_DELAY: "nack with delay",
    Feature.DELAY: "delay / deliver_at",
    Feature.PRIORITY: "priority 0-9",
    Feature.ORDERING: "per-key order",
    Feature.DEAD_LETTER: "dead letters",
    Feature.BATCH: "batch publish",
    Feature.TTL: "message TTL",
    Feature.REQUEST_REPLY: "request / reply",
}

#: Features the portable layer builds over any backend's other features: EMULATED unless a
#: driver declares otherwise.
PORTABLE = {Feature.TTL: Support.EMULATED, Feature.REQUEST_REPLY: Support.EMULATED}


#: ``GroupStats`` counts a backend may report, and how it knows them.
STAT_COUNTS = ("ready", "leased", "delayed", "dead", "lag")
STAT_KINDS = ("exact", "approximate")
#: ``Capabilities.key_gate`` values.
KEY_GATES = ("broker", "hold", "hand_back")


@dataclass(frozen=True)
class Capabilities:
    """A backend's declared features and limits.

    Limits are enforced by the portable layer before anything is sent, so they must be the
    backend's real limits (moto, for one, accepts values that AWS rejects).
    """

    features: Mapping[Feature, Support]
    max_body_bytes: int
    max_headers: int = 64
    max_header_bytes: int = 16 * 1024  #: total of header names + values, UTF-8
    max_delay: float = 365 * 86400.0  #: seconds; longer delays raise InvalidArgument
    max_ttl: float = 365 * 86400.0  #: seconds; longer TTLs raise InvalidArgument
    max_batch: int = 1000  #: messages per driver call; the portable layer chunks larger batches
    max_priority: int = 9
    max_lease: float = 12 * 3600.0  #: longest lease (visibility timeout / extend), seconds
    #: shortest lease (and extend) the backend can keep, seconds; shorter ones are rejected
    min_lease: float = 0.05
    #: a frozen or killed holder's messages are deliverable to others at most this many
    #: seconds after its lease deadline (the broker's detection time; reliability-tested)
    release_margin: float = 1.0
    max_receive: int = 1000  #: most messages one driver receive call returns
    max_consumers_per_group: int | None = None  #: None = unlimited (Kafka: partitions)
    shared_between_processes: bool = True  #: False for memory://
    durable: bool = True  #: messages survive a broker restart
    #: what a confirmed publish survives, in words, as configured (empty: not stated
    #: beyond ``durable``)
    confirmed_survives: str = ""
    #: which ``GroupStats`` counts ``stats()`` reports, and how: "exact" (the broker's own
    #: count, by any process), "approximate" (the broker's estimate); absent ones are None
    stats: Mapping[str, str] = field(default_factory=lambda: dict.fromkeys(
        ("ready", "leased", "delayed", "dead"), "exact"))
    lists_groups: bool = True  #: ``Broker.groups()`` works (else ``Unsupported``)
    #: how ordered groups keep one message of a key at a time (``KEY_GATES``): "broker"
    #: (the broker never hands out a key's next message while an earlier one is out:
    #: memory, SQLite), "hold" (it hands a consumer a key's messages in order, several at
    #: once, and what goes back comes back to that consumer: the portable layer holds the
    #: later ones until the key is free; RabbitMQ, Kafka), "hand_back" (as "hold", but the
    #: broker keeps a key's messages behind any of them that is out, so when one goes back
    #: the held ones go back too: SQS FIFO). See ``mqabstract.emulation.ordering``.
    key_gate: str = "hold"
    notes: Mapping[Feature, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", {**PORTABLE, **self.features})
        missing = set(Feature) - set(self.features)
        if missing:
            names = ", ".join(sorted(f.value for f in missing))
            raise ValueError(f"capabilities must declare every feature; missing: {names}")
        object.__setattr__(self, "features", MappingProxyType(dict(self.features)))
        object.__setattr__(self, "notes", MappingProxyType(dict(self.notes)))
        object.__setattr__(self, "stats", MappingProxyType(dict(self.stats)))
        if self.key_gate not in KEY_GATES:
            raise ValueError(f"key_gate must be one of {KEY_GATES}, not {self.key_gate!r}")
        unknown = set(self.stats) - set(STAT_COUNTS) or set(self.stats.values()) - set(
            STAT_KINDS)
        if unknown:
            raise ValueError(f"stats: unknown counts or kinds {sorted(unknown)}")

    def support(self, feature: Feature) -> Support:
        return self.features[feature]

    def supports(self, feature: Feature) -> bool:
        """True when the feature is NATIVE or EMULATED."""
        return self.features[feature] is not Support.UNSUPPORTED

    def require(self, feature: Feature, backend: str) -> None:
        """Raise ``Unsupported`` naming the backend and feature when it is UNSUPPORTED."""
        if not self.supports(feature):
            note = self.notes.get(feature)
            raise Unsupported(
                f"{backend} does not support {feature.description}"
                + (f": {note}" if note else "")
            )

    def with_features(self, **changes: Support) -> Capabilities:
        """A copy with some features changed (``priority=Support.UNSUPPORTED``)."""
        features = dict(self.features)
        for name, support in changes.items():
            features[Feature(name)] = support
        return replace(self, features=features)

    @classmethod
    def all_native(cls, **limits: object) -> Capabilities:
        """Every feature NATIVE: the reference backends."""
        return cls(features={f: Support.NATIVE for f in Feature if f not in PORTABLE},
                   **limits)  # type: ignore[arg-type]
