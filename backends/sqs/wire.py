"""SQS wire format: limits, names, filter policies and the packed metadata attribute."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mqabstract import wire as wire_schema
from mqabstract.emulation import Pattern, fit_name
from mqabstract.model import Envelope

# -- SQS / SNS limits (AWS documentation; moto enforces only some of them) ---------------------
SNS_MAX_MESSAGE = 262_144  #: body + attributes of one SNS publish, and of one PublishBatch
SQS_MAX_MESSAGE = 1_048_576
MAX_ATTRIBUTES = 10  #: message attributes per SQS message
BATCH = 10  #: entries per *Batch call
MAX_DELAY_SECONDS = 900  #: SendMessage DelaySeconds
MAX_VISIBILITY = 43_200  #: 12 h, counted from the receive
MAX_WAIT = 20  #: ReceiveMessage WaitTimeSeconds
RETENTION = 1_209_600  #: 14 days, the SQS maximum
QUEUE_NAME_MAX = 80

ATTR_TOPIC = wire_schema.TOPIC
ATTR_META = "mq"  # the packed wire schema: one JSON object, keys from wire.PACKED
# Packed keys of the wire schema (mqabstract/wire.py); the others are this packing's own:
# "v" version, "e" body encoding, "h" headers, "p" priority.
M_ID, M_ATTEMPT, M_PUBLISHED, M_DUE, M_REASON, M_DEAD_AT = (
    wire_schema.PACKED[name] for name in (
        wire_schema.ID, wire_schema.ATTEMPT, wire_schema.PUBLISHED_AT, wire_schema.DELIVER_AT,
        wire_schema.REASON, wire_schema.DEAD_AT,
    )
)
_OURS = (ATTR_TOPIC, ATTR_META)
NATIVE_HEADER_SLOTS = MAX_ATTRIBUTES - len(_OURS)
#: Room kept for attributes in the SNS budget: topic, packed metadata and headers (JSON
#: escaping may double header bytes), so that the largest base64 body still fits.
MAX_HEADER_BYTES = 8192
_ATTR_RESERVE = 20 * 1024
#: Largest body that fits SNS in the worst case (binary bodies travel base64-encoded).
MAX_BODY = (SNS_MAX_MESSAGE - _ATTR_RESERVE) // 4 * 3
#: Longest delay: queued messages expire after 14 days; FIFO delay hops keep the original.
MAX_DELAY = 13 * 86400.0

_SQS_NAME = re.compile(r"[A-Za-z0-9_-]+")
# Characters SQS and SNS carry unchanged in a message body (XML 1.0 minus CR, which an XML
# round trip may normalise); anything else travels base64-encoded.
_UNSAFE_TEXT = re.compile("[^\t\n\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_GROUP_ID = re.compile(r"[!-~]{1,128}")

# -- wire format -----------------------------------------------------------------------------
def _encode_body(body: bytes) -> tuple[str, str | None]:
    """(text for SNS/SQS, encoding flag for the metadata)."""
    if not body:
        return "-", "z"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and not _UNSAFE_TEXT.search(text):
        return text, None
    return base64.b64encode(body).decode("ascii"), "b"


def _decode_body(text: str, flag: str | None) -> bytes:
    if flag == "z":
        return b""
    if flag == "b":
        return base64.b64decode(text)
    return text.encode("utf-8")


def _group_id(env_key: str | None, message_id: str) -> str:
    if env_key is None:
        return message_id
    if _GROUP_ID.fullmatch(env_key):
        return env_key
    return "k:" + hashlib.sha256(env_key.encode()).hexdigest()


def _dedup_id(topic: str, message_id: str) -> str:
    return hashlib.sha256(f"{topic}\n{message_id}".encode()).hexdigest()


@dataclass
class _Wire:
    """One message as SQS/SNS see it: body text, attributes (SQS shape), metadata."""

    body: str
    attributes: dict[str, dict[str, str]]
    meta: dict[str, Any]
    group_id: str

    def fields(self) -> wire_schema.Fields:
        """The packed wire fields, typed (defaults for a plain client's message)."""
        return wire_schema.read(wire_schema.unpack(self.meta))

    def headers(self) -> dict[str, str]:
        """The user's headers (and carried ``mq-*`` ones): attributes, or packed under
        ``h`` when they did not fit."""
        headers, _ = wire_schema.split(
            ((n, v.get("StringValue", "")) for n, v in self.attributes.items()), _OURS)
        packed = self.meta.get("h")
        if isinstance(packed, dict):
            headers.update({str(k): str(v) for k, v in packed.items()})
        return headers

    def with_meta(self, **changes: Any) -> _Wire:
        meta = {k: v for k, v in {**self.meta, **changes}.items() if v is not None}
        attrs = dict(self.attributes)
        attrs[ATTR_META] = {"DataType": "String", "StringValue": _dumps(meta)}
        return _Wire(self.body, attrs, meta, self.group_id)

    def without_header(self, name: str) -> _Wire:
        """This message without one header, wherever it travels (attribute or packed)."""
        packed = self.meta.get("h")
        if name not in self.attributes and not (isinstance(packed, dict) and name in packed):
            return self
        attrs = {k: v for k, v in self.attributes.items() if k != name}
        meta = dict(self.meta)
        if isinstance(packed, dict):
            meta["h"] = {k: v for k, v in packed.items() if k != name}
        attrs[ATTR_META] = {"DataType": "String", "StringValue": _dumps(meta)}
        return _Wire(self.body, attrs, meta, self.group_id)

    def size(self) -> int:
        total = len(self.body.encode("utf-8"))
        for name, value in self.attributes.items():
            total += len(name.encode()) + len(value["DataType"]) + len(
                value.get("StringValue", "").encode("utf-8")
            )
        return total

    def sns_attributes(self) -> dict[str, dict[str, str]]:
        return self.attributes


def _dumps(meta: Mapping[str, Any]) -> str:
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=False)


