"""Body encoding: bytes pass through, str is UTF-8, JSON values carry a content-type.

Never pickle: a broker is a trust boundary, and unpickling is code execution.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import DecodeError, EncodeError
from .typed import is_model_instance, model_json

__all__ = ["CONTENT_TYPE", "JSON", "TEXT", "Body", "decode", "encode"]

CONTENT_TYPE = "content-type"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"

#: What ``publish`` accepts as a body.
Body = bytes | bytearray | memoryview | str | dict[str, Any] | list[Any] | int | float | bool


def encode(value: object) -> tuple[bytes, str | None]:
    """Return ``(body_bytes, content_type)``; content_type is None for raw bytes."""
    if isinstance(value, bytes):
        return value, None
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value), None
    if isinstance(value, str):
        try:
            return value.encode("utf-8"), TEXT
        except UnicodeEncodeError as exc:  # lone surrogates
            raise EncodeError(f"str body is not valid Unicode: {exc.reason}") from exc
    if value is None:
        raise EncodeError("body is None; publish b'' for an empty body")
    if isinstance(value, (dict, list, int, float)):  # bool is an int
        if isinstance(value, float) and not math.isfinite(value):
            raise EncodeError(f"body {value!r} is not representable in JSON")
        try:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            return text.encode("utf-8"), JSON
        except (TypeError, ValueError, UnicodeEncodeError) as exc:
            raise EncodeError(f"body is not JSON-serialisable: {exc}") from exc
        except RecursionError:  # nested deeper than the interpreter's stack
            raise EncodeError("body is nested too deeply to encode as JSON") from None
    if is_model_instance(value):  # a pydantic model or a dataclass instance: its JSON
        return model_json(value), JSON
    raise EncodeError(
        f"cannot encode body of type {type(value).__name__}: "
        "use bytes, str, a JSON value (dict, list, number, bool), a pydantic model or "
        "a dataclass"
    )


def decode(body: bytes, content_type: str | None) -> Any:
    """Decode a received body according to its content-type header (bytes if none)."""
    if not content_type:
        return body
    ctype = content_type.split(";", 1)[0].strip().lower()
    try:
        if ctype == JSON or ctype.endswith("+json"):
            return json.loads(body.decode("utf-8"))
        if ctype.startswith("text/"):
            return body.decode("utf-8")
    except (UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"body does not decode as {content_type!r}: {exc}") from exc
    except RecursionError:
        raise DecodeError(f"body is nested too deeply to decode as {content_type!r}") from None
    return body
