"""What every ``mqa`` command shares: exit codes, usage errors, input and output helpers."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Sequence
from typing import IO, Any, NoReturn

from .. import connect
from ..broker import Broker, Message
from ..errors import (
    ConnectionFailed,
    InvalidArgument,
    NotFound,
    Timeout,
    Unsupported,
    ValidationError,
)
from ..model import DeadLetter

EXIT_OK = 0
EXIT_ERROR = 1  #: any other MQError (and unexpected errors)
EXIT_INVALID = 2  #: bad input: ValidationError (InvalidURL, InvalidName, ...), Unsupported
EXIT_UNAVAILABLE = 3  #: ConnectionFailed, Timeout: the broker could not be reached in time
EXIT_NOT_FOUND = 4  #: NotFound (unknown group, dead letter)
EXIT_USAGE = 64  #: wrong command line (unknown option, missing argument)
EXIT_INTERRUPTED = 130  #: Ctrl-C

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_ERROR: "other error (MQError, missing dependency, unexpected failure)",
    EXIT_INVALID: "bad input: ValidationError (invalid URL/scheme, name, argument, too large, "
    "encode error) or Unsupported feature",
    EXIT_UNAVAILABLE: "broker unreachable: ConnectionFailed or Timeout",
    EXIT_NOT_FOUND: "NotFound: unknown group or dead letter",
    EXIT_USAGE: "usage error: unknown command or option, missing argument",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class UsageError(Exception):
    """Wrong command line; printed with the command's usage."""

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage


def exit_code(exc: BaseException) -> int:
    """The process exit code for an exception raised by a command."""
    if isinstance(exc, (ValidationError, Unsupported)):
        return EXIT_INVALID
    if isinstance(exc, (ConnectionFailed, Timeout)):
        return EXIT_UNAVAILABLE
    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    return EXIT_ERROR


class _Parser(argparse.ArgumentParser):
    """Raise ``UsageError`` instead of exiting, so ``main`` returns an int."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage())


# -- small helpers ----------------------------------------------------------------------------
def _stdin_bytes() -> bytes:
    stream = sys.stdin
    if stream is None:
        raise InvalidArgument("no body: give BODY, --file, or pipe it on stdin")
    if stream.isatty():
        raise InvalidArgument("no body: give BODY, --file, or pipe it on stdin (stdin is a tty)")
    buffer = getattr(stream, "buffer", None)
    return buffer.read() if buffer is not None else stream.read().encode("utf-8")


def _read_file(path: str) -> bytes:
    if path == "-":
        return _stdin_bytes()
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror or exc}") from exc


def _headers(pairs: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidArgument(f"header {pair!r} is not name=value")
        out[name] = value
    return out


def _json_value(data: bytes | str, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from exc


def _body_fields(body: bytes) -> dict[str, str]:
    """``body`` as text when it is UTF-8, else base64; ``body_encoding`` says which."""
    try:
        return {"body": body.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode("ascii"), "body_encoding": "base64"}


def message_record(msg: Message | DeadLetter) -> dict[str, Any]:
    """The JSON-lines record printed for a received message or a dead letter."""
    record: dict[str, Any] = {"id": msg.id, "topic": msg.topic, "key": msg.key,
                              "priority": msg.priority}
    if isinstance(msg, DeadLetter):
        record["attempts"] = msg.attempts
        record["reason"] = msg.reason
        record["published_at"] = msg.published_at.isoformat()
        record["dead_lettered_at"] = (
            msg.dead_lettered_at.isoformat() if msg.dead_lettered_at else None
        )
    else:
        record["attempt"] = msg.attempt
        record["published_at"] = msg.published_at.isoformat()
    record["headers"] = dict(msg.headers)
    record.update(_body_fields(msg.body))
    return record


def _emit(record: object, out: IO[str]) -> None:
    out.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
    out.flush()


def _connect(args: argparse.Namespace) -> Broker:
    return connect(args.url)
