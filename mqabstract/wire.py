"""The wire schema: the metadata headers every broker driver writes, named once.

Every backend that carries headers (RabbitMQ, Kafka; SQS packs them into one attribute)
uses these names with these meanings, so a plain client (pika, a Kafka client, boto3) can
read and write mqabstract messages, and one driver's records mean the same in another's
tooling. User headers may not start with ``mq-`` (the portable layer rejects them).

A message published by a plain client carries none of them and is received with defaults:
its native id, attempt from the broker's delivery count where it has one, published_at from
the broker's timestamp.

==================== ==================================================================
header               meaning
==================== ==================================================================
``mq-id``            the message id, stable across redeliveries (publisher may set it)
``mq-attempt``       deliveries so far, as an integer; absent = 0 (the next delivery is
                     attempt ``mq-attempt + 1``, plus any count the broker adds itself)
``mq-published-at``  when the publisher sent it: epoch seconds, float, exact
``mq-deliver-at``    not deliverable before this epoch time (delays, ``nack(delay)``)
``mq-expires-at``    epoch time after which it is not delivered (TTL)
``mq-reason``        why it was dead-lettered
``mq-dead-at``       when it was dead-lettered (epoch seconds)
``mq-key``           the ordering key, where the broker's own key field holds another value
``mq-topic``         the mqabstract topic, where the broker's routing cannot hold it exactly
                     (hashed names, retry and dead-letter copies)
``mq-reply-to``      where a reply to this request goes
``mq-correlation-id`` the request a reply answers
``mq-hops``          hand-offs between idle consumers (Kafka), for back-off
==================== ==================================================================

``PACKED`` gives each name a one-letter key for brokers that limit attribute counts (SQS
packs them into one JSON attribute; ``v`` is that packing's version).
"""

from __future__ import annotations

__all__ = [
    "ATTEMPT",
    "CARRIED",
    "CORRELATION_ID",
    "DEAD_AT",
    "DELIVER_AT",
    "EXPIRES_AT",
    "HOPS",
    "ID",
    "KEY",
    "NAMES",
    "PACKED",
    "PREFIX",
    "PUBLISHED_AT",
    "REASON",
    "REPLY_TO",
    "TOPIC",
]

PREFIX = "mq-"

ID = "mq-id"
ATTEMPT = "mq-attempt"
PUBLISHED_AT = "mq-published-at"
DELIVER_AT = "mq-deliver-at"
EXPIRES_AT = "mq-expires-at"
REASON = "mq-reason"
DEAD_AT = "mq-dead-at"
KEY = "mq-key"
TOPIC = "mq-topic"
REPLY_TO = "mq-reply-to"
CORRELATION_ID = "mq-correlation-id"
HOPS = "mq-hops"

NAMES = frozenset({ID, ATTEMPT, PUBLISHED_AT, DELIVER_AT, EXPIRES_AT, REASON, DEAD_AT, KEY,
                   TOPIC, REPLY_TO, CORRELATION_ID, HOPS})

#: Wire headers a driver hands back among a delivery's headers, untouched: the portable
#: layer reads them (``Message.expires_at``, ``reply_to``, ``correlation_id``) and takes
#: them out of the headers users see.
CARRIED = frozenset({EXPIRES_AT, REPLY_TO, CORRELATION_ID})

#: One-letter keys of the packed form (one attribute holding a JSON object).
PACKED = {
    ID: "i",
    ATTEMPT: "a",
    PUBLISHED_AT: "t",
    DELIVER_AT: "d",
    EXPIRES_AT: "z",  # "e" is the packing's body encoding
    REASON: "r",
    DEAD_AT: "x",
    KEY: "k",
    REPLY_TO: "y",
    CORRELATION_ID: "c",
}
