"""How the portable layer calls the installed middleware: ``Hooks`` and ``Publishing``.

``Hooks`` lists each hook's users once (a broker without middleware, or without a given
hook, pays one truth test) and keeps the rules of calling them: scopes are entered in
order and exited innermost first, and what an exit or a notice raises is logged, never
propagated. ``Publishing`` is what a ``publishing`` scope sees of one publish call.

Separate from ``middleware.py``: the public ``Middleware`` base class types its hooks
with ``Broker``, ``Subscription`` and ``Message``, so it sits above them; the broker,
the publish path and the subscriptions call middleware through this module, below them.
``middleware.Chain`` fills a ``Hooks`` from ``Middleware`` instances.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .errors import MiddlewareError, MQError

if TYPE_CHECKING:
    from .message import Message

__all__ = ["NO_MIDDLEWARE", "PUSHED", "Hooks", "Publishing"]

log = logging.getLogger("mqabstract")

#: True while a consume loop receives for its handlers: ``received`` notices then go to
#: ``delivered`` (the application did not ask for that receive; push-based delivery).
PUSHED: ContextVar[bool] = ContextVar("mqabstract_pushed", default=False)


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


class Hooked(Protocol):
    """A middleware as ``Hooks`` calls it (``Middleware`` has it; the broker and the
    subscription pass through as they come, typed where users meet them)."""

    def bind(self, broker: Any) -> None: ...

    def unbind(self, broker: Any) -> None: ...

    def publishing(self, pub: Publishing) -> ContextManager[object] | None: ...

    def handling(self, msg: Message) -> ContextManager[object] | None: ...

    def received(self, sub: Any, messages: Sequence[Message], started_ns: int) -> None: ...

    def delivered(self, sub: Any, messages: Sequence[Message], started_ns: int) -> None: ...

    def settled(self, sub: Any, op: str, messages: Sequence[Message], started_ns: int,
                error: MQError | None) -> None: ...


class Hooks:
    """The installed middleware, each hook's users precomputed so a broker without
    middleware (or without a given hook) pays one truth test."""

    __slots__ = ("_handling", "_publishing", "handlers", "items", "publishers", "receivers",
                 "settlers")

    def __init__(self, items: Sequence[Hooked] = (), publishers: Sequence[Hooked] = (),
                 handlers: Sequence[Hooked] = (), receivers: Sequence[Hooked] = (),
                 settlers: Sequence[Hooked] = ()) -> None:
        self.items = tuple(items)
        self.publishers = tuple(publishers)
        self.handlers = tuple(handlers)
        self.receivers = tuple(receivers)
        self.settlers = tuple(settlers)
        self._publishing = tuple(m.publishing for m in self.publishers)  # bound once
        self._handling = tuple(m.handling for m in self.handlers)

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
        scopes = self._enter(self._publishing, pub)
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
        scopes = self._enter(self._publishing, pub)
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
        hooks = self._handling

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
        scopes = self._enter(self._handling, msg)
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

    def received(self, sub: Any, messages: Sequence[Message], started: int) -> None:
        """Tell of a receive: ``delivered`` when a consume loop made it (``PUSHED``)."""
        pushed = PUSHED.get()
        for mw in self.receivers:
            try:
                if pushed:
                    mw.delivered(sub, messages, started)
                else:
                    mw.received(sub, messages, started)
            except Exception:
                log.exception("middleware %s: received failed", type(mw).__name__)

    def settled(self, sub: Any, op: str, messages: Sequence[Message], started: int,
                error: MQError | None = None) -> None:
        for mw in self.settlers:
            try:
                mw.settled(sub, op, messages, started, error)
            except Exception:
                log.exception("middleware %s: settled failed", type(mw).__name__)

    def bind(self, broker: Any) -> None:
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

    def unbind(self, broker: Any) -> None:
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


#: The broker's middleware when ``connect`` got none.
NO_MIDDLEWARE = Hooks()
