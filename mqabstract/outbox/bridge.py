"""A broker group as a relay's source: the bridge that moves a group's messages to
another broker (``mqa relay --from 'amqp://…?group=g' --to kafka://…``).

A claim is one receive on the group; ``confirm`` acks the messages (after the target
confirmed them), ``reject`` dead-letters one in the source group, ``release`` nacks the
claim back. A bridge killed in between leaves its messages leased: the source broker
delivers them again after the lease (a second publish with the same ids). Ids, topics,
bodies, user headers, keys and priorities are kept, a TTL with what is left of it;
``published_at`` becomes the bridge's publish, and request/reply routes do not cross.
The group belongs to the bridge: subscribing sets its policy (``max_attempts``, ``lease``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

from .. import connect
from ..broker import Message
from ..errors import InvalidArgument, MQError
from ..model import OutgoingMessage
from ..url import BrokerURL
from .source import Source

__all__ = ["GroupSource", "split_url"]

#: Query parameters of a bridge source URL that are the bridge's, not the backend's.
BRIDGE_PARAMS = ("group", "pattern", "ordered", "max_attempts")


def split_url(url: str) -> tuple[str, dict[str, str]]:
    """(the backend URL without the bridge's parameters, those parameters)."""
    parsed = BrokerURL.parse(url)
    mine = {k: v for k, v in parsed.params if k in BRIDGE_PARAMS}
    head, _, query = url.partition("?")
    rest = "&".join(p for p in query.split("&") if p and p.split("=", 1)[0]
                    not in BRIDGE_PARAMS) if query else ""
    return (f"{head}?{rest}" if rest else head), mine


def _outgoing(msg: Message, now: float) -> OutgoingMessage | None:
    expires = msg.expires_at
    ttl = None
    if expires is not None:
        ttl = expires.timestamp() - now
        if ttl <= 0:
            return None
    return OutgoingMessage(msg.topic, msg.body, headers=dict(msg.headers) or None,
                           key=msg.key, priority=msg.priority or None, id=msg.id, ttl=ttl)


class GroupSource(Source):
    """Group ``group`` (pattern ``pattern``, default ``#``) of the broker at ``url``."""

    waits = True

    def __init__(self, url: str, *, lease: float = 30.0,
                 options: Mapping[str, str] | None = None) -> None:
        opts = dict(options or {})
        group = opts.get("group")
        if not group:
            raise InvalidArgument("a bridge source URL names its group: …?group=NAME")
        try:
            attempts = int(opts.get("max_attempts", "1000"))
        except ValueError as exc:
            raise InvalidArgument("max_attempts must be an int") from exc
        ordered = opts.get("ordered", "false").lower() in ("1", "true", "yes")
        self._mq = connect(url)
        self.where = f"{self._mq.url} group {group}"
        try:
            # Many attempts: a target that is down must not dead-letter the source's messages.
            self._sub = self._mq.subscribe(group, opts.get("pattern", "#"), lease=lease,
                                           max_attempts=attempts, ordered=ordered)
        except BaseException:
            self._mq.close()
            raise
        self._held: list[Message] = []
        self._marks: dict[int, str] = {}

    def claim(self, max_messages: int, wait: float) -> list[OutgoingMessage]:
        n = max(1, min(max_messages, self._mq.capabilities.max_receive))
        got = self._sub.receive(max_messages=n, wait=wait)
        now = time.time()
        self._held, self._marks, out = [], {}, []
        for msg in got:
            item = _outgoing(msg, now)
            if item is None:  # its TTL ended on the way: the source's dead letters
                with contextlib.suppress(MQError):
                    msg.dead_letter("expired")
                continue
            self._held.append(msg)
            out.append(item)
        return out

    def reject(self, index: int, reason: str) -> None:
        self._marks[index] = reason

    def confirm(self) -> None:
        held, marks = self._held, self._marks
        self._held, self._marks = [], {}
        for i, reason in marks.items():
            held[i].dead_letter(reason[:1000])
        self._sub.ack_many([m for i, m in enumerate(held) if i not in marks])

    def release(self) -> None:
        held, self._held, self._marks = self._held, [], {}
        for msg in held:
            with contextlib.suppress(MQError):
                msg.nack()

    def close(self) -> None:
        with contextlib.suppress(MQError):
            self.release()
        self._mq.close()


