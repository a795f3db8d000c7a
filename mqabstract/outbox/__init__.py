"""The transactional outbox: publish in the same transaction as your own writes.

    with conn.transaction():                       # psycopg 3 (or a sqlite3 connection)
        conn.execute("INSERT INTO orders ...")
        outbox.publish(conn, "orders.created", {"id": 42}, key="order-42")

``publish`` checks the message like ``Broker.publish`` (names, sizes, priority, delay,
TTL, id, headers: the same ``Packer``; a bad message raises its ``ValidationError`` and
writes nothing) and writes it as a row of the outbox table inside the caller's open
transaction: it exists if and only if that transaction commits. A ``Relay`` (``mqa relay
--from postgresql://… --to kafka://…``) publishes committed rows to any backend, a key's in
commit order, with their ids, and deletes them only after the target confirmed them.

When the target is the ``postgresql://`` broker in the same database, ``publish_direct``
writes the message straight into the broker's queue inside the transaction: atomic by
itself, no relay.

Tables: PostgreSQL ``<schema>.mq_outbox``; SQLite ``<schema>_outbox`` (``schema``
default ``mq``). Create them once with ``setup(conn)`` (a relay does it when it starts).
See ``docs/outbox.md``.
"""

from __future__ import annotations

import importlib
import sqlite3
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from types import ModuleType
from typing import Any

from ..capabilities import Capabilities
from ..clock import Clock
from ..errors import InvalidArgument, MissingDependency
from ..model import OutgoingMessage
from ..outgoing import Packer
from . import rows as _rows
from . import sqlite as _sqlite
from .relay import Relay, RelayStats, open_source
from .source import Source

__all__ = ["Relay", "RelayStats", "Source", "open_source", "publish", "publish_batch",
           "publish_direct", "setup"]


def _postgres(conn: object) -> ModuleType | None:
    """The PostgreSQL outbox module when ``conn`` is a psycopg connection, else None."""
    if not type(conn).__module__.startswith("psycopg"):
        return None
    try:  # (by name: the portable layer does not import drivers)
        return importlib.import_module("mqabstract.backends.postgresql.outbox")
    except ImportError as exc:  # pragma: no cover - psycopg gave us the connection
        raise MissingDependency("the PostgreSQL outbox needs mqabstract[postgresql]") from exc


def _kind(conn: object) -> ModuleType:
    if isinstance(conn, sqlite3.Connection):
        return _sqlite
    pg = _postgres(conn)
    if pg is None:
        raise InvalidArgument(f"conn must be a psycopg 3 or sqlite3 connection, not "
                              f"{type(conn).__name__}")
    return pg


def setup(conn: Any, *, schema: str = "mq") -> None:
    """Create the outbox table(s) on ``conn``'s database (idempotent)."""
    _kind(conn).setup(conn, schema)


def publish(
    conn: Any,
    topic: str,
    body: object,
    *,
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    priority: int | None = None,
    delay: float | None = None,
    deliver_at: datetime | None = None,
    id: str | None = None,
    ttl: float | None = None,
    schema: str = "mq",
    limits: Capabilities | None = None,
    clock: Clock | None = None,
) -> str:
    """Write one message into the outbox inside ``conn``'s open transaction; return its id.

    Fields as in ``Broker.publish``. ``limits``: the target's ``capabilities`` to check
    against (default: the portable rules, 16 MiB bodies). ``delay``/``ttl`` count from now
    (``clock``), not from the relay's publish. A PostgreSQL writer of a ``key`` holds that
    key's outbox lock until its transaction ends (other writers of the key wait): that is
    what makes a key's commit order its relay order."""
    kind = _kind(conn)
    row = _rows.check_one(
        OutgoingMessage(topic, body, headers, key, priority, delay, deliver_at, id, ttl),
        limits, clock.time() if clock else time.time())
    kind.insert(conn, schema, [row])
    return row.id


def publish_batch(conn: Any, messages: Iterable[OutgoingMessage | Mapping[str, Any]
                                                | tuple[str, Any]],
                  *, schema: str = "mq", limits: Capabilities | None = None,
                  clock: Clock | None = None) -> list[str]:
    """Write many messages into the outbox in ``conn``'s transaction, in order; return their
    ids. A bad one raises with its ``index`` and none is written."""
    kind = _kind(conn)
    found = _rows.check(messages, limits, clock.time() if clock else time.time())
    if found:
        kind.insert(conn, schema, found)
    return [r.id for r in found]


def publish_direct(
    conn: Any,
    topic: str,
    body: object,
    *,
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    priority: int | None = None,
    delay: float | None = None,
    deliver_at: datetime | None = None,
    id: str | None = None,
    ttl: float | None = None,
    schema: str = "mq",
    clock: Clock | None = None,
) -> str:
    """Publish to the ``postgresql://…?schema=`` broker whose tables are in ``conn``'s own
    database, inside ``conn``'s transaction: delivered to the groups that match if and only
    if the transaction commits (no outbox row, no relay). psycopg connections only."""
    pg = _postgres(conn)
    if pg is None:
        raise InvalidArgument("publish_direct needs a psycopg connection to the database "
                              "of the postgresql:// broker")
    caps: Capabilities = pg.CAPABILITIES
    env = Packer(caps, "postgresql").envelope(
        topic, body, headers, key, priority, delay, deliver_at, id,
        clock.time() if clock else time.time(), ttl)
    pg.publish_direct(conn, schema, [env])
    return env.id
