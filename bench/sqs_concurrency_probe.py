"""Does the SQS stand-in here take concurrent publish calls faster than one at a time?

    .venv/bin/python bench/sqs_concurrency_probe.py [--endpoint http://127.0.0.1:5055]
        [--calls 40] [--workers 1,4,8]

For each worker count: a fresh SNS topic with one raw-delivery SQS queue subscribed, then
``calls`` SNS ``PublishBatch`` calls of 10 messages (110 bytes) from that many threads.
Prints messages per second. Used to decide whether the SQS driver should send its batches
of 10 concurrently (on AWS each call waits tens of milliseconds, so it would help there);
numbers, not tests.
"""

from __future__ import annotations

import argparse
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import boto3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="http://127.0.0.1:5055")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--workers", default="1,4,8")
    args = ap.parse_args()
    kw = {"region_name": "us-east-1", "endpoint_url": args.endpoint,
          "aws_access_key_id": "probe", "aws_secret_access_key": "probe"}
    sns, sqs = boto3.client("sns", **kw), boto3.client("sqs", **kw)
    for workers in (int(w) for w in args.workers.split(",")):
        tag = secrets.token_hex(4)
        topic = sns.create_topic(Name=f"probe-{tag}")["TopicArn"]
        queue = sqs.create_queue(QueueName=f"probe-{tag}")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])[
            "Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn,
                      Attributes={"RawMessageDelivery": "true"})

        def call(_: int, topic: str = topic) -> None:
            sns.publish_batch(TopicArn=topic, PublishBatchRequestEntries=[
                {"Id": str(j), "Message": "x" * 110} for j in range(10)])

        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(call, range(args.calls)))
        took = time.perf_counter() - start
        print(f"workers={workers}: {args.calls * 10 / took:,.0f} msg/s")
        sns.delete_topic(TopicArn=topic)
        sqs.delete_queue(QueueUrl=queue)


if __name__ == "__main__":
    main()
