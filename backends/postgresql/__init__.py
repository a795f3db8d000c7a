"""PostgreSQL backend (psycopg 3): a database schema as a durable, multi-process broker.

``postgresql://user:pass@host:5432/db?schema=mq`` (``postgres://`` too); options in
``PostgreSQLDriver.OPTIONS`` and ``docs/backends/postgresql.md``. SQLite's store shape:

* **group** → a row of ``mq_groups``; a publish is routed by ``emulation.Routes`` in the
  driver and written as one ``mq_queue`` row per (group, message), by one statement that
  lands only while the groups version it was routed with is current (any process).
* **lease** → the row's ``state`` (0 ready, 1 leased, 2 delayed), ``due`` (epoch seconds of
  the driver's clock) and a random ``token`` per claim; claims take up to N rows with
  ``FOR UPDATE SKIP LOCKED``; a settle matches (seq, token).
* **delay, nack(delay)** → ``state = 2`` until ``due``; **priority, ordered keys** → the
  claim's order and its "no earlier row of this key" rule (``key_gate = "broker"``).
* **dead letters** → rows of ``mq_dead``, moved in one statement.
* **waking** → ``LISTEN/NOTIFY`` (channel ``mq_<schema>``, payload a group id) and a poll
  at most ``poll_interval`` apart, which delivers when notifications are lost.
"""

from .driver import PostgreSQLDriver

__all__ = ["PostgreSQLDriver"]
