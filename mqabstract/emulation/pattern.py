"""Topic patterns (AMQP style: ``*`` one word, ``#`` zero or more) as a value drivers share.

Brokers filter natively with less than the full pattern language (SNS filter policies have
exact and prefix/suffix matches; Kafka subscribes by regex over its own topic names). A
driver asks the pattern for its literal head and tail or a native superset filter, and
finishes with :meth:`Pattern.matches` where the native filter admits more.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mqabstract.names import check_pattern, topic_matcher

__all__ = ["NativeFilter", "Pattern"]

WILD = ("*", "#")


@dataclass(frozen=True)
class NativeFilter:
    """What a broker with exact / prefix / suffix string filters should admit: topics equal
    to ``exact``, or starting with ``prefix``, or ending with ``suffix`` (None: unused).
    All three None means "admit everything". ``complete`` is True when the filter admits
    exactly the matching topics (no client-side check needed)."""

    exact: str | None
    prefix: str | None
    suffix: str | None
    complete: bool


@dataclass(frozen=True)
class Pattern:
    """A validated pattern. ``Pattern("a.*.c").matches("a.b.c")`` is True."""

    text: str

    def __post_init__(self) -> None:
        check_pattern(self.text)

    @cached_property
    def words(self) -> tuple[str, ...]:
        return tuple(self.text.split("."))

    @property
    def literal(self) -> bool:
        """No wildcards: the pattern is one topic."""
        return not any(w in WILD for w in self.words)

    @cached_property
    def head(self) -> tuple[str, ...]:
        """The literal words before the first wildcard (all words when literal)."""
        out: list[str] = []
        for w in self.words:
            if w in WILD:
                break
            out.append(w)
        return tuple(out)

    @cached_property
    def tail(self) -> tuple[str, ...]:
        """The literal words after the last wildcard (empty when literal)."""
        if self.literal:
            return ()
        out: list[str] = []
        for w in reversed(self.words):
            if w in WILD:
                break
            out.insert(0, w)
        return tuple(out)

    def matches(self, topic: str) -> bool:
        return topic_matcher(self.text)(topic)

    def native_filter(self) -> NativeFilter:
        """The tightest exact / prefix / suffix superset of the matching topics.

        ``head.…`` admits ``head`` and ``head.*``-prefixed topics (``#`` may match
        nothing); failing a head, a literal tail gives a suffix filter.
        """
        if self.literal:
            return NativeFilter(self.text, None, None, True)
        wild = [i for i, w in enumerate(self.words) if w in WILD]
        if self.head:
            lit = ".".join(self.head)
            complete = wild == [len(self.words) - 1] and self.words[-1] == "#"
            return NativeFilter(lit, lit + ".", None, complete)
        if self.tail:
            lit = ".".join(self.tail)
            complete = wild == [0] and self.words[0] == "#"
            return NativeFilter(lit, None, "." + lit, complete)
        return NativeFilter(None, None, None, self.words == ("#",))
