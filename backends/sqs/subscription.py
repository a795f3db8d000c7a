"""An SQS group's consumer side: the group record, receipts, and the subscription that
receives, decodes and settles (ack, nack, extend, dead-letter, deferral hops)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import botocore.exceptions

from mqabstract import wire as wire_schema
from mqabstract.driver import DriverSubscription
from mqabstract.emulation import next_hop
from mqabstract.errors import InvalidArgument, NotFound
from mqabstract.model import Delivery, GroupSpec
from mqabstract.names import topic_matches

from .calls import _MISSING_QUEUE, _STALE_CODES, Calls, _code, _raise
from .wire import (
    ATTR_TOPIC,
    BATCH,
    M_ATTEMPT,
    M_DEAD_AT,
    M_DUE,
    M_ID,
    M_PUBLISHED,
    M_REASON,
    MAX_DELAY_SECONDS,
    MAX_VISIBILITY,
    MAX_WAIT,
    _decode_body,
    _from_sqs,
    _Wire,
)


@dataclass
class _Group:
    name: str
    pattern: str
    queue_url: str
    queue_arn: str
    dlq_url: str
    fifo: bool
    subscription_arn: str | None = None
    exact: bool = True


@dataclass
class _Receipt:
    handle: str
    group: _Group
    received_at: float  #: wall time just before the receive call
    wire: _Wire
    delivery: Delivery | None = field(default=None, repr=False)
    attempt: int = 1


class SQSSubscription(DriverSubscription):
    """A group's consumer: receive long-polls in slices of at most 20 s; receive and settles
    call SQS through the driver's ``Calls`` (thread-safe; nothing here retries)."""

    def __init__(self, calls: Calls, group: _Group, spec: GroupSpec) -> None:
        self._calls = calls
        self._group = group
        self._spec = spec
        self._lease = max(1, math.ceil(spec.lease))
        self._closed = False

    def receive(self, max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + max(0.0, timeout)
        want = max(1, min(max_messages, BATCH))
        while not self._closed:
            remaining = deadline - time.monotonic()
            wait = int(min(MAX_WAIT, max(0.0, remaining)))
            out = self._receive(self._group, want, wait, self._lease)
            if out:
                return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            if wait == 0:  # under a second left: poll gently until the deadline
                time.sleep(min(remaining, 0.2))
        return []

    def _receive(self, group: _Group, want: int, wait: int, lease: int) -> list[Delivery]:
        before_wall = time.time()
        resp = self._calls.call(
            "receive", self._calls.sqs.receive_message, QueueUrl=group.queue_url,
            MaxNumberOfMessages=want, WaitTimeSeconds=wait, VisibilityTimeout=lease,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp",
                                         "ApproximateFirstReceiveTimestamp", "MessageGroupId"],
        )
        # A long poll leases the message when it answers: the broker's deadline is never
        # earlier than the portable layer's (taken before this call), which alone decides
        # whether a settle is stale.
        out: list[Delivery] = []
        drop: list[str] = []
        now = time.time()
        for msg in resp.get("Messages", []):
            wire = _from_sqs(msg)
            receipt = _Receipt(msg["ReceiptHandle"], group, before_wall, wire)
            topic = wire.attributes.get(ATTR_TOPIC, {}).get("StringValue")
            if topic and not group.exact and not topic_matches(group.pattern, topic):
                drop.append(msg["ReceiptHandle"])  # admitted by the filter policy superset only
                continue
            fields = wire.fields()
            due = fields.deliver_at
            if due is not None and due > now:
                self._defer(receipt, due - now)
                continue
            delivery = _delivery(msg, wire, fields, group, topic, receipt)
            receipt.delivery = delivery
            receipt.attempt = delivery.attempt
            out.append(delivery)
        if drop:
            self._calls.delete_handles(group.queue_url, drop)
        return out

    def _defer(self, receipt: _Receipt, remaining: float) -> None:
        """Hide a message that is not due yet without counting the hop as a delivery."""
        group = receipt.group
        if group.fifo:
            # FIFO queues have no per-message delay; hiding it keeps its key's order too.
            seconds = min(math.ceil(remaining), MAX_VISIBILITY - 60)
            self._change_visibility(receipt, seconds)
            return
        wire = receipt.wire
        self._calls.send(group.queue_url, wire, next_hop(remaining, MAX_DELAY_SECONDS), False)
        self._calls.delete_handles(group.queue_url, [receipt.handle])

    # -- settling -----------------------------------------------------------------------------
    def ack(self, receipts: Sequence[Any]) -> None:
        by_queue: dict[str, list[str]] = {}
        for r in receipts:
            by_queue.setdefault(r.group.queue_url, []).append(r.handle)
        for url, handles in by_queue.items():
            with contextlib.suppress(NotFound):  # the group was deleted meanwhile
                self._calls.delete_handles(url, handles)

    def _change_visibility(self, receipt: _Receipt, seconds: int) -> bool:
        """ChangeMessageVisibility; False when the receipt turned out stale."""
        try:
            self._calls.sqs.change_message_visibility(
                QueueUrl=receipt.group.queue_url, ReceiptHandle=receipt.handle,
                VisibilityTimeout=int(seconds),
            )
        except botocore.exceptions.ClientError as exc:
            code = _code(exc)
            if code in _STALE_CODES or code in _MISSING_QUEUE:
                return False
            raise self._calls.client_error("change visibility", exc) from exc
        except Exception as exc:
            self._calls.call("change visibility", _raise, exc=exc)
        return True

    def nack(self, receipt: _Receipt, delay: float) -> None:
        seconds = math.ceil(delay)
        if seconds <= _left_in_flight(receipt):
            self._change_visibility(receipt, seconds)
            return
        # Longer than SQS lets a message stay hidden: send a copy that remembers its attempts
        # and becomes due later, then drop this one.
        wire = receipt.wire.with_meta(**wire_schema.pack(
            wire_schema.retry_fields(receipt.attempt, time.time() + delay)))
        self._calls.send(receipt.group.queue_url, wire, min(MAX_DELAY_SECONDS, seconds),
                         receipt.group.fifo)
        self._calls.delete_handles(receipt.group.queue_url, [receipt.handle])

    def extend(self, receipt: _Receipt, seconds: float) -> None:
        whole = math.ceil(seconds)
        if whole > _left_in_flight(receipt):
            raise InvalidArgument(
                "sqs: a message can stay leased at most 12 h after it was received "
                f"({max(0, int(_left_in_flight(receipt)))} s left)"
            )
        self._change_visibility(receipt, whole)

    def dead_letter(self, receipt: _Receipt, reason: str, attempts: int) -> None:
        d = receipt.delivery
        wire = receipt.wire
        if d is not None and not wire.meta:  # a foreign message: give it our metadata
            meta = {"v": 1, M_ID: d.id, M_PUBLISHED: d.published_at}
            wire = _Wire(wire.body, dict(wire.attributes), meta, wire.group_id).with_meta()
            wire.attributes.setdefault(ATTR_TOPIC, {"DataType": "String", "StringValue": d.topic})
        wire = wire.with_meta(**{M_REASON: reason, M_ATTEMPT: int(attempts),
                                 M_DEAD_AT: time.time(), M_DUE: None})
        self._calls.send(receipt.group.dlq_url, wire, 0, False)
        self._calls.delete_handles(receipt.group.queue_url, [receipt.handle])

    def close(self) -> None:
        self._closed = True


