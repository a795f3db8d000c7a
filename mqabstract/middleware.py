"""Middleware: code that runs around every publish and every handled message.

A middleware subclasses ``Middleware`` and overrides the hooks it needs; ``connect(url,
middleware=[...])`` installs them in order (the first is the outermost). The same object
serves the sync and the asyncio API: the two *scopes* are plain context managers, entered
on the caller's thread or task, so a scope may set context variables (the current span)
for the code it wraps.

- ``publishing(pub)``: around one publish call (``publish``, ``publish_batch``,
  ``publish_columns``). Entered before the messages are checked:
  headers it adds to ``pub.headers`` go into every message of the call (a message's own
  header of the same name wins) and are validated with the rest. A scope that raises on
  entry stops the call: nothing is sent (``MiddlewareError``). On exit it sees the error
  of the call, or ``pub.ids``.
- ``handling(msg)``: around a ``consume`` handler, on the thread or task that runs it.
  It sees the message, the handler's exception and its duration. A scope that raises on
  entry counts as a failure of the handler (the message is retried).
- ``received(sub, messages, started_ns)`` and ``settled(sub, op, messages, started_ns,
  error)``: notices after a receive returned messages (one for a whole ``receive_batch``)
  and after settle calls (``op``: ``ack``, ``nack``, ``dead_letter``, ``expired`` — the
  lease ran out first, nothing reached the broker — or ``release``, handed back
  unfinished). They run on whichever thread made the call. A receive that a ``consume``
  loop made for its handlers is told to ``delivered(sub, messages, started_ns)`` instead,
  which calls ``received`` unless overridden.

Exits and notices never change an outcome: what they raise is logged and dropped (a
message that was sent must not look unsent, or a retry would duplicate it).

This module is the public face (``Middleware``, ``Chain``); the calling itself is
``hooks.py``, which the broker and the subscriptions use without importing this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import TYPE_CHECKING

from .errors import InvalidArgument, MQError
from .hooks import NO_MIDDLEWARE as NO_MIDDLEWARE
from .hooks import Hooks, Publishing

if TYPE_CHECKING:
    from .broker import Broker
    from .message import Message
    from .subscription import Subscription

__all__ = ["Middleware", "Publishing"]

#: ``settled`` ops.
OPS = ("ack", "nack", "dead_letter", "expired", "release")


class Middleware:
    """Base class: every hook does nothing. Override the ones you need."""

    def bind(self, broker: Broker) -> None:
        """Called once when ``connect`` installs this middleware on ``broker``."""

    def unbind(self, broker: Broker) -> None:
        """Called when ``broker`` closes."""

    def publishing(self, pub: Publishing) -> ContextManager[object] | None:
        """A context manager around one publish call (None: nothing to do)."""
        return None

    def handling(self, msg: Message) -> ContextManager[object] | None:
        """A context manager around one handler call of ``consume`` (None: nothing)."""
        return None

    def received(self, sub: Subscription, messages: Sequence[Message], started_ns: int
                 ) -> None:
        """``receive`` returned ``messages`` (never empty); it began at ``started_ns``
        (``time.time_ns()``)."""

    def delivered(self, sub: Subscription, messages: Sequence[Message], started_ns: int
                  ) -> None:
        """A ``consume`` loop received ``messages`` for its handlers (push-based delivery:
        the application asked for no receive). By default the same as ``received``."""
        self.received(sub, messages, started_ns)

    def settled(self, sub: Subscription, op: str, messages: Sequence[Message],
                started_ns: int, error: MQError | None) -> None:
        """A settle call ended (``op`` in ``OPS``), failing with ``error`` or not."""


def _overrides(mw: Middleware, hook: str) -> bool:
    return getattr(type(mw), hook) is not getattr(Middleware, hook)


class Chain(Hooks):
    """The middleware installed on one broker (``connect(middleware=)``): checked, each
    listed under the hooks it overrides; ``Hooks`` calls them."""

    __slots__ = ()

    def __init__(self, items: Sequence[Middleware] | None = ()) -> None:
        if items is None:
            items = ()
        if isinstance(items, Middleware) or not isinstance(items, (list, tuple)):
            raise InvalidArgument(
                f"middleware must be a list of mqabstract.Middleware, not "
                f"{type(items).__name__}")
        for mw in items:
            if not isinstance(mw, Middleware):
                raise InvalidArgument(
                    f"middleware must be mqabstract.Middleware instances, not "
                    f"{type(mw).__name__}")
        super().__init__(
            items,
            publishers=[m for m in items if _overrides(m, "publishing")],
            handlers=[m for m in items if _overrides(m, "handling")],
            receivers=[m for m in items
                       if _overrides(m, "received") or _overrides(m, "delivered")],
            settlers=[m for m in items if _overrides(m, "settled")])
