"""How mqabstract names map to Kafka topic names, and which partitions a member reads.

Mapped names escape ``-`` and ``_`` (Apache Kafka refuses a topic whose name equals
another's after ``.`` -> ``_``: metric names collide); internal names contain ``..``,
which no mapped name does; names longer than Kafka allows are hashed and carry their
mqabstract topic in a header.
"""

from __future__ import annotations

import re
import zlib

from mqabstract.emulation import fit_name

from .client import TP

__all__ = ["HASHED", "INTERNAL", "MAX_TOPIC", "REGISTRY", "declared_key", "internal",
           "kafka_topic_name", "slot", "topic_regex", "unescape"]

MAX_TOPIC = 249  # Apache Kafka's limit on topic names
INTERNAL = "__mqa.."  # internal names contain "..", which no mapped mqabstract name does
HASHED = "__mqh.."
REGISTRY = INTERNAL + "groups"


def _escape(name: str) -> str:
    # Mapped names never contain '_', so the mapping stays injective under '.' -> '_'.
    return name.replace("-", "--").replace("_", "-u")


_UNESCAPE = re.compile(r"-(.)")


def unescape(name: str) -> str:
    """The mqabstract topic of a mapped (not hashed) name without its prefix."""
    return _UNESCAPE.sub(lambda m: {"-": "-", "u": "_"}.get(m[1], m[0]), name)


def _fit(name: str, hashed_prefix: str) -> str:
    """``name``, or ``hashed_prefix`` + a digest of it when Kafka's limit is exceeded (the
    toolkit's ``fit_name``; the prefix marks hashed names for the topic regex)."""
    fitted = fit_name(name, MAX_TOPIC, keep_head=False, digest_chars=48)
    return name if fitted == name else hashed_prefix + fitted


def kafka_topic_name(topic: str, prefix: str = "") -> str:
    """The Kafka topic for an mqabstract topic (hashed when longer than Kafka allows)."""
    return _fit(prefix + _escape(topic), HASHED)


def internal(kind: str, group: str) -> str:
    """A group's internal topic: ``r`` retry, ``d`` dead letters."""
    return _fit(f"{INTERNAL}{kind}..{_escape(group)}", f"{INTERNAL}{kind}..h-")


def declared_key(group: str) -> str:
    """The shadow group whose committed offset on ``REGISTRY`` is the declaration time."""
    return group + "..mqa-declared"


#: One mapped word: mapped names never contain ``_``, names Kafka keeps for itself start
#: with ``__``.
WORD = r"[^._]+"


def topic_regex(pattern: str, prefix: str = "") -> str:
    """A regex over Kafka topic names matching exactly the mapped topics ``pattern`` matches.

    AMQP ``#`` absorbs its own separator, so a separator is either a dot or, at the very
    start of the mapped name, nothing (the fixed-width look-behind on the prefix). A word
    never contains ``_`` (the mapping escapes it), so no wildcard reaches a topic the
    broker keeps for itself (``__consumer_offsets``, ``__transaction_state``, ...) or one
    of this driver's internal topics.
    """
    words = pattern.split(".")
    if "*" not in words and "#" not in words:
        return "^" + re.escape(kafka_topic_name(pattern, prefix)) + "$"
    sep = rf"(?:(?<=^{re.escape(prefix)})|\.)"
    parts = []
    for word in words:
        if word == "*":
            parts.append(sep + WORD)
        elif word == "#":
            parts.append(rf"(?:{sep}{WORD})*")
        else:
            parts.append(sep + re.escape(_escape(word)))
    # Hashed (over-long) topics cannot be matched by name: take them all and filter on the
    # topic carried in their header.
    return rf"^(?:{re.escape(prefix)}{''.join(parts)}|{re.escape(HASHED)}.+)$"


def slot(tp: TP, slots: int) -> int:
    """The retry partition ("slot") whose owner in the group also reads data partition ``tp``."""
    return (zlib.crc32(tp.topic.encode()) + tp.partition) % max(1, slots)
