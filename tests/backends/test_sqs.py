"""SQS backend: interop with plain boto3, naming and filter-policy mapping, wire format."""

from __future__ import annotations

import json
import os
import secrets
import time

import pytest

boto3 = pytest.importorskip("boto3")

import mqabstract  # noqa: E402
from mqabstract.backends.sqs import (  # noqa: E402
    MAX_BODY,
    QUEUE_NAME_MAX,
    SNS_MAX_MESSAGE,
    _queue_base,
    filter_policy,
)
from mqabstract.names import topic_matches  # noqa: E402
from tests.brokers import resolve_url  # noqa: E402


@pytest.fixture(scope="module")
def url() -> str:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(var, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    return resolve_url("sqs")


def _raw(url: str) -> tuple[object, object]:
    parsed = mqabstract.BrokerURL.parse(url)
    params = parsed.param_dict()
    kw = {"region_name": params.get("region"), "endpoint_url": params.get("endpoint_url")}
    return boto3.client("sqs", **kw), boto3.client("sns", **kw)


def test_mqabstract_publish_is_readable_by_plain_boto3(url, mq, names) -> None:
    group, root = names
    mq.declare(group, f"{root}.#")
    queue = mq._driver.queue_url(group)
    mq.publish(f"{root}.created", {"order": 42}, headers={"tenant": "acme", "trace-id": "x1"},
               key="customer-7", id="order-42")
    sqs, _ = _raw(url)
    resp = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=1, WaitTimeSeconds=5,
                               MessageAttributeNames=["All"])
    [msg] = resp["Messages"]
    assert json.loads(msg["Body"]) == {"order": 42}  # text bodies travel as they are
    attrs = {k: v["StringValue"] for k, v in msg["MessageAttributes"].items()}
    assert attrs["tenant"] == "acme" and attrs["trace-id"] == "x1"
    assert attrs["content-type"] == "application/json"
    assert attrs["mq-topic"] == f"{root}.created"
    meta = json.loads(attrs["mq"])
    assert meta["i"] == "order-42" and meta["k"] == "customer-7"
    sqs.delete_message(QueueUrl=queue, ReceiptHandle=msg["ReceiptHandle"])


def test_an_answer_that_is_not_an_aws_response_is_connection_failed(url) -> None:
    """moto answers ``region=1e309`` with an HTML 500 page; botocore raises its
    ResponseParserError, which is not a BotoCoreError: it escaped ``connect`` raw
    (found by the fuzzed-options test)."""
    with pytest.raises(mqabstract.ConnectionFailed, match="not an SQS/SNS response"):
        mqabstract.connect(url + ("&" if "?" in url else "?") + "region=1e309").close()


def test_binary_body_is_base64_with_a_flag(url, mq, names) -> None:
    group, root = names
    mq.declare(group, f"{root}.#")
    mq.publish(f"{root}.bin", b"\x00\xff\xfe")
    sqs, _ = _raw(url)
    resp = sqs.receive_message(QueueUrl=mq._driver.queue_url(group), WaitTimeSeconds=5,
                               MessageAttributeNames=["All"])
    [msg] = resp["Messages"]
    meta = json.loads(msg["MessageAttributes"]["mq"]["StringValue"])
    assert meta["e"] == "b" and msg["Body"] == "AP/+"


def test_plain_boto3_send_reaches_an_mqabstract_group(url, mq, names) -> None:
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    sqs, _ = _raw(url)
    sent = sqs.send_message(
        QueueUrl=mq._driver.queue_url(group), MessageBody="héllo from boto3",
        MessageAttributes={"source": {"DataType": "String", "StringValue": "legacy"}},
    )
    [msg] = sub.receive(1, 5)
    assert msg.body == "héllo from boto3".encode()
    assert msg.headers == {"source": "legacy"}
    assert msg.id == sent["MessageId"] and msg.attempt == 1
    msg.ack()
    assert sub.receive(1, 1) == []


