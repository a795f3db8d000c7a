"""URL scheme → driver registry (SQLAlchemy/fsspec style).

Built-in drivers are listed here; third-party drivers plug in through the
``mqabstract.backends`` entry-point group (``myscheme = "pkg.module:MyDriver"``) or at run
time with ``register()``. Driver modules are imported lazily, so the core needs only the
standard library and a missing client library gives a clear ``MissingDependency``.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from .driver import Driver
from .errors import InvalidURL, MissingDependency

__all__ = ["known_schemes", "register", "resolve"]

ENTRY_POINT_GROUP = "mqabstract.backends"

_BUILTIN: dict[str, tuple[str, str]] = {
    # scheme: (target, extra that installs its client)
    "memory": ("mqabstract.backends.memory:MemoryDriver", ""),
    "sqlite": ("mqabstract.backends.sqlite:SQLiteDriver", ""),
    "amqp": ("mqabstract.backends.rabbitmq:RabbitMQDriver", "rabbitmq"),
    "amqps": ("mqabstract.backends.rabbitmq:RabbitMQDriver", "rabbitmq"),
    "kafka": ("mqabstract.backends.kafka:KafkaDriver", "kafka"),
    "sqs": ("mqabstract.backends.sqs:SQSDriver", "sqs"),
    "postgresql": ("mqabstract.backends.postgresql:PostgreSQLDriver", "postgresql"),
    "postgres": ("mqabstract.backends.postgresql:PostgreSQLDriver", "postgresql"),
}

_registered: dict[str, type[Driver] | str] = {}
_lock = threading.Lock()


def register(scheme: str, driver: type[Driver] | str) -> None:
    """Register a driver class (or ``"module:Class"``) for a URL scheme; overrides others."""
    with _lock:
        _registered[scheme.lower()] = driver


def _entry_point_targets() -> dict[str, str]:
    return {ep.name.lower(): ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    """Every scheme that ``connect`` accepts right now."""
    return sorted(set(_BUILTIN) | set(_registered) | set(_entry_point_targets()))


def _load(target: str, scheme: str, extra: str) -> type[Driver]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise InvalidURL(f"backend for {scheme}:// is not available ({module_name})") from exc
        hint = f": pip install 'mqabstract[{extra}]'" if extra else ""
        raise MissingDependency(
            f"the {scheme}:// backend needs the {exc.name!r} package{hint}"
        ) from exc
    driver = getattr(module, attr, None)
    if not (isinstance(driver, type) and issubclass(driver, Driver)):
        raise InvalidURL(f"{target} registered for {scheme}:// is not a Driver subclass")
    return driver


def resolve(scheme: str) -> type[Driver]:
    """The driver class for ``scheme``; ``InvalidURL`` listing known schemes if none."""
    scheme = scheme.lower()
    with _lock:
        found = _registered.get(scheme)
    if isinstance(found, type):
        return found
    if isinstance(found, str):
        return _load(found, scheme, "")
    if scheme in _BUILTIN:
        target, extra = _BUILTIN[scheme]
        return _load(target, scheme, extra)
    targets = _entry_point_targets()
    if scheme in targets:
        return _load(targets[scheme], scheme, "")
    raise InvalidURL(f"unknown URL scheme {scheme!r}; known schemes: {', '.join(known_schemes())}")
