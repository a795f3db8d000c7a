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
  error)``: notices after a receive returned messages and after settle calls (``op``:
  ``ack``, ``nack``, ``dead_letter``, ``expired`` — the lease ran out first, nothing
  reached the broker — or ``release``, handed back unfinished). They run on whichever
  thread made the call.

Exits and notices never change an outcome: what they raise is logged and dropped (a
message that was sent must not look unsent, or a retry would duplicate it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgument, MiddlewareError, MQError

if TYPE_CHECKING:
    from .broker import Broker
    from .message import Message
    from .subscription import Subscription

__all__ = ["Middleware", "Publishing"]

log = logging.getLogger("mqabstract")

#: ``settled`` ops.
OPS = ("ack", "nack", "dead_letter", "expired", "release")


@dataclass(slots=True)
class Publishing:
    """One publish call, as middleware sees it.

    ``topic`` is the destination when every message of the call shares one (else None);
    ``count`` how many messages; ``headers`` what to add to each (a message's own header
    of the same name wins); ``ids`` the message ids once the broker confirmed them.
    """

    backend: str
    topic: str | None
    count: int
    headers: dict[str, str] = field(default_factory=dict)
    ids: list[str] | None = None


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

    def settled(self, sub: Subscription, op: str, messages: Sequence[Message],
                started_ns: int, error: MQError | None) -> None:
        """A settle call ended (``op`` in ``OPS``), failing with ``error`` or not."""


def _overrides(mw: Middleware, hook: str) -> bool:
    return getattr(type(mw), hook) is not getattr(Middleware, hook)


class Chain:
    """The middleware installed on one broker, each hook's users precomputed so a broker
    without middleware (or without a given hook) pays one truth test."""

    __slots__ = ("handlers", "items", "publishers", "receivers", "settlers")

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
        self.items = tuple(items)
        self.publishers = tuple(m for m in self.items if _overrides(m, "publishing"))
        self.handlers = tuple(m for m in self.items if _overrides(m, "handling"))
        self.receivers = tuple(m for m in self.items if _overrides(m, "received"))
        self.settlers = tuple(m for m in self.items if _overrides(m, "settled"))

    def __bool__(self) -> bool:
        return bool(self.items)

    @staticmethod
    def _enter(hooks: Sequence[Callable[[Any], ContextManager[object] | None]], arg: Any
               ) -> list[ContextManager[object]]:
        """Enter each hook's scope in order; if one fails, exit those entered and raise
        ``MiddlewareError`` (``MQError``s pass as they are)."""
        entered: list[ContextManager[object]] = []
        for hook in hooks:
            try:
                scope = hook(arg)
                if scope is not None:
                    scope.__enter__()
                    entered.append(scope)
            except Exception as exc:
                error = exc if isinstance(exc, MQError) else MiddlewareError(
                    f"middleware {type(getattr(hook, '__self__', hook)).__name__} failed: "
                    f"{type(exc).__name__}: {exc}")
                _exit(entered, error)
                if error is exc:
                    raise
                raise error from exc
        return entered

    def publish(self, pub: Publishing, send: Callable[[], list[str]]) -> list[str]:
        """``send()`` inside every ``publishing`` scope."""
        scopes = self._enter([m.publishing for m in self.publishers], pub)
        try:
            pub.ids = send()
        except BaseException as exc:
            _exit(scopes, exc)
            raise
        _exit(scopes, None)
        return pub.ids

    async def apublish(self, pub: Publishing, send: Callable[[], Awaitable[list[str]]]
                       ) -> list[str]:
        """``await send()`` inside every ``publishing`` scope (entered on this task)."""
        scopes = self._enter([m.publishing for m in self.publishers], pub)
        try:
            pub.ids = await send()
        except BaseException as exc:
            _exit(scopes, exc)
            raise
        _exit(scopes, None)
        return pub.ids

    def wrap(self, handler: Callable[[Message], object]) -> Callable[[Message], object]:
        """``handler`` inside every ``handling`` scope (itself when there is none)."""
        if not self.handlers:
            return handler
        hooks = [m.handling for m in self.handlers]

        def handle(msg: Message) -> object:
            scopes = self._enter(hooks, msg)
            try:
                out = handler(msg)
            except BaseException as exc:
                _exit(scopes, exc)
                raise
            _exit(scopes, None)
            return out

        return handle

    async def ahandle(self, msg: Message, call: Callable[[], Awaitable[object]]) -> object:
        """``await call()`` inside every ``handling`` scope for ``msg``."""
        scopes = self._enter([m.handling for m in self.handlers], msg)
        try:
            out = await call()
        except BaseException as exc:
            _exit(scopes, exc)
            raise
        _exit(scopes, None)
        return out

    def now(self) -> int:
        """The start time to pass to ``received``/``settled`` (0 when nobody listens)."""
        return time.time_ns() if self.receivers or self.settlers else 0

    def received(self, sub: Subscription, messages: Sequence[Message], started: int) -> None:
        for mw in self.receivers:
            try:
                mw.received(sub, messages, started)
            except Exception:
                log.exception("middleware %s: received failed", type(mw).__name__)

    def settled(self, sub: Subscription, op: str, messages: Sequence[Message], started: int,
                error: MQError | None = None) -> None:
        for mw in self.settlers:
            try:
                mw.settled(sub, op, messages, started, error)
            except Exception:
                log.exception("middleware %s: settled failed", type(mw).__name__)

    def bind(self, broker: Broker) -> None:
        """Bind each middleware; one that fails is a ``MiddlewareError`` (the caller
        closes what it opened)."""
        for mw in self.items:
            try:
                mw.bind(broker)
            except MQError:
                raise
            except Exception as exc:
                raise MiddlewareError(f"middleware {type(mw).__name__} failed to bind: "
                                      f"{type(exc).__name__}: {exc}") from exc

    def unbind(self, broker: Broker) -> None:
        for mw in self.items:
            try:
                mw.unbind(broker)
            except Exception:
                log.exception("middleware %s: unbind failed", type(mw).__name__)


def _exit(scopes: list[ContextManager[object]], exc: BaseException | None) -> None:
    """Exit ``scopes`` innermost first. They see ``exc`` but cannot swallow it, and what
    they raise is logged, never propagated."""
    info = (None, None, None) if exc is None else (type(exc), exc, exc.__traceback__)
    for scope in reversed(scopes):
        try:
            scope.__exit__(*info)
        except Exception:
            log.exception("middleware scope %s failed on exit", type(scope).__name__)


NO_MIDDLEWARE = Chain()