def test_plain_sns_publish_with_topic_attribute_is_routed(url, mq, names) -> None:
    group, root = names
    sub = mq.subscribe(group, f"{root}.*.created")
    _, sns = _raw(url)
    topic_arn = mq._driver._topic_arn
    for topic in (f"{root}.eu.created", f"{root}.eu.deleted", f"{root}.eu.x.created"):
        sns.publish(TopicArn=topic_arn, Message=topic, MessageGroupId="g",
                    MessageDeduplicationId=secrets.token_hex(8),
                    MessageAttributes={"mq-topic": {"DataType": "String", "StringValue": topic}})
    got = sub.receive(10, 3)
    assert [m.body for m in got] == [f"{root}.eu.created".encode()]
    got[0].ack()
    # The prefix filter admitted the other two; the driver deleted them instead of delivering.
    assert sub.receive(10, 1) == []
    stats = mq.stats(group)
    assert stats.ready == 0 and stats.leased == 0


def test_many_headers_are_packed_and_round_trip(mq, names) -> None:
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    headers = {f"h{i}": str(i) for i in range(20)} | {"empty": ""}
    mq.publish(f"{root}.h", b"x", headers=headers)
    [msg] = sub.receive(1, 5)
    assert dict(msg.headers) == headers
    msg.ack()


