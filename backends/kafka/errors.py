"""Client failures as portable errors (``native``), and which of them a background thread
waits out (``transient``, ``Patience``).

Shared by the driver and its subscriptions: a module of its own, so that neither imports
the other for them.
"""

from __future__ import annotations

import time

from mqabstract.errors import (
    ConnectionFailed,
    InvalidArgument,
    MessageTooLarge,
    MQError,
    Timeout,
)
from mqabstract.url import BrokerURL, redact

from .client import ClientError, Kind

__all__ = ["UNKNOWN_PATIENCE", "Patience", "native", "transient"]

#: How long a background thread keeps trying after broker errors the classifier does
#: not know before it stops (``Patience``).
UNKNOWN_PATIENCE = 60.0


def native(exc: BaseException, what: str, url: BrokerURL) -> MQError:
    """A client failure as the portable error a public call raises."""
    if isinstance(exc, MQError):
        return exc
    err = exc if isinstance(exc, ClientError) else ClientError(
        Kind.OTHER, redact(f"{type(exc).__name__}: {exc}"))
    text = redact(f"{what} on {url.redacted()}: {err}")[:2000]
    if err.kind is Kind.BAD_SESSION:
        return InvalidArgument(redact(
            f"{what} on {url.redacted()}: the broker refuses the consumer session timeout; "
            "set the option session_timeout_ms (URL query or connect() keyword) within "
            "the broker's group.min.session.timeout.ms .. group.max.session.timeout.ms "
            "(Apache Kafka: 6000 .. 1800000 by default), and heartbeat_interval_ms below "
            "a third of it")[:2000])
    if err.kind is Kind.TOO_LARGE:
        return MessageTooLarge(text)
    if err.kind is Kind.TIMEOUT:
        return Timeout(text)
    if err.kind in (Kind.FATAL, Kind.OTHER, Kind.METADATA_TOO_LARGE):
        return MQError(text)
    return ConnectionFailed(text)


def transient(exc: BaseException) -> bool:
    """Whether a background thread should retry after ``exc`` instead of stopping: the
    broker is unreachable, restarting or moving a coordinator (the same call can work
    later). A background thread that stopped on such an error would leave the
    subscription dead for good after the broker came back."""
    if isinstance(exc, MQError):
        return exc.retryable
    if isinstance(exc, ClientError):
        return exc.retriable
    return isinstance(exc, (ConnectionError, TimeoutError))


class Patience:
    """Whether a background thread's call site retries after a failure: a ``transient``
    one always; an error code the classifier does not know (``Kind.OTHER`` from the
    protocol or the client library, ``ClientError.broker``; not an exception of the
    client's own code, such as an internal assertion, after which its state is not to be
    trusted) until such
    errors have lasted ``limit`` seconds in a row (``ok`` after each success ends a run).
    A retriable code missing from the classifier's lists must not stop a consumer for
    good (it did twice: ``_DESTROY_BROKER``, ``FENCED_LEADER_EPOCH``), and one that is
    really permanent still surfaces."""

    __slots__ = ("limit", "since")

    def __init__(self, limit: float | None = None) -> None:
        self.limit = UNKNOWN_PATIENCE if limit is None else limit
        self.since = 0.0  # (monotonic) the first unknown error of the current run

    def ok(self) -> None:
        self.since = 0.0

    def retry(self, exc: BaseException) -> bool:
        if transient(exc):
            return True
        if not (isinstance(exc, ClientError) and exc.kind is Kind.OTHER and exc.broker):
            return False  # (an exception of the client's own code stops the thread)
        now = time.monotonic()
        self.since = self.since or now
        return now - self.since < self.limit