def _delivery(msg: Mapping[str, Any], wire: _Wire, fields: wire_schema.Fields,
              group: _Group, topic: str | None, receipt: _Receipt) -> Delivery:
    meta = wire.meta
    sysattrs = msg.get("Attributes") or {}
    count = int(sysattrs.get("ApproximateReceiveCount", 1))
    attempt = count + fields.attempt
    due = fields.deliver_at
    first = sysattrs.get("ApproximateFirstReceiveTimestamp")
    if group.fifo and due is not None and first:
        # FIFO delay hops were receives too: one per started 12 h before the due time.
        ahead = due - int(first) / 1000.0
        if ahead > 0:
            attempt -= math.ceil(ahead / (MAX_VISIBILITY - 60))
    key = fields.key
    if key is None and not meta and group.fifo:
        key = sysattrs.get("MessageGroupId")
    published = fields.published_at
    if published is None:
        published = int(sysattrs.get("SentTimestamp", time.time() * 1000)) / 1000.0
    return Delivery(
        id=fields.id or str(msg.get("MessageId")),
        topic=topic or group.name,
        body=_decode_body(wire.body, meta.get("e")),
        headers=wire.headers(),
        key=key,
        priority=int(meta.get("p", 0)),
        attempt=max(1, attempt),
        published_at=published,
        receipt=receipt,
    )


def _left_in_flight(receipt: _Receipt) -> float:
    """Seconds this receipt may still stay hidden (SQS: 12 h from the receive)."""
    return MAX_VISIBILITY - 5 - (time.time() - receipt.received_at)
