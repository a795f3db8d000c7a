"""RabbitMQ backend (``amqp://`` / ``amqps://``), built on pika.

Mapping (details and trade-offs in ``docs/backends/rabbitmq.md``):

* one durable topic exchange (option ``exchange``, default ``mqabstract``); routing key =
  topic. A group is a durable queue ``<exchange>.g.<group>`` bound with its pattern;
  consumers of a group compete on that queue. Quorum queues by default (exact redelivery
  counts), classic queues with ``x-max-priority`` for ``priority=True`` groups, and
  ``x-single-active-consumer`` for ``ordered=True`` groups.
* Publishing runs from the calling thread on a blocking connection of its own, with
  confirms tracked by delivery tag, so a batch is pipelined: one round trip, not one per
  message. Each subscription consumes on a ``SelectConnection`` of its own; all of them
  run on one I/O thread, which other threads reach through ``add_callback_threadsafe``.
* A nack without delay and an expired lease are a requeue the broker counts (one step). A
  delayed nack, a dead letter and an idle consumer's unread buffer are "copy, confirm,
  then ack the original": the copy carries the attempt count in ``mq-attempt``, so
  counts are exact on every queue type; broker-side redelivery (a consumer's connection
  died) adds ``x-delivery-count`` (quorum) or the ``redelivered`` flag (classic: such a message is
  re-sent with its attempt written down before anyone gets it, so the next broker-side
  redelivery counts on from there). Copies go out on the subscription's own connection,
  and a cut between a copy's confirm and its original's ack leaves both: the subscription
  drops whichever is superfluous when it comes back (``consumer._Superseded``).
* Delays use one wait queue per delay tier (queue TTL, dead-lettered to the exchange for a
  delayed publish, or to the group queue for ``nack(delay)``). A message that comes out of
  a tier before its ``mq-deliver-at`` is sent to the next tier by the consumer that sees
  it, so nothing is ever delivered early.
* Leases are kept by the driver: an unsettled message is copied back with attempt + 1 when
  its lease runs out. A dead consumer's messages are redelivered by the broker; a frozen
  one's (SIGSTOP, GC or VM stall) are taken back by a watchdog process that cuts its
  subscription connection half a second after the earliest lease deadline it holds, so
  they are deliverable again within ``RELEASE_MARGIN`` of that deadline.
* Declarations, dead-letter list/replay/purge and stats use a second, blocking connection.

Modules, each importing only those before it: ``wire`` (header and queue names, delay
tiers, property copies, a delivered message), ``io`` (pika publisher confirms, blocking
publisher and admin connections, the I/O thread), ``watchdog`` (the lease watchdog
process), ``holdings`` (what a subscription's two threads share), ``consumer`` (a
subscription's consumer link on the I/O thread), ``subscription`` (``RabbitMQSubscription``,
the callers' side), ``driver`` (``RabbitMQDriver``).
"""

from __future__ import annotations

from .driver import RabbitMQDriver
from .subscription import RabbitMQSubscription
from .watchdog import RELEASE_MARGIN, _Watchdog
from .wire import TIERS_MS

__all__ = ["RELEASE_MARGIN", "TIERS_MS", "RabbitMQDriver", "RabbitMQSubscription", "_Watchdog"]
