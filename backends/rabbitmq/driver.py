"""The RabbitMQ driver: options, connections, declarations, publishing, dead letters."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import ssl
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import pika
import pika.exceptions as pex

from mqabstract import wire
from mqabstract.capabilities import Capabilities, Feature, Support
from mqabstract.driver import Driver, DriverSubscription
from mqabstract.emulation import dead_letter_from, pick, replay_headers
from mqabstract.errors import (
    Closed,
    ConnectionFailed,
    InvalidArgument,
    MQError,
    PublishError,
)
from mqabstract.model import DeadLetter, Delivery, Envelope, GroupSpec, GroupStats
from mqabstract.options import Option, parse_options
from mqabstract.url import BrokerURL, redact

from .io import _Admin, _describe, _Item, _Link, _Publisher
from .subscription import RabbitMQSubscription
from .watchdog import RELEASE_MARGIN, _Watchdog
from .wire import (
    _HIDDEN_HEADERS,
    CONTENT_TYPE,
    H_COPY,
    H_EXPIRES,
    H_TOPIC,
    TIERS,
    _copy_props,
    _copy_token,
    _dead_headers,
    _expiration,
    _props_with,
    _queue_name,
    _Raw,
)

log = logging.getLogger("mqabstract.rabbitmq")

# ----------------------------------------------------------------------------------------
# the driver


def _release_margin(heartbeat: int) -> float:
    """Capabilities.release_margin: with the lease watchdog, RELEASE_MARGIN; without it (no
    Unix sockets passing descriptors, e.g. Windows) the broker's heartbeat timeout, which
    ends 2-3 heartbeats after the frozen holder's last byte (and never, with heartbeats off)."""
    if _Watchdog.available():
        return RELEASE_MARGIN
    return 3.0 * heartbeat + 1.0 if heartbeat > 0 else math.inf


def _rabbitmq_capabilities(max_body: int, release_margin: float,
                           native_ttl: bool = True) -> Capabilities:
    """What the driver declares; the body limit, native TTL and, where the lease watchdog
    cannot run, the release margin (from the heartbeat) depend on options."""
    f = Feature
    return Capabilities(
        features={
            f.WILDCARDS: Support.NATIVE,
            f.FANOUT: Support.NATIVE,
            f.COMPETING: Support.NATIVE,
            f.LEASE_EXTEND: Support.EMULATED,
            f.NACK_DELAY: Support.EMULATED,
            f.DELAY: Support.EMULATED,
            f.PRIORITY: Support.NATIVE,
            f.ORDERING: Support.EMULATED,
            f.DEAD_LETTER: Support.EMULATED,
            f.BATCH: Support.NATIVE,
            f.TTL: Support.NATIVE if native_ttl else Support.EMULATED,
        },
        max_body_bytes=max_body,
        max_headers=64,
        max_header_bytes=16 * 1024,
        max_delay=365 * 86400.0,
        max_batch=1000,
        max_priority=9,
        max_lease=12 * 3600.0,
        min_lease=0.5,  # leases are timers in the driver's I/O thread
        release_margin=release_margin,  # the lease watchdog (or the heartbeat timeout)
        max_receive=1000,
        # AMQP counts ready messages only, and a consumer's prefetch (up to ``prefetch``,
        # handed back after about a second without a receive) is not among them; unacked
        # counts are the management plugin's, and delayed messages wait in wait-tier queues
        # shared by every group, routed only when due.
        stats={"ready": "approximate", "dead": "exact"},
        lists_groups=False,  # AMQP cannot list queues
        notes={
            f.LEASE_EXTEND: "leases are kept by the driver (RabbitMQ has no visibility "
                            "timeout): an expired message is copied back with attempt+1; "
                            "a watchdog process takes them back from a frozen consumer",
            f.NACK_DELAY: "per-tier wait queues with TTL dead-lettering to the group",
            f.DELAY: "per-tier wait queues with TTL dead-lettering to the exchange; "
                     "re-tiered until due, never early",
            f.PRIORITY: "groups declared priority=True use classic queues with "
                        "x-max-priority (no quorum replication, redelivery counted "
                        "from the redelivered flag); other groups are FIFO quorum queues",
            f.ORDERING: "groups declared ordered=True use x-single-active-consumer (order); "
                        "one message of a key at a time is the portable layer's gate",
            f.DEAD_LETTER: "a classic dead-letter queue per group, filled by the driver",
            f.BATCH: "publisher confirms pipelined on one channel",
            f.TTL: ("per-message expiration; the group queue dead-letters expired messages "
                    "to the group's dead-letter queue (or drops them, expired=\"drop\"), "
                    "at the head of the queue, without a consumer; delayed messages and "
                    "TTLs over 49 days are checked when received" if native_ttl else
                    "checked when received (native_ttl=false)"),
        },
    )


