"""SQS backend next to raw boto3 making the same calls, in the same run, as ratios.

    .venv/bin/python bench/bench_sqs.py [--url sqs://...] [-n 300] [--rounds 3]

Measures (messages per second, best of ``--rounds``, mqabstract and raw interleaved):

* publish, single: ``Broker.publish`` vs ``sns.publish`` with the same attributes;
* publish, batch: ``Broker.publish_batch`` vs ``sns.publish_batch`` in tens;
* receive + ack: ``Subscription.receive(10)`` + ``Message.ack()`` vs
  ``sqs.receive_message(10)`` + ``sqs.delete_message`` per message, each on its own group
  queue filled with the same messages.

Targets: every mqabstract/raw ratio ≥ 0.9; mqabstract batch ≥ 5x mqabstract single.
Publishes go to a topic no group matches so queues stay shallow (moto slows with depth).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import boto3

import mqabstract

DEFAULT_URL = "sqs://?region=us-east-1&endpoint_url=http://127.0.0.1:5055"


def _attrs(topic: str, mid: str) -> dict[str, dict[str, str]]:
    meta = json.dumps({"v": 1, "i": mid, "t": time.time()}, separators=(",", ":"))
    return {
        "mq-topic": {"DataType": "String", "StringValue": topic},
        "content-type": {"DataType": "String", "StringValue": "text/plain; charset=utf-8"},
        "mq": {"DataType": "String", "StringValue": meta},
    }


def _dedup(topic: str, mid: str) -> str:
    return hashlib.sha256(f"{topic}\n{mid}".encode()).hexdigest()


def timed(fn: Callable[[], int]) -> float:
    start = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=os.environ.get("MQ_TEST_SQS_URL", DEFAULT_URL))
    ap.add_argument("-n", type=int, default=300, help="messages per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(var, "testing")

    mq = mqabstract.connect(args.url)
    params = mqabstract.BrokerURL.parse(args.url).param_dict()
    kw = {"region_name": params.get("region"), "endpoint_url": params.get("endpoint_url")}
    sns = boto3.client("sns", **kw)
    sqs = boto3.client("sqs", **kw)
    topic_arn = mq._driver._topic_arn  # the driver's SNS FIFO topic
    token = "b" + secrets.token_hex(4)
    nobody = f"bench.{token}.nobody"  # matched by no group: publish cost only
    body = "x" * 200
    n = args.n

    def mq_single() -> int:
        for _ in range(n):
            mq.publish(nobody, body)
        return n

    def raw_single() -> int:
        for _ in range(n):
            mid = uuid.uuid4().hex
            sns.publish(TopicArn=topic_arn, Message=body, MessageAttributes=_attrs(nobody, mid),
                        MessageGroupId=mid, MessageDeduplicationId=_dedup(nobody, mid))
        return n

    def mq_batch() -> int:
        mq.publish_batch([(nobody, body)] * n)
        return n

    def raw_batch() -> int:
        for start in range(0, n, 10):
            entries = []
            for i in range(start, min(n, start + 10)):
                mid = uuid.uuid4().hex
                entries.append({"Id": str(i), "Message": body,
                                "MessageAttributes": _attrs(nobody, mid),
                                "MessageGroupId": mid,
                                "MessageDeduplicationId": _dedup(nobody, mid)})
            sns.publish_batch(TopicArn=topic_arn, PublishBatchRequestEntries=entries)
        return n

    g_mq, g_raw = f"bench-{token}-mq", f"bench-{token}-raw"
    sub = mq.subscribe(g_mq, f"bench.{token}.fill")
    mq.declare(g_raw, f"bench.{token}.fill")
    raw_queue = mq._driver.queue_url(g_raw)

    def fill() -> None:
        mq.publish_batch([(f"bench.{token}.fill", body)] * n)

    def mq_consume() -> int:
        got = 0
        while got < n:
            msgs = sub.receive(10, 5)
            if not msgs:
                break
            for m in msgs:
                m.ack()
            got += len(msgs)
        return got

    def raw_consume() -> int:
        got = 0
        while got < n:
            resp = sqs.receive_message(
                QueueUrl=raw_queue, MaxNumberOfMessages=10, WaitTimeSeconds=5,
                VisibilityTimeout=30, MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
            )
            msgs = resp.get("Messages", [])
            if not msgs:
                break
            for m in msgs:
                sqs.delete_message(QueueUrl=raw_queue, ReceiptHandle=m["ReceiptHandle"])
            got += len(msgs)
        return got

    results: dict[str, list[float]] = {k: [] for k in
                                       ("mq_single", "raw_single", "mq_batch", "raw_batch",
                                        "mq_consume", "raw_consume")}
    try:
        for _ in range(args.rounds):
            results["mq_single"].append(timed(mq_single))
            results["raw_single"].append(timed(raw_single))
            results["mq_batch"].append(timed(mq_batch))
            results["raw_batch"].append(timed(raw_batch))
            fill()
            results["mq_consume"].append(timed(mq_consume))
            results["raw_consume"].append(timed(raw_consume))
    finally:
        sub.close()
        mq.delete_group(g_mq)
        mq.delete_group(g_raw)
        mq.close()

    best = {k: max(v) for k, v in results.items()}
    print(f"SQS bench against {args.url} (n={n}, best of {args.rounds}, msg/s)")
    rows = [("publish single", "mq_single", "raw_single"),
            ("publish batch", "mq_batch", "raw_batch"),
            ("receive + ack", "mq_consume", "raw_consume")]
    ok = True
    for label, a, b in rows:
        ratio = best[a] / best[b]
        ok &= ratio >= 0.9
        print(f"  {label:15s} mqabstract {best[a]:9.0f}   raw boto3 {best[b]:9.0f}   "
              f"ratio {ratio:5.2f}  (target ≥ 0.90)")
    batch_gain = best["mq_batch"] / best["mq_single"]
    ok &= batch_gain >= 5
    print(f"  publish_batch / single publish (mqabstract): {batch_gain:5.2f}x  (target ≥ 5)")
    print("targets met" if ok else "targets NOT met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
