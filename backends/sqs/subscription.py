"""An SQS group's consumer side: the group record, receipts and the subscription."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mqabstract.driver import DriverSubscription
from mqabstract.model import Delivery, GroupSpec

from .wire import BATCH, MAX_WAIT, _Wire

if TYPE_CHECKING:
    from .driver import SQSDriver


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
    """A group's consumer: receive long-polls in slices of at most 20 s; settles go to
    the driver, which owns the boto3 clients (thread-safe; nothing here retries)."""

    def __init__(self, driver: SQSDriver, group: _Group, spec: GroupSpec) -> None:
        self._driver = driver
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
            out = self._driver._receive(self._group, want, wait, self._lease)
            if out:
                return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            if wait == 0:  # under a second left: poll gently until the deadline
                time.sleep(min(remaining, 0.2))
        return []

    def ack(self, receipts: Sequence[Any]) -> None:
        self._driver._ack(list(receipts))

    def nack(self, receipt: Any, delay: float) -> None:
        self._driver._nack(receipt, delay)

    def extend(self, receipt: Any, seconds: float) -> None:
        self._driver._extend(receipt, seconds)

    def dead_letter(self, receipt: Any, reason: str, attempts: int) -> None:
        self._driver._dead_letter(receipt, reason, attempts)

    def close(self) -> None:
        self._closed = True
