"""Reading a group's SQS dead-letter queue for the driver's listing, replay and purge: every
entry received (hidden for a minute), one per message id, released again, decoded."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from mqabstract.errors import MQError
from mqabstract.model import DeadLetter, utc

from .calls import Calls
from .subscription import _Group
from .wire import ATTR_TOPIC, BATCH, M_DEAD_AT, M_REASON, _decode_body, _from_sqs

log = logging.getLogger("mqabstract.sqs")


def scan(calls: Calls, queue_url: str) -> list[dict[str, Any]]:
    """Receive every message of a (dead-letter) queue, hidden for a minute."""
    seen: dict[str, dict[str, Any]] = {}
    long_polled = False
    while True:
        resp = calls.call(
            "read dead letters", calls.sqs.receive_message, QueueUrl=queue_url,
            MaxNumberOfMessages=BATCH, WaitTimeSeconds=1 if long_polled else 0,
            VisibilityTimeout=60, MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["SentTimestamp"],
        )
        batch = resp.get("Messages", [])
        for m in batch:
            seen[m["MessageId"]] = m
        if batch:
            continue
        if long_polled:
            return list(seen.values())
        # Short polls sample a subset of SQS hosts; confirm the queue is empty.
        attrs = calls.call("read queue attributes", calls.sqs.get_queue_attributes,
                           QueueUrl=queue_url,
                           AttributeNames=["ApproximateNumberOfMessages"])["Attributes"]
        if int(attrs.get("ApproximateNumberOfMessages", 0)) == 0:
            return list(seen.values())
        long_polled = True


def scan_dead(calls: Calls, g: _Group) -> list[dict[str, Any]]:
    """The group's dead letters, one per message id (hidden for a minute, as ``scan``).

    A move to the dead-letter queue is a send there, then a delete from the group queue:
    two calls that nothing makes atomic. A consumer killed between them leaves the
    original behind; it comes back past ``max_attempts`` and is moved again, a second
    entry for the id. So an id's first move (fewest attempts, then earliest) is its dead
    letter; a later entry for it is redundant and deleted here (if that delete fails,
    the next scan drops it again)."""
    first: dict[str, dict[str, Any]] = {}
    extra: list[dict[str, Any]] = []

    def order(m: Mapping[str, Any]) -> tuple[int, float, int, str]:
        w = _from_sqs(m)
        sent = int((m.get("Attributes") or {}).get("SentTimestamp", 0))
        dead_at = w.meta.get(M_DEAD_AT)
        return (w.fields().attempt,
                float(dead_at) if isinstance(dead_at, (int, float)) else sent / 1000.0,
                sent, str(m["MessageId"]))

    for m in sorted(scan(calls, g.dlq_url), key=order):
        mid = _from_sqs(m).fields().id or str(m["MessageId"])
        if mid in first:
            extra.append(m)
        else:
            first[mid] = m
    if extra:
        try:
            calls.delete_handles(g.dlq_url, [m["ReceiptHandle"] for m in extra])
        except MQError as exc:
            log.warning("sqs: group %r: %d repeated dead letters not deleted (%s); "
                        "every listing leaves them out", g.name, len(extra), exc)
    return list(first.values())


def release(calls: Calls, queue_url: str, messages: Iterable[Mapping[str, Any]]) -> None:
    """Make scanned messages visible again at once."""
    handles = [m["ReceiptHandle"] for m in messages]
    for start in range(0, len(handles), BATCH):
        chunk = handles[start : start + BATCH]
        calls.call(
            "release dead letters", calls.sqs.change_message_visibility_batch,
            QueueUrl=queue_url,
            Entries=[{"Id": str(i), "ReceiptHandle": h, "VisibilityTimeout": 0}
                     for i, h in enumerate(chunk)],
        )


def view(msg: Mapping[str, Any]) -> DeadLetter:
    """A scanned dead letter as the portable ``DeadLetter``."""
    wire = _from_sqs(msg)
    meta = wire.meta
    fields = wire.fields()
    sent = int((msg.get("Attributes") or {}).get("SentTimestamp", 0)) / 1000.0
    published = fields.published_at
    return DeadLetter(
        id=fields.id or str(msg["MessageId"]),
        topic=wire.attributes.get(ATTR_TOPIC, {}).get("StringValue", ""),
        body=_decode_body(wire.body, meta.get("e")),
        headers=wire.headers(),
        key=fields.key,
        priority=int(meta.get("p", 0)),
        published_at=utc(published if published is not None else sent),
        attempts=fields.attempt,
        reason=str(meta.get(M_REASON, "")),
        dead_lettered_at=utc(float(meta.get(M_DEAD_AT, sent))),
    )
