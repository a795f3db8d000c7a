"""The SQS driver: queues, SNS fan-out, receive/settle, dead letters (see the package doc)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time
import uuid
import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import boto3
import botocore.config
import botocore.exceptions

from mqabstract import wire as wire_schema
from mqabstract.capabilities import Capabilities, Feature, Support
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.emulation import Pattern, next_hop
from mqabstract.errors import (
    ConnectionFailed,
    InvalidArgument,
    MessageTooLarge,
    MQError,
    NotFound,
    NotSent,
    PublishError,
    Timeout,
)
from mqabstract.model import DeadLetter, Delivery, Envelope, GroupSpec, GroupStats, utc
from mqabstract.names import topic_matches
from mqabstract.options import Option, parse_options
from mqabstract.url import BrokerURL, redact
from mqabstract.wire import EXPIRES_AT

from .subscription import SQSSubscription, _Group, _Receipt
from .wire import (
    ATTR_TOPIC,
    BATCH,
    M_ATTEMPT,
    M_DEAD_AT,
    M_DUE,
    M_ID,
    M_PUBLISHED,
    M_REASON,
    MAX_BODY,
    MAX_DELAY,
    MAX_DELAY_SECONDS,
    MAX_HEADER_BYTES,
    MAX_VISIBILITY,
    MAX_WAIT,
    RETENTION,
    SNS_MAX_MESSAGE,
    _decode_body,
    _dedup_id,
    _from_sqs,
    _queue_base,
    _size_chunks,
    _sns_entry,
    _to_wire,
    _Wire,
    filter_policy,
)

__all__ = ["SQSDriver"]

log = logging.getLogger("mqabstract.sqs")

_CONNECT_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ProxyConnectionError,
)
_STALE_CODES = {
    "ReceiptHandleIsInvalid",
    "InvalidReceiptHandle",
    "MessageNotInflight",
    "AWS.SimpleQueueService.MessageNotInflight",
    "AWS.SimpleQueueService.ReceiptHandleIsInvalid",
}
_MISSING_QUEUE = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}


#: Messages per driver publish call: split into SNS batches of 10 sent on parallel lanes.
PUBLISH_MAX = 100

def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class SQSDriver(Driver):
    """SQS queues per group, SNS FIFO topic for fan-out; see the module docstring."""

    name: ClassVar[str] = "sqs"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "region": Option(str, None, "AWS region (default: the AWS config chain)"),
        "endpoint_url": Option(str, None, "SQS/SNS endpoint (moto, LocalStack)"),
        "sns_endpoint_url": Option(str, None, "SNS endpoint if different from endpoint_url"),
        "profile": Option(str, None, "AWS shared-config profile"),
        "aws_access_key_id": Option(str, None, "explicit access key (else the AWS chain)"),
        "aws_secret_access_key": Option(str, None, "explicit secret key"),
        "aws_session_token": Option(str, None, "explicit session token"),
        "prefix": Option(str, "mqa-", "prefix of every queue and topic name this driver makes"),
        "topic_name": Option(str, None, "SNS FIFO topic name (default <prefix>bus.fifo)"),
        "high_throughput": Option(
            bool, True, "FIFO high-throughput mode (dedup and throughput per message group)"
        ),
        "connect_timeout": Option(float, 5.0, "seconds to connect before ConnectionFailed"),
        "retries": Option(int, 3, "botocore retry attempts for throttling and 5xx"),
        "publish_lanes": Option(
            int, 4, "concurrent SNS batch calls per publish (messages of one key share a lane)"
        ),
    }

    CAPABILITIES = Capabilities(
        features={
            Feature.WILDCARDS: Support.EMULATED,
            Feature.FANOUT: Support.NATIVE,
            Feature.COMPETING: Support.NATIVE,
            Feature.LEASE_EXTEND: Support.NATIVE,
            Feature.NACK_DELAY: Support.NATIVE,
            Feature.DELAY: Support.EMULATED,
            Feature.PRIORITY: Support.UNSUPPORTED,
            Feature.ORDERING: Support.EMULATED,
            Feature.DEAD_LETTER: Support.EMULATED,
            Feature.BATCH: Support.NATIVE,
        },
        max_body_bytes=MAX_BODY,
        max_headers=64,
        max_header_bytes=MAX_HEADER_BYTES,
        max_delay=MAX_DELAY,
        max_ttl=MAX_DELAY,  # queued messages are deleted after 14 days (RETENTION)
        max_batch=PUBLISH_MAX,
        max_priority=0,
        max_lease=float(MAX_VISIBILITY),
        min_lease=1.0,  # visibility timeouts are whole seconds
        # Visibility timeouts are whole seconds and a receive long-polls in slices; on moto
        # under the full CI load a frozen holder's messages came back 3.4 s past the lease.
        release_margin=5.0,
        max_receive=BATCH,
        # FIFO: one receive may bring several messages of a message group (in order), and
        # the group stays locked while any of them is out
        key_gate="hand_back",
        # SQS's own estimates; a delayed message counts as ready until a receive moves it
        # into its wait (SNS cannot delay a delivery)
        stats=dict.fromkeys(("ready", "leased", "delayed", "dead"), "approximate"),
        notes={
            Feature.ORDERING: (
                "FIFO queues (MessageGroupId = key); a receive may bring several messages "
                "of a group: the portable layer's gate hands out one at a time"
            ),
            Feature.PRIORITY: (
                "SQS has no priority and receives from a standard queue are sampled, so "
                "queue-per-level polling cannot guarantee higher-first; use separate groups"
            ),
        },
    )

    def __init__(self, url: BrokerURL, opts: Mapping[str, Any], sqs: Any, sns: Any) -> None:
        self._url = url
        self._opts = opts
        self._sqs = sqs
        self._sns = sns
        self._prefix: str = opts["prefix"]
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._topic_arn = ""
        self._caps = self.CAPABILITIES

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> SQSDriver:
        opts = parse_options(url, options, cls.OPTIONS, cls.name)
        prefix = opts["prefix"]
        if not re.fullmatch(r"[A-Za-z0-9_-]{0,40}", prefix):
            raise InvalidArgument("prefix must be 0-40 characters of letters, digits, '_', '-'")
        config = botocore.config.Config(
            connect_timeout=opts["connect_timeout"],
            read_timeout=MAX_WAIT + 10,
            retries={"max_attempts": opts["retries"], "mode": "standard"},
            max_pool_connections=32,
        )
        try:
            session = boto3.session.Session(
                aws_access_key_id=opts["aws_access_key_id"],
                aws_secret_access_key=opts["aws_secret_access_key"],
                aws_session_token=opts["aws_session_token"],
                region_name=opts["region"],
                profile_name=opts["profile"],
            )
            sqs = session.client("sqs", endpoint_url=opts["endpoint_url"], config=config)
            sns = session.client(
                "sns", endpoint_url=opts["sns_endpoint_url"] or opts["endpoint_url"], config=config
            )
        except botocore.exceptions.BotoCoreError as exc:
            raise ConnectionFailed(f"sqs: cannot set up clients for {url.redacted()}: "
                                   f"{redact(str(exc))}") from exc
        driver = cls(url, opts, sqs, sns)
        driver._topic_arn = driver._call(
            "create the SNS topic", sns.create_topic, **driver._topic_request()
        )["TopicArn"]
        return driver

    def _topic_request(self) -> dict[str, Any]:
        name = self._opts["topic_name"] or f"{self._prefix}bus.fifo"
        attrs = {"FifoTopic": "true", "ContentBasedDeduplication": "false"}
        if self._opts["high_throughput"]:
            attrs["FifoThroughputScope"] = "MessageGroup"
        return {"Name": name, "Attributes": attrs}

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in (self._sqs, self._sns):
            with contextlib.suppress(Exception):
                client.close()

    # -- error translation --------------------------------------------------------------------
    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except botocore.exceptions.ClientError as exc:
            raise self._client_error(what, exc) from exc
        except botocore.exceptions.ReadTimeoutError as exc:
            raise Timeout(f"sqs: {what}: {self._url.redacted()} did not answer in time") from exc
        except _CONNECT_ERRORS as exc:
            raise ConnectionFailed(
                f"sqs: {what}: cannot reach {self._url.redacted()}: {type(exc).__name__}"
            ) from exc
        except botocore.exceptions.NoCredentialsError as exc:
            raise ConnectionFailed(
                f"sqs: {what}: no AWS credentials found for {self._url.redacted()} "
                "(environment, shared config, or instance role)"
            ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise ConnectionFailed(
                f"sqs: {what} at {self._url.redacted()}: {redact(str(exc))}"
            ) from exc

    def _client_error(self, what: str, exc: botocore.exceptions.ClientError) -> MQError:
        code = _code(exc)
        text = redact(str(exc.response.get("Error", {}).get("Message", "")))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        message = f"sqs: {what} at {self._url.redacted()} failed: {code}: {text}"
        if code in _MISSING_QUEUE or code == "NotFound":
            return NotFound(message)
        if code in ("InvalidClientTokenId", "SignatureDoesNotMatch", "AccessDenied",
                    "UnrecognizedClientException", "AuthorizationError"):
            return ConnectionFailed(message)
        err = MQError(message)
        err.retryable = status >= 500 or "Throttl" in code or code == "RequestThrottled"
        return err

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, envelopes: Sequence[Envelope]) -> None:
        wires = []
        for index, env in enumerate(envelopes):
            wire = _to_wire(env)
            if wire.size() > SNS_MAX_MESSAGE:
                raise MessageTooLarge(
                    f"encoded message is {wire.size()} bytes; SNS allows {SNS_MAX_MESSAGE}",
                    index=index if len(envelopes) > 1 else None,
                )
            wires.append(wire)
        if len(envelopes) == 1:
            env, wire = envelopes[0], wires[0]
            self._call(
                "publish", self._sns.publish, TopicArn=self._topic_arn, Message=wire.body,
                MessageAttributes=wire.sns_attributes(), MessageGroupId=wire.group_id,
                MessageDeduplicationId=_dedup_id(env.topic, env.id),
            )
            return
        # Lanes: up to ``publish_lanes`` SNS calls in flight; a key's messages (one FIFO
        # message group) stay in one lane, in order, so they never race each other.
        lanes: dict[int, list[int]] = {}
        n_lanes = max(1, self._opts["publish_lanes"])
        for i, wire in enumerate(wires):
            lanes.setdefault(zlib.crc32(wire.group_id.encode()) % n_lanes, []).append(i)
        work = [_size_chunks(idx, wires, SNS_MAX_MESSAGE) for idx in lanes.values()]
        if len(work) == 1:
            outcomes = [self._publish_lane(envelopes, wires, work[0])]
        else:
            with ThreadPoolExecutor(len(work), thread_name_prefix="mqabstract-sqs") as pool:
                outcomes = list(pool.map(
                    lambda chunks: self._publish_lane(envelopes, wires, chunks), work))
        failed = {i: err for _, bad in outcomes for i, err in bad.items()}
        if not failed:
            return
        error = PublishError.from_outcomes(
            [env.id for env in envelopes], [failed.get(i) for i in range(len(envelopes))],
            by="SNS")
        if not error.published:  # nothing was published: the first real failure says why
            raise error.cause or error
        raise error

    def _publish_lane(self, envelopes: Sequence[Envelope], wires: Sequence[_Wire],
                      chunks: list[list[int]]) -> tuple[list[int], dict[int, MQError]]:
        """Send one lane's chunks in order: (confirmed indexes, failed index → error); after
        a failure the lane's later chunks are not sent (their order would break)."""
        confirmed: list[int] = []
        for k, chunk in enumerate(chunks):
            entries = [_sns_entry(wires[i], i, envelopes[i]) for i in chunk]
            try:
                result = self._call(
                    "publish a batch", self._sns.publish_batch, TopicArn=self._topic_arn,
                    PublishBatchRequestEntries=entries,
                )
            except MQError as exc:
                failed: dict[int, MQError] = {i: exc for i in chunk}
            else:
                failed = {
                    int(f["Id"]): MQError(f"sqs: {f.get('Code')}: {f.get('Message', '')}")
                    for f in result.get("Failed", [])
                }
                confirmed.extend(i for i in chunk if i not in failed)
            if failed:
                not_sent = NotSent("not sent: an earlier message of its lane failed")
                failed.update({i: not_sent for later in chunks[k + 1:] for i in later})
                return confirmed, failed
        return confirmed, {}

    # -- groups -------------------------------------------------------------------------------
    def _names(self, group: str) -> tuple[str, str, str]:
        base = _queue_base(self._prefix, group)
        return base, base + ".fifo", base + "-dlq"

    def _queue_policy(self, queue_arn: str) -> str:
        return json.dumps({
            "Version": "2012-10-17",
            "Statement": [{
                "Sid": "mqabstract-sns",
                "Effect": "Allow",
                "Principal": {"Service": "sns.amazonaws.com"},
                "Action": "sqs:SendMessage",
                "Resource": queue_arn,
                "Condition": {"ArnEquals": {"aws:SourceArn": self._topic_arn}},
            }],
        })

    def _create_queue(self, name: str, fifo: bool, lease: float, tags: dict[str, str]) -> str:
        attrs = {
            "MessageRetentionPeriod": str(RETENTION),
            "VisibilityTimeout": str(max(1, math.ceil(lease))),
        }
        if fifo:
            attrs["FifoQueue"] = "true"
            attrs["ContentBasedDeduplication"] = "false"
            if self._opts["high_throughput"]:
                attrs["DeduplicationScope"] = "messageGroup"
                attrs["FifoThroughputLimit"] = "perMessageGroupId"
        try:
            return str(self._sqs.create_queue(QueueName=name, Attributes=attrs, tags=tags)
                       ["QueueUrl"])
        except botocore.exceptions.ClientError as exc:
            if _code(exc) not in ("QueueAlreadyExists", "QueueNameExists"):
                raise self._client_error(f"create queue {name}", exc) from exc
        except Exception as exc:
            self._call("create queue", _raise, exc=exc)
        # Exists with other attributes (a redeclare with another lease): reuse it.
        return str(self._call("find queue", self._sqs.get_queue_url, QueueName=name)["QueueUrl"])

    def declare(self, spec: GroupSpec) -> None:
        # Always make sure topic, queues and subscription exist (all idempotent in SQS/SNS):
        # after a broker loss (a restarted moto, a deleted queue) a re-declare must repair.
        self._declare(spec, force=True)

    def _declare(self, spec: GroupSpec, force: bool = False) -> _Group:
        with self._lock:
            known = self._groups.get(spec.name)
        if (not force and known is not None and known.pattern == spec.pattern
                and known.fifo == spec.ordered):
            return known
        if force:
            self._topic_arn = self._call(
                "create the SNS topic", self._sns.create_topic, **self._topic_request()
            )["TopicArn"]
        base, fifo_name, dlq_name = self._names(spec.name)
        tags = {"mqabstract:group": spec.name[:256], "mqabstract:pattern": spec.pattern[:256]}
        dlq_url = self._create_queue(dlq_name, False, 30, tags)
        main_name = fifo_name if spec.ordered else base
        queue_url = self._create_queue(main_name, spec.ordered, spec.lease, tags)
        arn = self._call("read queue attributes", self._sqs.get_queue_attributes,
                         QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        self._call("allow SNS to deliver", self._sqs.set_queue_attributes, QueueUrl=queue_url,
                   Attributes={"Policy": self._queue_policy(arn)})
        group = _Group(spec.name, spec.pattern, queue_url, arn, dlq_url, spec.ordered,
                       exact=Pattern(spec.pattern).native_filter().complete)
        group.subscription_arn = self._subscribe(group)
        with self._lock:
            self._groups[spec.name] = group
        return group

    def _subscribe(self, group: _Group) -> str:
        attrs = {"RawMessageDelivery": "true"}
        policy = filter_policy(group.pattern)
        if policy is not None:
            attrs["FilterPolicy"] = json.dumps(policy)
        try:
            resp = self._sns.subscribe(TopicArn=self._topic_arn, Protocol="sqs",
                                       Endpoint=group.queue_arn, Attributes=attrs,
                                       ReturnSubscriptionArn=True)
            return str(resp["SubscriptionArn"])
        except botocore.exceptions.ClientError as exc:
            if _code(exc) != "InvalidParameter":
                raise self._client_error("subscribe the group queue", exc) from exc
        except Exception as exc:
            self._call("subscribe", _raise, exc=exc)
        # Already subscribed with another filter policy (the pattern changed): update it.
        sub_arn = self._find_subscription(group.queue_arn)
        if sub_arn is None:
            raise MQError(f"sqs: cannot subscribe group {group.name!r} to the SNS topic")
        self._call("update the filter policy", self._sns.set_subscription_attributes,
                   SubscriptionArn=sub_arn, AttributeName="FilterPolicy",
                   AttributeValue=attrs.get("FilterPolicy", "{}"))
        return sub_arn

    def _find_subscription(self, queue_arn: str) -> str | None:
        token = None
        while True:
            kwargs: dict[str, Any] = {"TopicArn": self._topic_arn}
            if token:
                kwargs["NextToken"] = token
            resp = self._call("list subscriptions", self._sns.list_subscriptions_by_topic,
                              **kwargs)
            for sub in resp.get("Subscriptions", []):
                if sub.get("Endpoint") == queue_arn:
                    return str(sub["SubscriptionArn"])
            token = resp.get("NextToken")
            if not token:
                return None

    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        return SQSSubscription(self, self._declare(spec), spec)

    def _queue_url(self, name: str) -> str | None:
        try:
            return str(self._sqs.get_queue_url(QueueName=name)["QueueUrl"])
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _MISSING_QUEUE:
                return None
            raise self._client_error(f"find queue {name}", exc) from exc
        except Exception as exc:
            self._call("find queue", _raise, exc=exc)
        return None

    def _lookup(self, group: str) -> _Group:
        """The group's queues, declared by this driver or found by name (another process)."""
        with self._lock:
            known = self._groups.get(group)
        if known is not None:
            return known
        base, fifo_name, dlq_name = self._names(group)
        dlq_url = self._queue_url(dlq_name)
        for name, fifo in ((base, False), (fifo_name, True)):
            url = self._queue_url(name)
            if url is not None and dlq_url is not None:
                return _Group(group, "#", url, "", dlq_url, fifo)
        raise NotFound(f"sqs: no group {group!r} at {self._url.redacted()}")

    def queue_url(self, group: str) -> str:
        """URL of the group's SQS queue (for interop with plain boto3 code)."""
        return self._lookup(group).queue_url

    def groups(self) -> list[str]:
        """Every group's dead-letter queue (made first by ``declare``) carries the group's
        name as a tag: one listing, then one tag read per group."""
        urls: list[str] = []
        token: str | None = None
        while True:
            page = self._call("list queues", self._sqs.list_queues,
                              QueueNamePrefix=self._prefix, MaxResults=1000,
                              **({"NextToken": token} if token else {}))
            urls += [u for u in page.get("QueueUrls", []) if u.endswith("-dlq")]
            token = page.get("NextToken")
            if not token:
                break
        out = []
        for url in urls:
            try:
                tags = self._call("read queue tags", self._sqs.list_queue_tags,
                                  QueueUrl=url).get("Tags", {})
            except NotFound:  # deleted meanwhile
                continue
            group = tags.get("mqabstract:group")
            # (another prefix that starts with ours lists its queues too: keep only ours)
            if group is not None and url.rsplit("/", 1)[-1] == self._names(group)[2]:
                out.append(group)
        return sorted(set(out))

    def delete_group(self, group: str) -> None:
        with self._lock:
            known = self._groups.pop(group, None)
        base, fifo_name, dlq_name = self._names(group)
        sub_arn = known.subscription_arn if known else None
        for name in (base, fifo_name):
            url = known.queue_url if known and name == (fifo_name if known.fifo else base) \
                else self._queue_url(name)
            if url is None:
                continue
            if sub_arn is None:
                arn = self._call("read queue attributes", self._sqs.get_queue_attributes,
                                 QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
                                     "QueueArn"]
                found = self._find_subscription(arn)
            else:
                found = sub_arn
            if found:
                self._ignore_missing(self._sns.unsubscribe, SubscriptionArn=found)
            self._ignore_missing(self._sqs.delete_queue, QueueUrl=url)
        dlq = known.dlq_url if known else self._queue_url(dlq_name)
        if dlq is not None:
            self._ignore_missing(self._sqs.delete_queue, QueueUrl=dlq)

    def _ignore_missing(self, fn: Any, **kwargs: Any) -> None:
        with contextlib.suppress(NotFound):
            self._call("delete", fn, **kwargs)

    def ping(self) -> None:
        """A queue listing with a prefix no queue has: one request, nothing made."""
        self._call("ping", self._sqs.list_queues, QueueNamePrefix="mqabstract-ping-none")

    def stats(self, group: str) -> GroupStats:
        g = self._lookup(group)
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                 "ApproximateNumberOfMessagesDelayed"]
        main = self._call("read queue attributes", self._sqs.get_queue_attributes,
                          QueueUrl=g.queue_url, AttributeNames=names)["Attributes"]
        dead = self._call("read queue attributes", self._sqs.get_queue_attributes,
                          QueueUrl=g.dlq_url, AttributeNames=names)["Attributes"]
        return GroupStats(
            group,
            int(main.get(names[0], 0)),
            int(main.get(names[1], 0)),
            int(main.get(names[2], 0)),
            sum(int(dead.get(n, 0)) for n in names),
        )

    # -- receiving ----------------------------------------------------------------------------
    def _receive(self, group: _Group, want: int, wait: int, lease: int) -> list[Delivery]:
        before_wall = time.time()
        resp = self._call(
            "receive", self._sqs.receive_message, QueueUrl=group.queue_url,
            MaxNumberOfMessages=want, WaitTimeSeconds=wait, VisibilityTimeout=lease,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp",
                                         "ApproximateFirstReceiveTimestamp", "MessageGroupId"],
        )
        # A long poll leases the message when it answers: the broker's deadline is never
        # earlier than the portable layer's (taken before this call), which alone decides
        # whether a settle is stale.
        out: list[Delivery] = []
        drop: list[str] = []
        now = time.time()
        for msg in resp.get("Messages", []):
            wire = _from_sqs(msg)
            receipt = _Receipt(msg["ReceiptHandle"], group, before_wall, wire)
            topic = wire.attributes.get(ATTR_TOPIC, {}).get("StringValue")
            if topic and not group.exact and not topic_matches(group.pattern, topic):
                drop.append(msg["ReceiptHandle"])  # admitted by the filter policy superset only
                continue
            fields = wire.fields()
            due = fields.deliver_at
            if due is not None and due > now:
                self._defer(receipt, due - now)
                continue
            delivery = self._delivery(msg, wire, fields, group, topic, receipt)
            receipt.delivery = delivery
            receipt.attempt = delivery.attempt
            out.append(delivery)
        if drop:
            self._delete_handles(group.queue_url, drop)
        return out

    def _delivery(self, msg: Mapping[str, Any], wire: _Wire, fields: wire_schema.Fields,
                  group: _Group, topic: str | None, receipt: _Receipt) -> Delivery:
        meta = wire.meta
        sysattrs = msg.get("Attributes") or {}
        count = int(sysattrs.get("ApproximateReceiveCount", 1))
        attempt = count + fields.attempt
        due = fields.deliver_at
        first = sysattrs.get("ApproximateFirstReceiveTimestamp")
        if group.fifo and due is not None and first:
            # FIFO delay hops were receives too: one per started 12 h before the due time.
            ahead = due - int(first) / 1000.0
            if ahead > 0:
                attempt -= math.ceil(ahead / (MAX_VISIBILITY - 60))
        key = fields.key
        if key is None and not meta and group.fifo:
            key = sysattrs.get("MessageGroupId")
        published = fields.published_at
        if published is None:
            published = int(sysattrs.get("SentTimestamp", time.time() * 1000)) / 1000.0
        return Delivery(
            id=fields.id or str(msg.get("MessageId")),
            topic=topic or group.name,
            body=_decode_body(wire.body, meta.get("e")),
            headers=wire.headers(),
            key=key,
            priority=int(meta.get("p", 0)),
            attempt=max(1, attempt),
            published_at=published,
            receipt=receipt,
        )

    def _defer(self, receipt: _Receipt, remaining: float) -> None:
        """Hide a message that is not due yet without counting the hop as a delivery."""
        group = receipt.group
        if group.fifo:
            # FIFO queues have no per-message delay; hiding it keeps its key's order too.
            seconds = min(math.ceil(remaining), MAX_VISIBILITY - 60)
            self._change_visibility(receipt, seconds)
            return
        wire = receipt.wire
        self._send(group.queue_url, wire, next_hop(remaining, MAX_DELAY_SECONDS), False)
        self._delete_handles(group.queue_url, [receipt.handle])

    def _send(self, queue_url: str, wire: _Wire, delay: int, fifo: bool) -> None:
        kwargs: dict[str, Any] = {
            "QueueUrl": queue_url, "MessageBody": wire.body,
            "MessageAttributes": wire.attributes,
        }
        if fifo:
            kwargs["MessageGroupId"] = wire.group_id
            kwargs["MessageDeduplicationId"] = uuid.uuid4().hex  # a deliberate new copy
        elif delay > 0:
            kwargs["DelaySeconds"] = delay
        self._call("send", self._sqs.send_message, **kwargs)

    # -- settling -----------------------------------------------------------------------------
    def _delete_handles(self, queue_url: str, handles: Sequence[str]) -> None:
        for start in range(0, len(handles), BATCH):
            chunk = handles[start : start + BATCH]
            resp = self._call(
                "delete", self._sqs.delete_message_batch, QueueUrl=queue_url,
                Entries=[{"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(chunk)],
            )
            bad = [f for f in resp.get("Failed", []) if f.get("Code") not in _STALE_CODES]
            if bad:
                raise MQError(f"sqs: {len(bad)} deletes failed: {bad[0].get('Code')}: "
                              f"{bad[0].get('Message', '')}")

    def _ack(self, receipts: list[_Receipt]) -> None:
        by_queue: dict[str, list[str]] = {}
        for r in receipts:
            by_queue.setdefault(r.group.queue_url, []).append(r.handle)
        for url, handles in by_queue.items():
            with contextlib.suppress(NotFound):  # the group was deleted meanwhile
                self._delete_handles(url, handles)

    def _change_visibility(self, receipt: _Receipt, seconds: int) -> bool:
        """ChangeMessageVisibility; False when the receipt turned out stale."""
        try:
            self._sqs.change_message_visibility(
                QueueUrl=receipt.group.queue_url, ReceiptHandle=receipt.handle,
                VisibilityTimeout=int(seconds),
            )
        except botocore.exceptions.ClientError as exc:
            code = _code(exc)
            if code in _STALE_CODES or code in _MISSING_QUEUE:
                return False
            raise self._client_error("change visibility", exc) from exc
        except Exception as exc:
            self._call("change visibility", _raise, exc=exc)
        return True

    def _left_in_flight(self, receipt: _Receipt) -> float:
        """Seconds this receipt may still stay hidden (SQS: 12 h from the receive)."""
        return MAX_VISIBILITY - 5 - (time.time() - receipt.received_at)

    def _nack(self, receipt: _Receipt, delay: float) -> None:
        seconds = math.ceil(delay)
        if seconds <= self._left_in_flight(receipt):
            self._change_visibility(receipt, seconds)
            return
        # Longer than SQS lets a message stay hidden: send a copy that remembers its attempts
        # and becomes due later, then drop this one.
        wire = receipt.wire.with_meta(**wire_schema.pack(
            wire_schema.retry_fields(receipt.attempt, time.time() + delay)))
        self._send(receipt.group.queue_url, wire, min(MAX_DELAY_SECONDS, seconds),
                   receipt.group.fifo)
        self._delete_handles(receipt.group.queue_url, [receipt.handle])

    def _extend(self, receipt: _Receipt, seconds: float) -> None:
        whole = math.ceil(seconds)
        if whole > self._left_in_flight(receipt):
            raise InvalidArgument(
                "sqs: a message can stay leased at most 12 h after it was received "
                f"({max(0, int(self._left_in_flight(receipt)))} s left)"
            )
        self._change_visibility(receipt, whole)

    def _dead_letter(self, receipt: _Receipt, reason: str, attempts: int) -> None:
        d = receipt.delivery
        wire = receipt.wire
        if d is not None and not wire.meta:  # a foreign message: give it our metadata
            meta = {"v": 1, M_ID: d.id, M_PUBLISHED: d.published_at}
            wire = _Wire(wire.body, dict(wire.attributes), meta, wire.group_id).with_meta()
            wire.attributes.setdefault(ATTR_TOPIC, {"DataType": "String", "StringValue": d.topic})
        wire = wire.with_meta(**{M_REASON: reason, M_ATTEMPT: int(attempts),
                                 M_DEAD_AT: time.time(), M_DUE: None})
        self._send(receipt.group.dlq_url, wire, 0, False)
        self._delete_handles(receipt.group.queue_url, [receipt.handle])

    # -- dead letters -------------------------------------------------------------------------
    def _scan(self, queue_url: str) -> list[dict[str, Any]]:
        """Receive every message of a (dead-letter) queue, hidden for a minute."""
        seen: dict[str, dict[str, Any]] = {}
        long_polled = False
        while True:
            resp = self._call(
                "read dead letters", self._sqs.receive_message, QueueUrl=queue_url,
                MaxNumberOfMessages=BATCH, WaitTimeSeconds=1 if long_polled else 0,
                VisibilityTimeout=60, MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["SentTimestamp"],
            )
            batch = resp.get("Messages", [])
            for m in batch:
                seen[m["MessageId"]] = m
            if batch:
                continue
            if long_polled:
                return list(seen.values())
            # Short polls sample a subset of SQS hosts; confirm the queue is empty.
            attrs = self._call("read queue attributes", self._sqs.get_queue_attributes,
                               QueueUrl=queue_url,
                               AttributeNames=["ApproximateNumberOfMessages"])["Attributes"]
            if int(attrs.get("ApproximateNumberOfMessages", 0)) == 0:
                return list(seen.values())
            long_polled = True

    def _scan_dead(self, g: _Group) -> list[dict[str, Any]]:
        """The group's dead letters, one per message id (hidden for a minute, as ``_scan``).

        A move to the dead-letter queue is a send there, then a delete from the group queue:
        two calls that nothing makes atomic. A consumer killed between them leaves the
        original behind; it comes back past ``max_attempts`` and is moved again, a second
        entry for the id. So an id's first move (fewest attempts, then earliest) is its dead
        letter; a later entry for it is redundant and deleted here (if that delete fails,
        the next scan drops it again)."""
        first: dict[str, dict[str, Any]] = {}
        extra: list[dict[str, Any]] = []

        def order(m: Mapping[str, Any]) -> tuple[int, float, int, str]:
            w = _from_sqs(m)
            sent = int((m.get("Attributes") or {}).get("SentTimestamp", 0))
            dead_at = w.meta.get(M_DEAD_AT)
            return (w.fields().attempt,
                    float(dead_at) if isinstance(dead_at, (int, float)) else sent / 1000.0,
                    sent, str(m["MessageId"]))

        for m in sorted(self._scan(g.dlq_url), key=order):
            mid = _from_sqs(m).fields().id or str(m["MessageId"])
            if mid in first:
                extra.append(m)
            else:
                first[mid] = m
        if extra:
            try:
                self._delete_handles(g.dlq_url, [m["ReceiptHandle"] for m in extra])
            except MQError as exc:
                log.warning("sqs: group %r: %d repeated dead letters not deleted (%s); "
                            "every listing leaves them out", g.name, len(extra), exc)
        return list(first.values())

    def _release(self, queue_url: str, messages: Iterable[Mapping[str, Any]]) -> None:
        handles = [m["ReceiptHandle"] for m in messages]
        for start in range(0, len(handles), BATCH):
            chunk = handles[start : start + BATCH]
            self._call(
                "release dead letters", self._sqs.change_message_visibility_batch,
                QueueUrl=queue_url,
                Entries=[{"Id": str(i), "ReceiptHandle": h, "VisibilityTimeout": 0}
                         for i, h in enumerate(chunk)],
            )

    def _dead_letter_view(self, msg: Mapping[str, Any]) -> DeadLetter:
        wire = _from_sqs(msg)
        meta = wire.meta
        fields = wire.fields()
        sent = int((msg.get("Attributes") or {}).get("SentTimestamp", 0)) / 1000.0
        published = fields.published_at
        return DeadLetter(
            id=fields.id or str(msg["MessageId"]),
            topic=wire.attributes.get(ATTR_TOPIC, {}).get("StringValue", ""),
            body=_decode_body(wire.body, meta.get("e")),
            headers=wire.headers(),
            key=fields.key,
            priority=int(meta.get("p", 0)),
            published_at=utc(published if published is not None else sent),
            attempts=fields.attempt,
            reason=str(meta.get(M_REASON, "")),
            dead_lettered_at=utc(float(meta.get(M_DEAD_AT, sent))),
        )

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        g = self._lookup(group)
        messages = self._scan_dead(g)
        try:
            views = sorted((self._dead_letter_view(m) for m in messages),
                           key=lambda d: (d.dead_lettered_at or d.published_at))
        finally:
            self._release(g.dlq_url, messages)
        return views[:limit]

    def _select(self, group: str, ids: Collection[str] | None) -> tuple[_Group, list[Any],
                                                                         list[Any]]:
        g = self._lookup(group)
        messages = self._scan_dead(g)
        chosen: list[Any] = []
        rest: list[Any] = []
        for m in messages:
            mid = _from_sqs(m).fields().id or str(m["MessageId"])
            (chosen if ids is None or mid in ids else rest).append(m)
        return g, chosen, rest

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        g, chosen, rest = self._select(group, ids)
        try:
            for m in chosen:
                # A replay restarts the message: no dead-letter metadata, no delay, no TTL
                # (an expired one would expire again at once).
                wire = _from_sqs(m).with_meta(**{M_REASON: None, M_ATTEMPT: None,
                                                 M_DEAD_AT: None, M_DUE: None}
                                              ).without_header(EXPIRES_AT)
                self._send(g.queue_url, wire, 0, g.fifo)
            self._delete_handles(g.dlq_url, [m["ReceiptHandle"] for m in chosen])
        finally:
            self._release(g.dlq_url, rest)
        return len(chosen)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        # Receive + delete rather than PurgeQueue: PurgeQueue works once per 60 s, takes up
        # to a minute, and cannot select ids.
        g, chosen, rest = self._select(group, ids)
        try:
            self._delete_handles(g.dlq_url, [m["ReceiptHandle"] for m in chosen])
        finally:
            self._release(g.dlq_url, rest)
        return len(chosen)


def _raise(exc: BaseException) -> None:
    raise exc
