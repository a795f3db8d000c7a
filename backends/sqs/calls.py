"""The boto3 clients behind an SQS driver and its subscriptions: one translation of boto3
errors into ``MQError``, and the queue writes both sides make (a copy sent, receipts
deleted). Its own module so that the driver and the subscription share it without
importing each other."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import botocore.exceptions
import botocore.parsers

from mqabstract.errors import ConnectionFailed, MQError, NotFound, Timeout
from mqabstract.url import BrokerURL, redact

from .wire import BATCH, _Wire

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


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _raise(exc: BaseException) -> None:
    raise exc


class Calls:
    """The SQS and SNS clients (boto3 clients are thread-safe, so any thread may call);
    nothing here retries beyond botocore's own retry policy."""

    def __init__(self, url: BrokerURL, sqs: Any, sns: Any) -> None:
        self._url = url
        self.sqs = sqs
        self.sns = sns

    def call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except botocore.exceptions.ClientError as exc:
            raise self.client_error(what, exc) from exc
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
        except botocore.parsers.ResponseParserError as exc:
            # Not a BotoCoreError: the endpoint answered with something that is not an
            # AWS response (moto's HTML 500 page for region=1e309, a proxy's error page).
            raise ConnectionFailed(
                f"sqs: {what} at {self._url.redacted()}: the endpoint's answer is not an "
                f"SQS/SNS response: {redact(str(exc))[:300]}"
            ) from exc

    def client_error(self, what: str, exc: botocore.exceptions.ClientError) -> MQError:
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

    def send(self, queue_url: str, wire: _Wire, delay: int, fifo: bool) -> None:
        kwargs: dict[str, Any] = {
            "QueueUrl": queue_url, "MessageBody": wire.body,
            "MessageAttributes": wire.attributes,
        }
        if fifo:
            kwargs["MessageGroupId"] = wire.group_id
            kwargs["MessageDeduplicationId"] = uuid.uuid4().hex  # a deliberate new copy
        elif delay > 0:
            kwargs["DelaySeconds"] = delay
        self.call("send", self.sqs.send_message, **kwargs)

    def delete_handles(self, queue_url: str, handles: Sequence[str]) -> None:
        for start in range(0, len(handles), BATCH):
            chunk = handles[start : start + BATCH]
            resp = self.call(
                "delete", self.sqs.delete_message_batch, QueueUrl=queue_url,
                Entries=[{"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(chunk)],
            )
            bad = [f for f in resp.get("Failed", []) if f.get("Code") not in _STALE_CODES]
            if bad:
                raise MQError(f"sqs: {len(bad)} deletes failed: {bad[0].get('Code')}: "
                              f"{bad[0].get('Message', '')}")
