"""mqabstract: one interface to message brokers, chosen by URL.

    import mqabstract
    with mqabstract.connect("memory://") as mq:
        sub = mq.subscribe("billing", "orders.#")
        mq.publish("orders.eu.created", {"id": 42})
        for msg in sub.receive(max_messages=10, wait=1.0):
            print(msg.value)
            msg.ack()

``connect()`` with no URL reads ``MQ_URL``, then falls back to the embedded SQLite default.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import registry
from .batch import Batch
from .broker import Backoff, Broker, ConsumeStats, Message, Subscription
from .capabilities import Capabilities, Feature, Support
from .clock import Clock, FakeClock, SystemClock
from .errors import (
    AlreadySettled,
    Closed,
    ConnectionFailed,
    DecodeError,
    Duplicate,
    EncodeError,
    InvalidArgument,
    InvalidName,
    InvalidPayload,
    InvalidURL,
    LeaseExpired,
    MessageTooLarge,
    MiddlewareError,
    MissingDependency,
    MQError,
    NotFound,
    NotSent,
    PublishError,
    StoreError,
    Timeout,
    Unsupported,
    ValidationError,
)
from .middleware import Chain, Middleware, Publishing
from .model import DeadLetter, GroupSpec, GroupStats, OutgoingMessage
from .registry import register
from .url import BrokerURL

__version__ = "0.1.0"

__all__ = [
    "AlreadySettled",
    "Backoff",
    "Batch",
    "Broker",
    "BrokerURL",
    "Capabilities",
    "Clock",
    "Closed",
    "ConnectionFailed",
    "ConsumeStats",
    "DeadLetter",
    "DecodeError",
    "Duplicate",
    "EncodeError",
    "FakeClock",
    "Feature",
    "GroupSpec",
    "GroupStats",
    "InvalidArgument",
    "InvalidName",
    "InvalidPayload",
    "InvalidURL",
    "LeaseExpired",
    "MQError",
    "Message",
    "MessageTooLarge",
    "Middleware",
    "MiddlewareError",
    "MissingDependency",
    "NotFound",
    "NotSent",
    "OutgoingMessage",
    "PublishError",
    "Publishing",
    "StoreError",
    "Subscription",
    "Support",
    "SystemClock",
    "Timeout",
    "Unsupported",
    "ValidationError",
    "connect",
    "default_url",
    "register",
]


def default_url() -> str:
    """The embedded default: a SQLite file under ``$MQ_HOME`` (default
    ``$XDG_DATA_HOME/mqabstract`` or ``~/.local/share/mqabstract``), ``default.db``.

    Falls back to ``memory://`` only if the SQLite backend is unavailable.
    """
    home = os.environ.get("MQ_HOME")
    if not home:
        data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        home = str(Path(data) / "mqabstract")
    try:
        registry.resolve("sqlite")
    except MQError:
        return "memory://"
    return f"sqlite:///{Path(home, 'default.db').resolve()}"


def connect(url: str | None = None, *, middleware: Sequence[Middleware] = (),
            **options: Any) -> Broker:
    """Open a broker by URL: the argument, else ``$MQ_URL``, else the embedded default.

    Options may be given as URL query parameters or keywords (keywords win); each backend
    rejects options it does not know. ``middleware`` (``mqabstract.Middleware``, the
    first outermost) runs around every publish and handled message, e.g.
    ``mqabstract.otel.OpenTelemetry()``. Raises ``InvalidURL`` for unknown schemes (listing
    the known ones) and ``ConnectionFailed`` (with the URL redacted) when unreachable.
    """
    chain = Chain(middleware)
    raw = url or os.environ.get("MQ_URL") or default_url()
    parsed = BrokerURL.parse(raw)
    driver_cls = registry.resolve(parsed.scheme)
    driver = driver_cls.open(parsed, options)
    return Broker(driver, parsed, chain)
