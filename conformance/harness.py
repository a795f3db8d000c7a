"""Helpers shared by the conformance scenarios: unique names, draining, cleanup, gates."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest

import mqabstract
from mqabstract import Broker, Feature, Message, Subscription

log = logging.getLogger("mqabstract.conformance")

#: What a release-margin bound allows beyond the declared margin: the drain's ack of the
#: returned message and this process's own scheduling, not the backend's release.
RELEASE_SLACK = 0.5


class Ctx:
    """What a scenario needs: the broker, unique names, timing, and cleanup at teardown."""

    def __init__(self, url: str, broker: Broker, scale: float = 1.0,
                 connect: Callable[..., Broker] = mqabstract.connect) -> None:
        self._connect = connect
        self.url = url
        self.broker = broker
        self.caps = broker.capabilities
        self.scale = scale
        self.token = "c" + secrets.token_hex(4)
        self._groups: list[tuple[Broker, str]] = []
        self._brokers: list[Broker] = []
        self._subs: list[Subscription] = []

    # -- timing --------------------------------------------------------------------------
    @property
    def lease(self) -> float:
        """Short lease used by lease scenarios (whole seconds: SQS has 1 s granularity)."""
        return 2.0 * self.scale

    @property
    def delay(self) -> float:
        return 2.0 * self.scale

    @property
    def wait(self) -> float:
        """Upper bound to wait for messages that must arrive (returns as soon as they do)."""
        return 15.0 * self.scale

    @property
    def quiet(self) -> float:
        """How long to watch for messages that must NOT arrive."""
        return 1.5 * self.scale

    # -- names ---------------------------------------------------------------------------
    def topic(self, *words: str) -> str:
        return ".".join(("mqc", self.token, *words))

    def pattern(self, *words: str) -> str:
        return ".".join(("mqc", self.token, *words))

    def group(self, name: str = "g") -> str:
        return f"mqc-{self.token}-{name}"

    # -- resources -----------------------------------------------------------------------
    def connect(self, **options: Any) -> Broker:
        """A second, independent connection to the same URL (closed at teardown)."""
        broker = self._connect(self.url, **options)
        self._brokers.append(broker)
        return broker

    def subscribe(
        self, name: str, pattern: str, broker: Broker | None = None, **kw: Any
    ) -> Subscription:
        broker = broker or self.broker
        group = self.group(name)
        self._remember(broker, group)  # before: a half-made group is cleaned up too
        sub = broker.subscribe(group, pattern, **kw)
        self._subs.append(sub)
        return sub

    def declare(self, name: str, pattern: str, broker: Broker | None = None, **kw: Any) -> str:
        broker = broker or self.broker
        group = self.group(name)
        self._remember(broker, group)
        broker.declare(group, pattern, **kw)
        return group

    def _remember(self, broker: Broker, group: str) -> None:
        if all(g != group for _, g in self._groups):
            self._groups.append((broker, group))

    def cleanup(self) -> None:
        for sub in self._subs:
            try:
                sub.close()
            except Exception as exc:  # closing after the broker closed, etc.
                log.debug("cleanup: %s", exc)
        for broker, group in self._groups:
            target = self.broker if broker.closed else broker
            try:
                target.delete_group(group)
            except Exception as exc:
                log.debug("cleanup: delete %s: %s", group, exc)
        for broker in self._brokers:
            try:
                broker.close()
            except Exception as exc:
                log.debug("cleanup: close: %s", exc)

    # -- gates ---------------------------------------------------------------------------
    def require(self, *features: Feature) -> None:
        for feature in features:
            if not self.caps.supports(feature):
                pytest.skip(f"{self.broker.backend} declares {feature.value} UNSUPPORTED")

    # -- receiving -----------------------------------------------------------------------
    def drain(
        self,
        sub: Subscription,
        count: int,
        timeout: float | None = None,
        ack: bool = True,
        on_message: Callable[[Message], None] | None = None,
    ) -> list[Message]:
        """Receive until ``count`` messages arrived or ``timeout`` passed without one
        arriving; ack each unless told not.

        The bound is on silence, not on the whole drain: hundreds of messages through a
        slow broker on a loaded machine may take longer than ``wait`` in total while every
        receive still brings some. A missing message still fails: nothing comes for it."""
        idle = self.wait if timeout is None else timeout
        deadline = time.monotonic() + idle
        got: list[Message] = []
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            batch = sub.receive(min(count - len(got), 100), left)
            if batch:
                deadline = max(deadline, time.monotonic() + idle)
            for msg in batch:
                got.append(msg)
                if on_message is not None:
                    on_message(msg)
                if ack:
                    msg.ack()
        return got

    def expect_none(self, sub: Subscription, timeout: float | None = None) -> None:
        """Assert that nothing arrives within ``timeout`` (default ``quiet``)."""
        got = sub.receive(10, self.quiet if timeout is None else timeout)
        for msg in got:
            msg.nack()
        assert not got, f"expected no message, got {got}"
