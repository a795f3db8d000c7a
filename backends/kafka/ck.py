"""The client surface (``client.py``) on confluent-kafka (librdkafka).

librdkafka does the protocol work in its own threads (fetching, batching, heartbeats,
reconnects); this module only translates. Its rebalance callbacks run inside ``consume``
on the polling thread. A consumer without a group is not allowed by the Python
binding: readers carry a group id they never join or commit (``READER_GROUP``).

This module makes the clients (``CLIENT``); they live in ``ck_produce`` (the producers),
``ck_admin``, ``ck_consume`` (reader, group member), over ``ck_base`` (errors, config).
"""

from __future__ import annotations

from .ck_admin import _Admin
from .ck_base import READER_GROUP, classify
from .ck_consume import _Member, _Reader
from .ck_produce import _Mover, _Producer
from .client import Admin, Client, ClientError, Listener, Member, Mover, Producer, Reader, Settings

__all__ = ["CLIENT", "READER_GROUP"]


class _Client(Client):
    name = "confluent"

    def producer(self, settings: Settings) -> Producer:
        try:
            return _Producer(settings)
        except ClientError:
            raise
        except Exception as exc:
            raise classify(exc) from exc

    def admin(self, settings: Settings) -> Admin:
        try:
            return _Admin(settings)
        except Exception as exc:
            raise classify(exc) from exc

    def reader(self, settings: Settings) -> Reader:
        return _Reader(settings)

    def member(self, settings: Settings, group: str, topic: str, revoked: Listener,
               assigned: Listener) -> Member:
        return _Member(settings, group, topic, revoked, assigned)

    def mover(self, settings: Settings, transactional_id: str) -> Mover:
        return _Mover(settings, transactional_id)


CLIENT = _Client()
