"""Driver exceptions into ``MQError``: the one place a stray one is translated.

Every driver call the portable layer makes runs under the broker's ``_Guard`` (and every
chunk of a publish through ``_translate``), so nothing but ``MQError`` reaches the
application. A module of its own because the broker, its subscriptions and the publish
path (``outgoing``) all use it, and it depends on none of them.
"""

from __future__ import annotations

from typing import Any, Literal

from .errors import MQError
from .url import redact


def _translate(exc: Exception, backend: str) -> MQError:
    """Wrap an exception a driver let escape; MQErrors pass through unchanged."""
    if isinstance(exc, MQError):
        return exc
    err = MQError(f"{backend}: unexpected {type(exc).__name__}: {redact(str(exc))}")
    err.__cause__ = exc
    return err


class _Guard:
    """Context manager translating stray driver exceptions into ``MQError`` (one place).

    ``MQError`` passes through untouched, keeping the native exception its driver chained.
    A class rather than ``@contextmanager``: it sits on the ack/receive hot path.
    """

    __slots__ = ("backend",)

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> Literal[False]:
        if exc is None or isinstance(exc, MQError) or not isinstance(exc, Exception):
            return False
        raise _translate(exc, self.backend) from exc

