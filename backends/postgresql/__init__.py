"""PostgreSQL backend on psycopg 3: a database schema as a durable, multi-process broker.

``postgresql://user:pass@host:5432/db?schema=mq`` (``postgres://`` too). Options (URL query
or ``connect`` keywords): ``schema``, ``pool_size``, ``connect_timeout``, ``poll_interval``,
``listen``, ``clock`` — see ``PostgreSQLDriver.OPTIONS`` and ``docs/backends/postgresql.md``.

The mapping (SQLite's shape, on a server):

* **group** → a row of ``mq_groups`` (name, pattern, policy); a publish is routed in the
  driver (``emulation.Routes`` over the groups, reloaded whenever the groups version in
  ``mq_meta`` moved) and written as one row per (group, message) in ``mq_queue``, in one
  statement that only lands while that version is still current: a group sees exactly
  the messages published after it was declared, by any process.
* **topic** → a column; patterns are matched by the toolkit, not by SQL.
* **lease** → columns of the row: ``state`` (0 ready, 1 leased, 2 delayed), ``due`` (lease
  end or delay end, epoch seconds of the driver's clock) and a random ``token`` per claim.
  Claims are ``UPDATE … WHERE seq = ANY(ARRAY(SELECT … FOR UPDATE SKIP LOCKED))``: up to
  N rows per statement, two claimers never wait on each other nor get the same row, and a
  settle matches (seq, token), so a receipt whose lease moved on settles nothing.
* **delay, nack(delay)** → ``state = 2`` with ``due``; a claim first makes due rows ready.
* **priority, ordered keys** → the claim's ``ORDER BY priority DESC, seq`` and, for ordered
  groups, "no earlier row of the same key" (``key_gate = "broker"``).
* **dead letters** → rows of ``mq_dead`` (reason, attempts), moved in one statement.
* **waking** → ``LISTEN/NOTIFY`` on channel ``mq_<schema>`` (payload: group id), and a
  bounded poll (``poll_interval``) that delivers even when notifications are lost.
"""

from .driver import PostgreSQLDriver

__all__ = ["PostgreSQLDriver"]
