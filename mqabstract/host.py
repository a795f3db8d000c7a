"""``Host``: the broker as the consumer side uses it.

A ``Subscription``, its messages, its consume loop and its ordered-key gatekeeper reach
their ``Broker`` for a few things: its capabilities and clocks, the guard around driver
calls, the checks it shares, and the publish behind ``Message.reply``.
They name it by this protocol, so none of them imports ``broker.py``, which imports them
all (``Broker`` has every member; a module that needs more says so in its own protocol).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .capabilities import Capabilities, Feature
from .guard import _Guard

__all__ = ["Host"]


class Host(Protocol):
    """What the consumer side reads and calls of its ``Broker``."""

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def backend(self) -> str: ...

    @property
    def _guard(self) -> _Guard: ...

    @property
    def _clock(self) -> Any: ...

    @property
    def _monotonic(self) -> Callable[[], float]: ...

    def _now(self) -> float: ...

    def _check_open(self) -> None: ...

    def _require(self, feature: Feature) -> None: ...

    def _check_lease(self, value: object, what: str) -> float: ...

    def _reply(self, reply_to: str, correlation: str, body: object,
               headers: Mapping[str, str] | None) -> str: ...