def _to_wire(env: Envelope) -> _Wire:
    text, flag = _encode_body(env.body)
    meta: dict[str, Any] = {"v": 1, **wire_schema.pack(wire_schema.fields(env, key=True))}
    if env.priority:
        meta["p"] = env.priority
    if flag:
        meta["e"] = flag
    attrs: dict[str, dict[str, str]] = {
        ATTR_TOPIC: {"DataType": "String", "StringValue": env.topic}
    }
    headers = dict(env.headers)
    if headers and (len(headers) > NATIVE_HEADER_SLOTS or not all(headers.values())):
        meta["h"] = headers  # SQS rejects empty attribute values and more than 10 attributes
    else:
        for name, value in headers.items():
            attrs[name] = {"DataType": "String", "StringValue": value}
    attrs[ATTR_META] = {"DataType": "String", "StringValue": _dumps(meta)}
    return _Wire(text, attrs, meta, _group_id(env.key, env.id))


def _from_sqs(msg: Mapping[str, Any]) -> _Wire:
    """Rebuild the wire form of a received SQS message (for re-sends and dead letters)."""
    attrs: dict[str, dict[str, str]] = {}
    meta: dict[str, Any] = {}
    for name, value in (msg.get("MessageAttributes") or {}).items():
        dtype = value.get("DataType", "String")
        if "StringValue" in value:
            attrs[name] = {"DataType": dtype, "StringValue": value["StringValue"]}
    raw = attrs.get(ATTR_META, {}).get("StringValue")
    if raw:
        try:
            loaded = json.loads(raw)
            if isinstance(loaded, dict):
                meta = loaded
        except ValueError:
            meta = {}
    sysattrs = msg.get("Attributes") or {}
    group = sysattrs.get("MessageGroupId") or str(meta.get(M_ID) or msg.get("MessageId"))
    return _Wire(msg.get("Body", ""), attrs, meta, group)


def _sns_entry(wire: _Wire, index: int, env: Envelope) -> dict[str, Any]:
    return {
        "Id": str(index),
        "Message": wire.body,
        "MessageAttributes": wire.sns_attributes(),
        "MessageGroupId": wire.group_id,
        "MessageDeduplicationId": _dedup_id(env.topic, env.id),
    }


# -- names and filter policies ----------------------------------------------------------------
def _queue_base(prefix: str, group: str) -> str:
    """SQS-safe, injective base name for a group (suffixes ``-dlq``/``.fifo`` added later)."""
    room = QUEUE_NAME_MAX - len(prefix) - len(".fifo")
    return prefix + fit_name(group, room, safe=_SQS_NAME, reserved_suffixes=("-dlq",))


def filter_policy(pattern: str) -> dict[str, Any] | None:
    """An SNS filter policy admitting every topic that matches ``pattern`` (a superset);
    None when every message must be admitted (the driver's own match decides)."""
    f = Pattern(pattern).native_filter()
    if f.exact is None:
        return None
    rules: list[Any] = [f.exact]
    if f.prefix is not None:
        rules.append({"prefix": f.prefix})
    if f.suffix is not None:
        rules.append({"suffix": f.suffix})
    return {ATTR_TOPIC: rules}


def _size_chunks(indexes: list[int], wires: Sequence[_Wire], limit: int) -> list[list[int]]:
    """Split into runs of ≤ 10 entries whose total size fits one batch request."""
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in indexes:
        s = wires[i].size()
        if current and (len(current) == BATCH or size + s > limit):
            chunks.append(current)
            current, size = [], 0
        current.append(i)
        size += s
    if current:
        chunks.append(current)
    return chunks
