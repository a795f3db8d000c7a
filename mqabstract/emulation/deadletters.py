"""Dead letters kept by a driver, in the wire schema (``mqabstract.wire``).

A dead-lettered copy carries the original's headers plus ``mq-reason``, ``mq-attempt``
(deliveries it had) and ``mq-dead-at``. Drivers store such copies in a queue or topic of
their own and read them back with :func:`dead_letter_from`; replay strips the dead-letter
metadata and restarts the attempt count.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

from mqabstract import wire
from mqabstract.model import DeadLetter, utc

__all__ = ["DEAD_META", "dead_headers", "dead_letter_from", "pick", "replay_headers"]

#: The headers a dead-lettered copy adds (replay removes them).
DEAD_META = (wire.REASON, wire.ATTEMPT, wire.DEAD_AT)

T = TypeVar("T")


def dead_headers(reason: str, attempts: int, now: float) -> dict[str, str]:
    """The metadata to add to a copy dead-lettered at epoch time ``now``: its attempts are
    the deliveries it had (the wire codec's rule for copies)."""
    return {wire.REASON: reason, wire.ATTEMPT: wire.value(attempts),
            wire.DEAD_AT: wire.value(now)}


def replay_headers(headers: Mapping[str, T]) -> dict[str, T]:
    """The headers of a replayed copy: dead-letter metadata, delays and TTLs gone (a
    replayed expired message would expire again at once)."""
    return {k: v for k, v in headers.items()
            if k not in DEAD_META and k != wire.DELIVER_AT and k != wire.EXPIRES_AT}


def dead_letter_from(headers: Mapping[str, object], body: bytes, *, id: str = "",
                     topic: str = "", key: str | None = None, priority: int = 0,
                     published_at: float = 0.0, skip: Collection[str] = ()) -> DeadLetter:
    """Decode a stored copy. Wire headers win over the native fallbacks given as keywords
    (``id``, ``topic``, ``key``, ``published_at``); other ``mq-`` headers and the names in
    ``skip`` (broker headers) are not the user's and are left out of ``headers``."""
    meta = {k: v for k, v in headers.items() if k.startswith(wire.PREFIX)}
    user = {k: wire.text(v) for k, v in headers.items()
            if not k.startswith(wire.PREFIX) and k not in skip}
    f = wire.read(meta)
    try:
        dead_at = float(wire.text(meta[wire.DEAD_AT])) if meta.get(wire.DEAD_AT) else None
    except ValueError:
        dead_at = None
    return DeadLetter(
        id=f.id or id,
        topic=f.topic if f.topic is not None else topic,
        body=body,
        headers=user,
        key=f.key if f.key is not None else key,
        priority=priority,
        published_at=utc(f.published_at if f.published_at is not None else published_at),
        attempts=f.attempt,
        reason=wire.text(meta.get(wire.REASON, "")),
        dead_lettered_at=utc(dead_at) if dead_at is not None else None,
    )


def pick(entries: Sequence[T], ids: Collection[str] | None,
         id_of: Callable[[T], str | None]) -> list[T]:
    """The entries whose id is in ``ids`` (all of them when ``ids`` is None), in order."""
    if ids is None:
        return list(entries)
    wanted = set(ids)
    return [e for e in entries if id_of(e) in wanted]
