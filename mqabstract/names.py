"""Naming rules and pattern matching shared by every backend.

Rules are portable: a name valid here is valid (after the driver's mapping) on every
backend, so swapping a URL never turns a working name into a late broker error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

from .errors import InvalidArgument, InvalidName

__all__ = [
    "MAX_GROUP_LEN",
    "MAX_HEADER_NAME_LEN",
    "MAX_ID_LEN",
    "MAX_KEY_LEN",
    "MAX_TOPIC_LEN",
    "RESERVED_HEADER_PREFIXES",
    "check_group",
    "check_header_name",
    "check_id",
    "check_key",
    "check_pattern",
    "check_text_value",
    "check_topic",
    "topic_matcher",
    "topic_matches",
]

MAX_TOPIC_LEN = 255
MAX_GROUP_LEN = 200
MAX_HEADER_NAME_LEN = 128
MAX_KEY_LEN = 256
MAX_ID_LEN = 128
#: Header-name prefixes that users may not set: ``mq-`` is ours (drivers carry metadata in
#: it), ``aws.`` / ``amazon.`` are reserved by SQS/SNS.
RESERVED_HEADER_PREFIXES = ("mq-", "aws.", "amazon.")

_WORD = r"[A-Za-z0-9_-]+"
_DOTTED = re.compile(rf"{_WORD}(?:\.{_WORD})*")
_PATTERN_WORD = re.compile(r"[A-Za-z0-9_-]+|\*|#")
# Characters every backend carries byte-exact in header values and keys (the XML 1.0 set
# that SQS attributes allow; AMQP and Kafka carry anything).
_BAD_TEXT = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@lru_cache(maxsize=8192)
def _dotted_ok(value: str, max_len: int) -> bool:
    return 0 < len(value) <= max_len and _DOTTED.fullmatch(value) is not None


def _check_dotted(value: object, what: str, max_len: int) -> str:
    """Topics, groups and header names: dot-separated words of ``[A-Za-z0-9_-]``.

    The type is checked before the cache is consulted, so unhashable input gets a typed
    error rather than the cache's TypeError.
    """
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a str, not {type(value).__name__}")
    if not _dotted_ok(value, max_len):
        raise InvalidName(
            f"invalid {what} {value[:80]!r}: use 1-{max_len} chars of dot-separated words "
            "made of letters, digits, '_' and '-'"
        )
    return value


def check_topic(topic: object) -> str:
    """Validate a topic: dot-separated words of ``[A-Za-z0-9_-]``."""
    return _check_dotted(topic, "topic", MAX_TOPIC_LEN)


def check_group(group: object) -> str:
    """Validate a group name (same alphabet as topics)."""
    return _check_dotted(group, "group", MAX_GROUP_LEN)


@lru_cache(maxsize=1024)
def _pattern_ok(pattern: str) -> bool:
    return 0 < len(pattern) <= MAX_TOPIC_LEN and all(
        _PATTERN_WORD.fullmatch(w) for w in pattern.split(".")
    )


def check_pattern(pattern: object) -> str:
    """Validate a subscription pattern: words, ``*`` (one word) and ``#`` (zero or more)."""
    if not isinstance(pattern, str):
        raise InvalidName(f"pattern must be a str, not {type(pattern).__name__}")
    if not _pattern_ok(pattern):
        raise InvalidName(
            f"invalid pattern {pattern[:80]!r}: dot-separated words, '*' for one word, "
            "'#' for zero or more words"
        )
    return pattern


def check_header_name(name: object) -> str:
    """Validate a header name; ``mq-``, ``aws.`` and ``amazon.`` prefixes are reserved."""
    checked = _check_dotted(name, "header name", MAX_HEADER_NAME_LEN)
    if checked.lower().startswith(RESERVED_HEADER_PREFIXES):
        raise InvalidName(
            f"header name {checked!r} uses a reserved prefix {RESERVED_HEADER_PREFIXES}"
        )
    return checked


def check_text_value(value: object, what: str, max_len: int | None = None) -> str:
    """Validate a header value or key: a str of characters every backend carries exactly."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, not {type(value).__name__}")
    if max_len is not None and not 0 < len(value) <= max_len:
        raise InvalidArgument(f"{what} must be 1-{max_len} characters long")
    if value.isascii() and value.isprintable():  # the common case, checked in C
        return value
    bad = _BAD_TEXT.search(value)
    if bad:
        raise InvalidArgument(
            f"{what} contains character U+{ord(bad.group()):04X}, which not every backend "
            "carries (control characters and surrogates are not allowed)"
        )
    return value


def check_key(key: object) -> str:
    """Validate an ordering key."""
    return check_text_value(key, "key", MAX_KEY_LEN)


def check_id(message_id: object) -> str:
    """Validate a publisher-set message id: 1-128 printable ASCII characters, no spaces
    (the SQS dedup-id alphabet, so an id works unchanged on every backend)."""
    if not isinstance(message_id, str):
        raise InvalidArgument(f"message id must be a str, not {type(message_id).__name__}")
    if not 0 < len(message_id) <= MAX_ID_LEN or not (
        message_id.isascii() and message_id.isprintable() and " " not in message_id
    ):
        raise InvalidArgument(
            f"invalid message id {message_id[:80]!r}: 1-{MAX_ID_LEN} printable ASCII "
            "characters without spaces"
        )
    return message_id


@lru_cache(maxsize=1024)
def topic_matcher(pattern: str) -> Callable[[str], bool]:
    """The project's one in-process pattern matcher: a predicate true for the topics that
    ``pattern`` matches (``*`` one word, ``#`` zero or more); ``InvalidName`` for a bad
    pattern. Native broker filters (Kafka's topic regex, AMQP bindings, SNS policies) are
    translations; whatever is matched in Python goes through here.

    The pattern compiles to a regex over ``'.' + topic``: the leading dot lets ``#`` absorb
    its own separators, so ``a.#`` matches ``a`` and ``#.b`` matches ``b``, as in AMQP.
    """
    parts = []
    for word in check_pattern(pattern).split("."):
        if word == "*":
            parts.append(r"\.[^.]+")
        elif word == "#":
            parts.append(r"(?:\.[^.]+)*")
        else:
            parts.append(r"\." + re.escape(word))
    fullmatch = re.compile("".join(parts)).fullmatch

    def matches(topic: str) -> bool:
        return fullmatch("." + topic) is not None

    return matches


def topic_matches(pattern: str, topic: str) -> bool:
    """True when ``topic`` matches the AMQP-style ``pattern``."""
    return topic_matcher(pattern)(topic)