class RabbitMQDriver(Driver):
    """RabbitMQ through pika: topic exchange, a queue per group, emulated leases/delays.

    Concurrency: every public method may be called from any application thread. ``publish``
    runs on the caller's thread through ``_Publisher`` (one publisher at a time, under its
    lock); declarations, stats and dead-letter work through ``_Admin`` (one at a time, under
    its lock); consumers live on the ``_Link`` I/O thread. Retries: ``_Publisher`` re-sends
    what was not confirmed across reconnects until ``publish_timeout``, and ``_Admin`` runs an
    operation a second time after a lost connection; nothing else is retried here. A message
    the broker refused (basic.nack) or returned is never re-sent (except a publish whose wait
    tier vanished: the tier is declared again and that message re-sent once), and a replay
    that moved only some dead letters reports it instead of repeating the copies.
    """

    name: ClassVar[str] = "rabbitmq"

    OPTIONS: ClassVar[dict[str, Option]] = {
        "exchange": Option(str, "mqabstract", "topic exchange; also the prefix of queue names"),
        "prefetch": Option(int, 100, "unacked messages the broker may push to one consumer",
                           min=1),
        "queue_type": Option(str, "auto", "auto (quorum, classic for priority groups), "
                             "quorum or classic", choices=("auto", "quorum", "classic")),
        "heartbeat": Option(int, 30, "AMQP heartbeat, seconds (0: off)", min=0, max=65535),
        # pika needs a positive timeout
        "connect_timeout": Option(float, 10.0, "seconds to establish a connection",
                                  above=0, max=1e6),
        "publish_timeout": Option(float, 30.0, "seconds a publish may wait for confirms, "
                                  "reconnects included", above=0, max=1e6),
        "max_body_bytes": Option(int, 128 * 1024 * 1024 - 64 * 1024,
                                 "largest body accepted (RabbitMQ's max_message_size minus "
                                 "room for properties)"),
        "verify": Option(bool, True, "amqps: verify the server certificate"),
        "ca_file": Option(str, None, "amqps: CA bundle to verify the server with"),
        "native_ttl": Option(bool, True, "expire messages in the broker (per-message "
                             "expiration, group queues dead-letter them); false while group "
                             "queues declared before native TTL (no dead-letter routing: "
                             "RabbitMQ would drop what expires) are in use"),
    }
    CAPABILITIES = _rabbitmq_capabilities(OPTIONS["max_body_bytes"].default,
                                          _release_margin(OPTIONS["heartbeat"].default))

    def __init__(self, url: BrokerURL, opts: Mapping[str, Any]) -> None:
        self._url = url
        self._where = url.redacted()
        self._exchange: str = opts["exchange"]
        self._prefetch: int = opts["prefetch"]
        self._queue_type: str = opts["queue_type"]
        self._publish_timeout: float = opts["publish_timeout"]
        self._native_ttl: bool = opts["native_ttl"]
        self._closed = False
        self._declared: set[tuple[str, str]] = set()
        self._tiers: set[tuple[str, int]] = set()
        params = self._params(url, opts)
        # The blocking connections only talk when called, so they cannot answer heartbeats
        # while idle: they run without, and a dead one is found (and re-opened) on next use.
        quiet = [copy.copy(p) for p in params]
        for p in quiet:
            p.heartbeat = 0
        self._admin = _Admin(quiet, self._where)
        self._link = _Link(params, self._where)
        self._pub = _Publisher(quiet, self._where)
        self._caps = _rabbitmq_capabilities(opts["max_body_bytes"],
                                            _release_margin(opts["heartbeat"]),
                                            self._native_ttl)

    # -- opening ---------------------------------------------------------------------------
    @staticmethod
    def _params(url: BrokerURL, opts: Mapping[str, Any]) -> list[pika.ConnectionParameters]:
        hosts = url.hosts or (("127.0.0.1", None),)
        tls = url.scheme == "amqps"
        ssl_options = None
        if tls:
            context = ssl.create_default_context(cafile=opts["ca_file"])
            if not opts["verify"]:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
        vhost = url.path or "/"
        creds = pika.PlainCredentials(url.username or "guest", url.password or "guest")
        timeout = opts["connect_timeout"]
        out = []
        for host, port in hosts:
            if tls:
                ssl_options = pika.SSLOptions(context, host)
            out.append(pika.ConnectionParameters(
                host=host, port=port or (5671 if tls else 5672), virtual_host=vhost,
                credentials=creds, heartbeat=opts["heartbeat"], ssl_options=ssl_options,
                connection_attempts=1, socket_timeout=timeout, stack_timeout=timeout,
                blocked_connection_timeout=opts["publish_timeout"],
                client_properties={"connection_name": "mqabstract"},
            ))
        return out

    @classmethod
    def open(cls, url: BrokerURL, options: Mapping[str, Any]) -> RabbitMQDriver:
        opts = parse_options(url, options, cls.OPTIONS, cls.name)
        if not opts["exchange"] or len(opts["exchange"]) > 100:
            raise InvalidArgument("exchange must be 1-100 characters")
        driver = cls(url, opts)
        driver._admin.run(
            lambda a: a.ch.exchange_declare(driver._exchange, "topic", durable=True),
            "declaring the exchange",
        )
        try:
            driver._link.start(opts["connect_timeout"])
        except BaseException:
            driver._admin.close()
            raise
        try:
            driver._pub._open()  # no other thread knows the driver yet: no lock needed
        except Exception as exc:
            driver.close()
            raise ConnectionFailed(f"cannot connect to RabbitMQ at {driver._where}: "
                                   f"{redact(_describe(exc))}") from exc
        return driver

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _check(self) -> None:
        if self._closed:
            raise Closed(f"broker {self._where} is closed")

    # -- naming ----------------------------------------------------------------------------
    def _group_queue(self, group: str) -> str:
        return _queue_name(self._exchange, "g", group)

    def _dead_queue(self, group: str) -> str:
        return _queue_name(self._exchange, "dlq", group)

    def _tier_name(self, family: str, ms: int) -> str:
        return _queue_name(self._exchange, "wait", family, str(ms))

    def _queue_args(self, spec: GroupSpec) -> dict[str, Any]:
        kind = self._queue_type
        if kind == "auto":
            kind = "classic" if spec.priority else "quorum"
        args: dict[str, Any] = {}
        if kind == "quorum":
            args["x-queue-type"] = "quorum"
        else:
            args["x-max-priority"] = 9
        if spec.ordered:
            args["x-single-active-consumer"] = True
        if self._native_ttl and spec.expired == "dead_letter":
            # What expires in the queue (a message's TTL) goes to the group's dead letters;
            # without this RabbitMQ drops it, which is what expired="drop" asks for.
            args["x-dead-letter-exchange"] = ""
            args["x-dead-letter-routing-key"] = self._dead_queue(spec.name)
        return args

    # -- message mapping -------------------------------------------------------------------
    def _props(self, env: Envelope, due: float | None) -> pika.BasicProperties:
        # The id travels as the AMQP message id (no mq-id); no mq-topic either: the routing
        # key is the topic until the driver copies the message to a queue by name, and the
        # copy then records it.
        headers: dict[str, Any] = wire.encode(env, id=False, key=True, deliver_at=due)
        content_type = headers.pop(CONTENT_TYPE, None)
        # A delayed message's expiration would end in its wait tier, and RabbitMQ removes
        # it when the tier dead-letters the message on: its TTL is checked when received.
        expiration = (_expiration(headers, time.time())
                      if H_EXPIRES in headers and self._native_ttl and due is None else None)
        return pika.BasicProperties(
            content_type=content_type,
            headers=headers,
            delivery_mode=2,
            priority=env.priority,
            message_id=env.id,
            timestamp=int(env.published_at),
            expiration=expiration,
        )

    def _topic_of(self, raw: _Raw) -> str:
        topic = raw.decoded()[1].topic
        return topic if topic is not None else raw.routing_key

    def _delivery(self, raw: _Raw, attempt: int, receipt: int) -> Delivery:
        props = raw.props
        user, f = raw.decoded()
        headers = dict(user)  # the user's to change; the cached decode stays as received
        if props.content_type:
            headers[CONTENT_TYPE] = props.content_type
        published = f.published_at
        if published is None:
            published = float(props.timestamp) if props.timestamp else time.time()
        if not props.message_id:  # a foreign publisher sent no id: pin one to this copy
            props.message_id = uuid.uuid4().hex
            raw.pinned = True  # the broker's copy has none: it goes back by copy
        return Delivery(
            id=props.message_id,
            topic=f.topic if f.topic is not None else raw.routing_key,
            body=raw.body,
            headers=headers,
            key=f.key,
            priority=props.priority or 0,
            attempt=attempt,
            published_at=published,
            receipt=receipt,
        )

    def _retry_item(self, raw: _Raw, queue: str, delivered: int, due: float | None) -> _Item:
        """A copy of ``raw`` for ``queue`` that had ``delivered`` deliveries (the wire
        codec's attempt rule); through a wait tier if ``due`` is in the future (then ``due``
        is also written down so early arrivals are caught)."""
        props = _copy_props(raw.props, **{H_TOPIC: self._topic_of(raw),
                                          **wire.to_text(wire.retry_fields(delivered, due))})
        if due is not None:
            left = due - time.time()
            if left > 0:
                tier = self._ensure_tier("q", TIERS.tier_for(left))
                return _Item(tier, queue, raw.body, props, True)
        if self._native_ttl:
            props.expiration = _expiration(props.headers, time.time())
        return _Item("", queue, raw.body, props, True)

    # -- delay tiers -----------------------------------------------------------------------
    def _ensure_tier(self, family: str, ms: int) -> str:
        """Declare (once) the fanout exchange + TTL queue of one tier; return the exchange.

        Family ``t`` dead-letters to the topic exchange (routing key = topic), family ``q``
        to the default exchange (routing key = the group's queue name)."""
        name = self._tier_name(family, ms)
        if (family, ms) in self._tiers:
            return name
        target = self._exchange if family == "t" else ""

        def declare(a: _Admin) -> None:
            ch = a.ch
            ch.exchange_declare(name, "fanout", durable=True)
            ch.queue_declare(name, durable=True, arguments={
                "x-message-ttl": ms, "x-dead-letter-exchange": target,
            })
            ch.queue_bind(name, name)

        self._admin.run(declare, f"declaring delay tier {ms} ms")
        self._tiers.add((family, ms))
        return name

    # -- publishing ------------------------------------------------------------------------
    def _items(self, envelopes: Sequence[Envelope]) -> list[_Item]:
        now = time.time()
        items = []
        for env in envelopes:
            due = env.deliver_at if env.deliver_at is not None and env.deliver_at > now else None
            props = self._props(env, due)
            if due is None:
                items.append(_Item(self._exchange, env.topic, env.body, props))
            else:
                tier = self._ensure_tier("t", TIERS.tier_for(due - now))
                items.append(_Item(tier, env.topic, env.body, props, True))
        return items

    def publish(self, envelopes: Sequence[Envelope]) -> None:
        self._check()
        items = self._items(envelopes)
        pend = self._pub.publish(items, self._publish_timeout)
        if pend.returned:  # a wait tier vanished (deleted behind our back): declare, resend
            self._tiers.clear()
            again = self._items([envelopes[i] for i in pend.returned])
            retry = self._pub.publish(again, self._publish_timeout)
            with pend.lock:
                for j in retry.acked:
                    pend.acked.append(pend.returned[j])
                returned, pend.returned = pend.returned, []
                for j in retry.returned:
                    pend.failed[returned[j]] = "the delay tier queue is missing"
                for j, why in retry.failed.items():
                    pend.failed[returned[j]] = why
                pend.doubt += [returned[j] for j in retry.doubt]
        acked = set(pend.acked)
        if len(acked) == len(envelopes):
            return
        failed: dict[int, MQError] = {}
        why = self._pub.last_error or "connection lost"
        doubt = set(pend.doubt)
        for i in range(len(envelopes)):
            if i in acked:
                continue
            if i in pend.failed:
                failed[i] = MQError(f"rabbitmq: {pend.failed[i]}")
            elif i in doubt:
                failed[i] = ConnectionFailed(
                    f"rabbitmq at {self._where}: the connection was lost before the broker "
                    f"confirmed the message ({why}); it may have been published: publishing "
                    "it again may deliver it twice")
            else:
                failed[i] = ConnectionFailed(
                    f"rabbitmq at {self._where}: not confirmed within "
                    f"{self._publish_timeout:g}s ({why})")
        if len(envelopes) == 1:
            raise failed[0]
        raise PublishError.from_outcomes(
            [env.id for env in envelopes], [failed.get(i) for i in range(len(envelopes))],
            by=self._where)

    # -- groups ----------------------------------------------------------------------------
    def declare(self, spec: GroupSpec) -> None:
        self._check()
        if (spec.name, spec.pattern) in self._declared:
            return
        queue = self._group_queue(spec.name)
        args = self._queue_args(spec)

        def declare(a: _Admin) -> None:
            # The dead-letter queue first: the group queue may route expired messages to it.
            a.ch.queue_declare(self._dead_queue(spec.name), durable=True)
            try:
                a.ch.queue_declare(queue, durable=True, arguments=args)
            except pex.ChannelClosedByBroker as exc:
                if exc.reply_code != 406:
                    raise
                # Declared before with other hints (queue type, expired=, or by a version
                # without dead-letter routing): keep the existing queue.
                log.info("rabbitmq: group %r exists with other queue arguments; kept as "
                         "declared first", spec.name)
                a.reset_channel()
                if "x-dead-letter-exchange" in args and self._has_no_routing(a, queue, args):
                    log.warning(
                        "rabbitmq: group %r's queue has no dead-letter routing (declared "
                        "before native TTL, by native_ttl=false or with expired=\"drop\"): "
                        "RabbitMQ drops the messages whose TTL ends in it instead of "
                        "dead-lettering them. Delete and re-declare the group, or connect "
                        "with native_ttl=false while such queues are in use", spec.name)
                a.ch.queue_declare(queue, passive=True)
            a.ch.queue_bind(queue, self._exchange, routing_key=spec.pattern)

        self._admin.run(declare, f"declaring group {spec.name!r}")
        self._declared.add((spec.name, spec.pattern))

    @staticmethod
    def _has_no_routing(a: _Admin, queue: str, args: dict[str, Any]) -> bool:
        """Whether an existing ``queue`` matches ``args`` without the dead-letter routing
        (a declaration with equal arguments succeeds, any other is refused)."""
        bare = {k: v for k, v in args.items() if not k.startswith("x-dead-letter-")}
        try:
            a.ch.queue_declare(queue, durable=True, arguments=bare)
        except pex.ChannelClosedByBroker as exc:
            if exc.reply_code != 406:
                raise
            a.reset_channel()
            return False
        return True

    def subscribe(self, spec: GroupSpec) -> DriverSubscription:
        self._check()
        return RabbitMQSubscription(self, spec)

    # -- dead letters ----------------------------------------------------------------------
    def _drain_dead(self, a: _Admin, group: str, limit: int | None) -> list[tuple[Any, Any, bytes]]:
        """basic.get up to ``limit`` dead letters (unacked, in order)."""
        ch = a.ch
        queue = self._dead_queue(group)
        ch.queue_declare(queue, passive=True)
        got: list[tuple[Any, Any, bytes]] = []
        while limit is None or len(got) < limit:
            method, props, body = ch.basic_get(queue, auto_ack=False)
            if method is None:
                break
            got.append((method, props, body))
        return got

    def _dead_letter(self, props: Any, body: bytes, routing_key: str) -> DeadLetter:
        # The id is the AMQP message id: an ``mq-id`` header (never written by this driver)
        # must not override it, so it is left out before decoding. The content type is a
        # property here and a header for the user.
        headers = {k: v for k, v in _dead_headers(props).items() if k != wire.ID}
        if props.content_type:
            headers[CONTENT_TYPE] = props.content_type
        return dead_letter_from(headers, body, id=props.message_id or "", topic=routing_key,
                                priority=props.priority or 0,
                                published_at=float(props.timestamp or 0),
                                skip=_HIDDEN_HEADERS)

    def dead_letters(self, group: str, limit: int) -> list[DeadLetter]:
        self._check()

        def run(a: _Admin) -> list[DeadLetter]:
            got = self._drain_dead(a, group, limit)
            if got:
                a.ch.basic_nack(got[-1][0].delivery_tag, multiple=True, requeue=True)
            return [self._dead_letter(p, b, m.routing_key) for m, p, b in got]

        return self._admin.run(run, f"listing dead letters of {group!r}")  # type: ignore[no-any-return]

    def replay_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        self._check()
        queue = self._group_queue(group)

        def run(a: _Admin) -> int:
            a.ch.queue_declare(queue, passive=True)
            got = self._drain_dead(a, group, None)
            picked = pick(got, ids, lambda g: g[1].message_id)
            items = []
            for _m, props, body in picked:
                fresh = _props_with(props, replay_headers(_dead_headers(props)))
                # a copy token of its own: never taken for the message it was
                # (consumer._Superseded), which may still come back from a cut
                fresh.headers[H_COPY] = _copy_token()
                items.append(_Item("", queue, body, fresh, True))
            pend = self._pub.publish(items, self._publish_timeout) if items else None
            moved = set(pend.acked) if pend is not None else set()
            ch = a.ch
            keep = {id(g) for j, g in enumerate(picked) if j in moved}
            for g in got:
                if id(g) in keep:
                    ch.basic_ack(g[0].delivery_tag)
                else:
                    ch.basic_nack(g[0].delivery_tag, requeue=True)
            if pend is not None and len(moved) < len(items):
                raise ConnectionFailed(f"rabbitmq at {self._where}: replayed {len(moved)} of "
                                       f"{len(items)} dead letters; retry for the rest")
            return len(moved)

        return self._admin.run(run, f"replaying dead letters of {group!r}")  # type: ignore[no-any-return]

    def purge_dead_letters(self, group: str, ids: Collection[str] | None) -> int:
        self._check()
        queue = self._dead_queue(group)

        def run(a: _Admin) -> int:
            if ids is None:
                a.ch.queue_declare(queue, passive=True)
                return int(a.ch.queue_purge(queue).method.message_count)
            got = self._drain_dead(a, group, None)
            count = 0
            for method, props, _body in got:
                if props.message_id in ids:
                    a.ch.basic_ack(method.delivery_tag)
                    count += 1
                else:
                    a.ch.basic_nack(method.delivery_tag, requeue=True)
            return count

        return self._admin.run(run, f"purging dead letters of {group!r}")  # type: ignore[no-any-return]

    def stats(self, group: str) -> GroupStats:
        self._check()

        def run(a: _Admin) -> GroupStats:
            ready = a.ch.queue_declare(self._group_queue(group), passive=True)
            dead = a.ch.queue_declare(self._dead_queue(group), passive=True)
            return GroupStats(group, ready.method.message_count, None, None,
                              dead.method.message_count)

        return self._admin.run(run, f"stats of group {group!r}")  # type: ignore[no-any-return]

    def ping(self) -> None:
        """A passive declare of a built-in exchange: one AMQP round trip, nothing made."""
        self._check()
        self._admin.run(lambda a: a.ch.exchange_declare("amq.topic", "topic", passive=True),
                        "ping")

    def delete_group(self, group: str) -> None:
        self._check()

        def run(a: _Admin) -> None:
            a.ch.queue_declare(self._group_queue(group), passive=True)
            a.ch.queue_delete(self._group_queue(group))
            a.ch.queue_delete(self._dead_queue(group))

        try:
            self._admin.run(run, f"deleting group {group!r}")
        finally:
            self._declared = {d for d in self._declared if d[0] != group}

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self._link.subs):
            with contextlib.suppress(Exception):
                sub.close()
        self._link.stop()
        self._pub.close()
        self._admin.close()
