"""The emulation toolkit: what a driver composes where its broker lacks a feature.

Each piece is written and unit-tested once (on an injected clock where time matters), so
two drivers emulating the same thing do it the same way:

* :mod:`.leases`: driver-kept leases (RabbitMQ, Kafka) — grant, settle, extend, expire;
* :mod:`.delays`: delay tiers and deferral hops for brokers with short or no native delays;
* :mod:`.deadletters`: dead-letter metadata in the wire schema, decoding, selection, replay;
* :mod:`.pattern`: topic patterns — literal head and tail, native filter supersets, matching;
* :mod:`.routes`: topic → matching groups, cached until the group set changes (``Routes``),
  for drivers that fan a publish out themselves (memory, SQLite);
* :mod:`.names`: fitting names into a broker's length and alphabet limits, injectively;
* :mod:`.wakeup`: idle receivers of store-based drivers and what wakes them (``Waker``:
  SQLite, PostgreSQL);
* :mod:`.ordering`: one message of a key at a time in ordered groups (``KeyGate``), used by
  the portable layer for every broker that would hand out more (``Capabilities.key_gate``).

Drivers move bytes with their native client; the portable layer (``mqabstract.broker``)
owns the lease deadline the application sees. ``docs/architecture.md`` lists which
behaviour lives where.
"""

from __future__ import annotations

from .deadletters import dead_headers, dead_letter_from, pick, replay_headers
from .delays import Tiers, next_hop
from .leases import LeaseTable
from .names import fit_name
from .ordering import KeyGate
from .pattern import NativeFilter, Pattern
from .routes import Routes

__all__ = [
    "KeyGate",
    "LeaseTable",
    "NativeFilter",
    "Pattern",
    "Routes",
    "Tiers",
    "dead_headers",
    "dead_letter_from",
    "fit_name",
    "next_hop",
    "pick",
    "replay_headers",
]