def test_largest_body_fits_sns_worst_case(mq, names) -> None:
    group, root = names
    sub = mq.subscribe(group, f"{root}.#")
    body = bytes(range(256)) * (MAX_BODY // 256) + b"\xff" * (MAX_BODY % 256)
    headers = {f"k{i}": "v" * 100 for i in range(60)}
    mq.publish(f"{root}.big", body, headers=headers, key="é" * 256, id="~" * 128)
    [msg] = sub.receive(1, 5)
    assert msg.body == body and dict(msg.headers) == headers
    msg.ack()


def test_queue_names_fit_sqs_rules() -> None:
    long_group = "a." * 99 + "b"
    base = _queue_base("mqa-", long_group)
    assert len(base + ".fifo") <= QUEUE_NAME_MAX and len(base + "-dlq") <= QUEUE_NAME_MAX
    assert _queue_base("mqa-", "a.b") != _queue_base("mqa-", "a_b")
    assert _queue_base("mqa-", "x-dlq") + "-dlq" != _queue_base("mqa-", "x") + "-dlq"
    assert _queue_base("mqa-", "x-dlq") != _queue_base("mqa-", "x") + "-dlq"
    assert _queue_base("mqa-", "orders") == "mqa-orders"


@pytest.mark.parametrize(
    "pattern",
    ["a.b.c", "a.#", "a.*", "#.c", "*.c", "a.*.c", "a.#.c", "#", "*", "*.b.*", "#.b.#"],
)
def test_filter_policy_is_a_superset_of_the_pattern(pattern: str) -> None:
    policy = filter_policy(pattern)
    topics = ["a", "c", "a.b", "a.c", "b.c", "a.b.c", "a.x.y.c", "x.b.y", "b", "ab.c", "a.bc"]
    for topic in topics:
        if not topic_matches(pattern, topic):
            continue
        assert policy is None or _admits(policy["mq-topic"], topic), (pattern, topic)


def _admits(rules: list, topic: str) -> bool:
    for rule in rules:
        if isinstance(rule, str) and rule == topic:
            return True
        if isinstance(rule, dict):
            if "prefix" in rule and topic.startswith(rule["prefix"]):
                return True
            if "suffix" in rule and topic.endswith(rule["suffix"]):
                return True
    return False


def test_body_limit_leaves_room_for_base64_and_attributes() -> None:
    assert (MAX_BODY + 2) // 3 * 4 + 20 * 1024 <= SNS_MAX_MESSAGE


def test_batch_lanes_keep_each_keys_order(mq, names) -> None:
    """A publish_batch goes out on parallel lanes; one key's messages share a lane, so an
    ordered (FIFO) group still gets each key's messages in publish order."""
    group, root = names
    sub = mq.subscribe(group, f"{root}.#", ordered=True, lease=30)
    keys = [f"k{i % 5}" for i in range(60)]
    ids = mq.publish_batch([mqabstract.OutgoingMessage(f"{root}.a", f"{i}".encode(), key=k)
                            for i, k in enumerate(keys)])
    got: list[mqabstract.Message] = []
    deadline = time.monotonic() + 60
    while len(got) < len(ids) and time.monotonic() < deadline:
        batch = sub.receive(10, 1)
        got.extend(batch)
        sub.ack_many(batch)
    assert sorted(m.id for m in got) == sorted(ids)
    for key in set(keys):
        bodies = [int(m.body) for m in got if m.key == key]
        assert bodies == sorted(bodies), (key, bodies)


def test_a_failed_lane_names_what_was_published_and_what_not(mq, names, monkeypatch) -> None:
    """One SNS call fails: its messages and its lane's later ones are reported failed,
    every other lane's messages published (PublishError says which)."""
    group, root = names
    sub = mq.subscribe(group, f"{root}.#", lease=30)
    driver = mq._driver
    call = driver._calls.call
    poisoned = "poison"

    def flaky(what: str, fn: object, **kwargs: object) -> object:
        entries = kwargs.get("PublishBatchRequestEntries") or []
        if any(poisoned in e["Message"] for e in entries):  # type: ignore[index]
            raise mqabstract.ConnectionFailed("sqs: injected failure")
        return call(what, fn, **kwargs)

    monkeypatch.setattr(driver._calls, "call", flaky)
    msgs = [mqabstract.OutgoingMessage(f"{root}.a", poisoned if i == 3 else f"m{i}",
                                       key=f"k{i % 8}", id=f"{root}-{i}") for i in range(80)]
    with pytest.raises(mqabstract.PublishError) as info:
        mq.publish_batch(msgs)
    err = info.value
    assert 3 in err.failed and err.published
    assert set(err.published).isdisjoint({f"{root}-{i}" for i in err.failed})
    assert len(err.published) + len(err.failed) == len(msgs)
    got: set[str] = set()
    deadline = time.monotonic() + 60
    while len(got) < len(err.published) and time.monotonic() < deadline:
        batch = sub.receive(10, 1)
        got.update(m.id for m in batch)
        sub.ack_many(batch)
    assert got == set(err.published)  # exactly what was reported published arrived


def _dlq_depth(mq: mqabstract.Broker, group: str) -> int:
    """Entries physically in the group's dead-letter queue (moto's count is exact)."""
    sqs = mq._driver._sqs
    attrs = sqs.get_queue_attributes(
        QueueUrl=mq._driver._lookup(group).dlq_url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return sum(int(v) for v in attrs.values())


def test_a_dead_letter_move_cut_before_its_delete_is_one_dead_letter(mq, names,
                                                                       monkeypatch) -> None:
    """Dead-lettering is a send to the dead-letter queue, then a delete from the group
    queue. A consumer killed between the two leaves the message in the group queue; it
    comes back past max_attempts and is dead-lettered again: a second entry for the id.
    The group still lists, replays and purges one dead letter per id, with the attempts
    of the first move."""
    group, root = names
    sub = mq.subscribe(group, f"{root}.#", lease=1, max_attempts=1)
    mid = mq.publish(f"{root}.x", b"once")
    [msg] = sub.receive(1, 10)
    assert msg.attempt == 1
    driver = mq._driver

    def killed(queue_url: str, handles: object) -> None:
        raise mqabstract.ConnectionFailed("sqs: injected: the consumer died here")

    monkeypatch.setattr(driver._calls, "delete_handles", killed)
    with pytest.raises(mqabstract.ConnectionFailed):
        msg.nack()  # the final attempt: dead-lettered, the original not deleted
    monkeypatch.undo()
    # The original comes back after its lease with attempt 2 > max_attempts: the receive
    # dead-letters it (nothing is returned) and deletes it this time.
    deadline = time.monotonic() + 30
    while _dlq_depth(mq, group) < 2 and time.monotonic() < deadline:
        assert not sub.receive(1, 1)
    assert _dlq_depth(mq, group) == 2  # the scenario happened: two entries for one id
    dead = mq.dead_letters(group)
    assert [(d.id, d.attempts) for d in dead] == [(mid, 1)]
    assert _dlq_depth(mq, group) == 1  # the redundant entry is gone
    assert mq.replay_dead_letters(group) == 1
    [again] = sub.receive(1, 10)
    assert (again.id, again.attempt) == (mid, 1)
    again.ack()
    assert not sub.receive(1, 2)
