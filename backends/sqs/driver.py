"""The SQS driver: queues, SNS fan-out, publishing, groups, stats and the dead-letter API
(see the package doc); a group's consumer side is ``subscription``."""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import zlib
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import boto3
import botocore.config
import botocore.exceptions

from mqabstract.capabilities import Capabilities, Feature, Support
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.emulation import Pattern
from mqabstract.errors import (
    ConnectionFailed,
    InvalidArgument,
    MessageTooLarge,
    MQError,
    NotFound,
    NotSent,
    PublishError,
)
from mqabstract.model import DeadLetter, Envelope, GroupSpec, GroupStats
from mqabstract.options import Option, parse_options
from mqabstract.url import BrokerURL, redact
from mqabstract.wire import EXPIRES_AT

from . import deadletters
from .calls import _MISSING_QUEUE, Calls, _code, _raise
from .subscription import SQSSubscription, _Group
from .wire import (
    BATCH,
    M_ATTEMPT,
    M_DEAD_AT,
    M_DUE,
    M_REASON,
    MAX_BODY,
    MAX_DELAY,
    MAX_HEADER_BYTES,
    MAX_VISIBILITY,
    MAX_WAIT,
    RETENTION,
    SNS_MAX_MESSAGE,
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


#: Messages per driver publish call: split into SNS batches of 10 sent on parallel lanes.
PUBLISH_MAX = 100


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
        "connect_timeout": Option(float, 5.0, "seconds to connect before ConnectionFailed",
                                  above=0),
        "retries": Option(int, 3, "botocore retry attempts for throttling and 5xx", min=0),
        "publish_lanes": Option(
            int, 4, "concurrent SNS batch calls per publish (messages of one key share a lane)",
            min=1,
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
        self._calls = Calls(url, sqs, sns)
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
        driver._topic_arn = driver._calls.call(
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
            self._calls.call(
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
                result = self._calls.call(
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
                raise self._calls.client_error(f"create queue {name}", exc) from exc
        except Exception as exc:
            self._calls.call("create queue", _raise, exc=exc)
        # Exists with other attributes (a redeclare with another lease): reuse it.
        return str(self._calls.call("find queue", self._sqs.get_queue_url,
                                    QueueName=name)["QueueUrl"])

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
            self._topic_arn = self._calls.call(
                "create the SNS topic", self._sns.create_topic, **self._topic_request()
            )["TopicArn"]
        base, fifo_name, dlq_name = self._names(spec.name)
        tags = {"mqabstract:group": spec.name[:256], "mqabstract:pattern": spec.pattern[:256]}
        dlq_url = self._create_queue(dlq_name, False, 30, tags)
        main_name = fifo_name if spec.ordered else base
        queue_url = self._create_queue(main_name, spec.ordered, spec.lease, tags)
        arn = self._calls.call("read queue attributes", self._sqs.get_queue_attributes,
                               QueueUrl=queue_url, AttributeNames=["QueueArn"]
                               )["Attributes"]["QueueArn"]
        self._calls.call("allow SNS to deliver", self._sqs.set_queue_attributes,
                         QueueUrl=queue_url, Attributes={"Policy": self._queue_policy(arn)})
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
                raise self._calls.client_error("subscribe the group queue", exc) from exc
        except Exception as exc:
            self._calls.call("subscribe", _raise, exc=exc)
        # Already subscribed with another filter policy (the pattern changed): update it.
        sub_arn = self._find_subscription(group.queue_arn)
        if sub_arn is None:
            raise MQError(f"sqs: cannot subscribe group {group.name!r} to the SNS topic")
        self._calls.call("update the filter policy", self._sns.set_subscription_attributes,
                         SubscriptionArn=sub_arn, AttributeName="FilterPolicy",
                         AttributeValue=attrs.get("FilterPolicy", "{}"))
        return sub_arn

    def _find_subscription(self, queue_arn: str) -> str | None:
        token = None
        while True:
            kwargs: dict[str, Any] = {"TopicArn": self._topic_arn}
            if token:
                kwargs["NextToken"] = token
            resp = self._calls.call("list subscriptions", self._sns.list_subscriptions_by_topic,
                                    **kwargs)
            for sub in resp.get("Subscriptions", []):
                if sub.get("Endpoint") == queue_arn:
                    return str(sub["SubscriptionArn"])
            token = resp.get("NextToken")
            if not token:
                return None

    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        return SQSSubscription(self._calls, self._declare(spec), spec)

    def _queue_url(self, name: str) -> str | None:
        try:
            return str(self._sqs.get_queue_url(QueueName=name)["QueueUrl"])
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _MISSING_QUEUE:
                return None
            raise self._calls.client_error(f"find queue {name}", exc) from exc
        except Exception as exc:
            self._calls.call("find queue", _raise, exc=exc)
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
            page = self._calls.call("list queues", self._sqs.list_queues,
                                    QueueNamePrefix=self._prefix, MaxResults=1000,
                                    **({"NextToken": token} if token else {}))
            urls += [u for u in page.get("QueueUrls", []) if u.endswith("-dlq")]
            token = page.get("NextToken")
            if not token:
                break
        out = []
        for url in urls:
            try:
                tags = self._calls.call("read queue tags", self._sqs.list_queue_tags,
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
                arn = self._calls.call("read queue attributes", self._sqs.get_queue_attributes,
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
            self._calls.call("delete", fn, **kwargs)

    def ping(self) -> None:
        """A queue listing with a prefix no queue has: one request, nothing made."""
        self._calls.call("ping", self._sqs.list_queues, QueueNamePrefix="mqabstract-ping-none")

    def stats(self, group: str) -> GroupStats:
        g = self._lookup(group)
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                 "ApproximateNumberOfMessagesDelayed"]
        main = self._calls.call("read queue attributes", self._sqs.get_queue_attributes,
                                QueueUrl=g.queue_url, AttributeNames=names)["Attributes"]
        dead = self._calls.call("read queue attributes", self._sqs.get_queue_attributes,
                                QueueUrl=g.dlq_url, AttributeNames=names)["Attributes"]
        return GroupStats(
            group,
            int(main.get(names[0], 0)),
            int(main.get(names[1], 0)),
            int(main.get(names[2], 0)),
            sum(int(dead.get(n, 0)) for n in names),
        )

    # -- dead letters -------------------------------------------------------------------------
    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        g = self._lookup(group)
        messages = deadletters.scan_dead(self._calls, g)
        try:
            views = sorted((deadletters.view(m) for m in messages),
                           key=lambda d: (d.dead_lettered_at or d.published_at))
        finally:
            deadletters.release(self._calls, g.dlq_url, messages)
        return views[:limit]

    def _select(self, group: str, ids: Collection[str] | None) -> tuple[_Group, list[Any],
                                                                         list[Any]]:
        g = self._lookup(group)
        messages = deadletters.scan_dead(self._calls, g)
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
                self._calls.send(g.queue_url, wire, 0, g.fifo)
            self._calls.delete_handles(g.dlq_url, [m["ReceiptHandle"] for m in chosen])
        finally:
            deadletters.release(self._calls, g.dlq_url, rest)
        return len(chosen)

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        # Receive + delete rather than PurgeQueue: PurgeQueue works once per 60 s, takes up
        # to a minute, and cannot select ids.
        g, chosen, rest = self._select(group, ids)
        try:
            self._calls.delete_handles(g.dlq_url, [m["ReceiptHandle"] for m in chosen])
        finally:
            deadletters.release(self._calls, g.dlq_url, rest)
        return len(chosen)
