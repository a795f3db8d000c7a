"""What the confluent-kafka modules share: librdkafka's errors as :class:`ClientError`
(``classify``), the configuration every client starts from, and topic-partition lists.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import confluent_kafka as ck

from mqabstract.url import redact

from .client import TP, ClientError, Kind, Settings

__all__ = ["READER_GROUP", "classify"]

log = logging.getLogger("mqabstract.kafka")

#: The group id of group-less readers: never joined, never committed (not listed by the
#: broker: a group exists there only once it has members or offsets).
READER_GROUP = "__mqa..reader"

_E = ck.KafkaError
_FENCED = {_E.ILLEGAL_GENERATION, _E.UNKNOWN_MEMBER_ID, _E.REBALANCE_IN_PROGRESS,
           _E.FENCED_INSTANCE_ID, _E._ASSIGNMENT_LOST}


_TOO_LARGE = {_E.MSG_SIZE_TOO_LARGE, _E.RECORD_LIST_TOO_LARGE,
              getattr(_E, "_MSG_SIZE_TOO_LARGE", _E.MSG_SIZE_TOO_LARGE)}


_TIMEOUT = {_E._TIMED_OUT, _E.REQUEST_TIMED_OUT, _E._MSG_TIMED_OUT, _E._TIMED_OUT_QUEUE}
_DOWN = {_E._TRANSPORT, _E._ALL_BROKERS_DOWN, _E._RESOLVE, _E.NOT_COORDINATOR,
         _E.COORDINATOR_NOT_AVAILABLE, _E.COORDINATOR_LOAD_IN_PROGRESS, _E._WAIT_COORD,
         _E.LEADER_NOT_AVAILABLE, _E.NOT_LEADER_FOR_PARTITION, _E.UNKNOWN_TOPIC_OR_PART,
         _E._UNKNOWN_PARTITION, _E.BROKER_NOT_AVAILABLE, _E.NETWORK_EXCEPTION,
         getattr(_E, "_DESTROY", _E._TRANSPORT),
         # A request to a broker handle librdkafka decommissioned (a node gone from the
         # metadata, KIP-1102's re-bootstrap): local, and over once it knows the cluster
         # again. Unlisted, it stopped a data consumer for good when a leader was killed
         # (CI rehearsal, 27 Nov, test_plain_url_sigkill_leader).
         getattr(_E, "_DESTROY_BROKER", _E._TRANSPORT),
         # Stale metadata after a leader change (Kafka's retriable InvalidMetadata family;
         # librdkafka does not flag them retriable on an offsets request). Unlisted,
         # FENCED_LEADER_EPOCH stopped a data consumer after a paused broker came back
         # (session 22's sitting, container pause).
         _E.FENCED_LEADER_EPOCH, _E.UNKNOWN_LEADER_EPOCH, _E.OFFSET_NOT_AVAILABLE,
         _E.KAFKA_STORAGE_ERROR}


def _error(err: Any, where: str = "") -> ClientError:
    """A librdkafka ``KafkaError`` as :class:`ClientError`."""
    code = err.code()
    text = redact(f"{where}{err.name()}: {err.str()}")[:1500]
    if code in _FENCED:
        kind = Kind.FENCED
    elif code == _E.OFFSET_METADATA_TOO_LARGE:
        kind = Kind.METADATA_TOO_LARGE
    elif code in _TOO_LARGE:
        kind = Kind.TOO_LARGE
    elif code == _E.INVALID_SESSION_TIMEOUT:
        kind = Kind.BAD_SESSION
    elif code in _TIMEOUT:
        kind = Kind.TIMEOUT
    elif err.fatal():
        kind = Kind.FATAL
    elif err.retriable() or code in _DOWN:
        kind = Kind.TRANSIENT
    else:
        kind = Kind.OTHER
    return ClientError(kind, text, err.name(), broker=True)


def classify(exc: BaseException) -> ClientError:
    """confluent-kafka's exceptions as :class:`ClientError`."""
    if isinstance(exc, ClientError):
        return exc
    if isinstance(exc, ck.KafkaException) and exc.args and isinstance(exc.args[0], _E):
        return _error(exc.args[0])
    if isinstance(exc, BufferError):
        return ClientError(Kind.TRANSIENT, f"producer queue full: {exc}", "BufferError")
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return ClientError(Kind.TRANSIENT, redact(str(exc))[:1500], type(exc).__name__)
    return ClientError(Kind.OTHER, redact(f"{type(exc).__name__}: {exc}")[:1500],
                       type(exc).__name__)


def _config(s: Settings) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "bootstrap.servers": ",".join(s.servers),
        "client.id": s.client_id,
        "socket.timeout.ms": s.request_timeout_ms,
        "socket.nagle.disable": True,  # small requests (commits, single publishes) at once
        "log_level": 3,  # errors only: librdkafka logs reconnects as warnings
    }
    if s.security_protocol:
        cfg["security.protocol"] = s.security_protocol
    if s.sasl_mechanism:
        cfg["sasl.mechanism"] = s.sasl_mechanism
    if s.sasl_username is not None:
        cfg["sasl.username"] = s.sasl_username
        cfg["sasl.password"] = s.sasl_password or ""
    for ours, theirs in (("ssl_cafile", "ssl.ca.location"),
                         ("ssl_certfile", "ssl.certificate.location"),
                         ("ssl_keyfile", "ssl.key.location"),
                         ("ssl_password", "ssl.key.password")):
        if getattr(s, ours):
            cfg[theirs] = getattr(s, ours)
    if not s.ssl_check_hostname:
        cfg["ssl.endpoint.identification.algorithm"] = "none"
    return cfg


def _native(tps: Collection[TP], offset: int = ck.OFFSET_INVALID) -> list[Any]:
    return [ck.TopicPartition(t, p, offset) for t, p in tps]
