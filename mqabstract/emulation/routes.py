"""Topic → the groups whose pattern matches it, for drivers that fan out in process.

A driver that routes a publish itself (memory, SQLite) keeps its groups here by id with
their pattern; ``groups_for`` matches each group once per topic (with
:func:`mqabstract.names.topic_matcher`, the project's one matcher) and caches the answer
until the group set changes, so a publish to a known topic costs one dict lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from mqabstract.names import topic_matcher

__all__ = ["Routes"]

K = TypeVar("K", bound=Hashable)


class Routes(Generic[K]):
    """Groups by id (any hashable: a name, a row id, the group object) with their patterns.

    ``groups_for(topic)`` returns the matching ids in the order they were added. The cache
    holds up to ``max_topics`` topics and is emptied when full or when a group is added,
    removed or replaced. Not thread-safe: the driver calls it under its own lock.
    """

    __slots__ = ("_cache", "_matchers", "_max_topics")

    def __init__(self, max_topics: int = 10_000) -> None:
        self._matchers: dict[K, Callable[[str], bool]] = {}
        self._cache: dict[str, tuple[K, ...]] = {}
        self._max_topics = max_topics

    def add(self, group: K, pattern: str) -> None:
        """Route topics matching ``pattern`` to ``group`` (a known id gets the new pattern;
        ``InvalidName`` for a bad pattern)."""
        self._matchers[group] = topic_matcher(pattern)
        self._cache.clear()

    def remove(self, group: K) -> None:
        """Stop routing to ``group`` (nothing happens for an unknown id)."""
        if self._matchers.pop(group, None) is not None:
            self._cache.clear()

    def replace(self, groups: Iterable[tuple[K, str]]) -> None:
        """Make ``(id, pattern)`` pairs the whole group set (e.g. reloaded from a table)."""
        self._matchers = {group: topic_matcher(pattern) for group, pattern in groups}
        self._cache.clear()

    def groups_for(self, topic: str) -> tuple[K, ...]:
        """The ids of the groups whose pattern matches ``topic``."""
        found = self._cache.get(topic)
        if found is None:
            found = tuple(g for g, matches in self._matchers.items() if matches(topic))
            if len(self._cache) >= self._max_topics:
                self._cache.clear()
            self._cache[topic] = found
        return found

    def __len__(self) -> int:
        return len(self._matchers)
