"""AWS SQS driver (boto3): one queue per group, fanned out by one SNS FIFO topic.

Mapping (details and reasons in ``docs/backends/sqs.md``):

* Every publish goes to one SNS FIFO topic per namespace (``<prefix>bus.fifo``). Each group is
  an SQS queue subscribed to it with raw message delivery and a filter policy on the
  ``mq-topic`` message attribute; groups declared ``ordered=True`` get a FIFO queue, others a
  standard queue (SNS FIFO topics deliver to both). ``MessageGroupId`` is the key (the message
  id when there is none) and the deduplication id is derived from topic + message id.
* Filter policies express exact topics and literal prefixes/suffixes; the rest of a pattern
  (``*``, inner ``#``) is finished here: a message that does not match is deleted from that
  group's queue, never delivered.
* Leases are SQS visibility timeouts; ``extend`` and ``nack(delay)`` use
  ChangeMessageVisibility. Attempts come from ``ApproximateReceiveCount`` plus a base carried
  in our metadata, corrected for delay hops.
* SNS carries no per-message delay, so delays are deferral hops at the queue: a message that
  is not yet due is re-sent with ``DelaySeconds`` (≤ 900) and the early copy deleted (standard
  queues: the receive count starts afresh), or hidden with ChangeMessageVisibility (FIFO
  queues, which have no per-message delay; the hops are subtracted from the attempt).
* Dead letters: the portable layer decides, this driver copies the message with reason and
  attempts into a standard ``<queue>-dlq`` queue and deletes the original (a consumer killed
  between the two may leave a second entry for the id: listings keep the first and delete
  the other). No RedrivePolicy:
  it would lose the reason, count delay hops as failures, and force FIFO dead-letter queues
  that cannot be listed while one message of a message group is in flight.
* Metadata is packed into one String attribute ``mq`` (JSON); headers travel as native String
  attributes when they fit in the remaining 8 slots, else inside ``mq``.
"""

from __future__ import annotations

from .driver import SQSDriver
from .subscription import SQSSubscription
from .wire import MAX_BODY, QUEUE_NAME_MAX, SNS_MAX_MESSAGE, _queue_base, filter_policy

__all__ = [
    "MAX_BODY",
    "QUEUE_NAME_MAX",
    "SNS_MAX_MESSAGE",
    "SQSDriver",
    "SQSSubscription",
    "_queue_base",
    "filter_policy",
]
