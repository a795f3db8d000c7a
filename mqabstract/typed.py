"""Typed payloads: pydantic v2 models and dataclasses as message bodies.

Publishing an instance sends its JSON (``application/json``); ``subscribe(…, model=T)``
makes ``Message.value`` a ``T`` built from the received JSON, and a payload that does not
validate raises ``InvalidPayload`` (``consume`` dead-letters it, since retrying cannot fix
it). Pydantic does its own validation; dataclasses are checked here, field by field, against
their annotations (str, int, float, bool, None, Optional/unions, Literal, Enum, list, tuple,
set, dict, datetime, date, UUID, Decimal and nested dataclasses; ``Any`` passes anything).
Nothing is ever unpickled or evaluated beyond the annotations the application wrote.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import functools
import json
import types
import typing
import uuid
from collections import abc
from decimal import Decimal
from typing import Any

from .errors import EncodeError, InvalidArgument, InvalidPayload

__all__ = ["Model", "is_model_instance", "model_json"]


def _is_pydantic_class(tp: object) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_validate") and hasattr(
        tp, "model_fields")


def is_model_instance(value: object) -> bool:
    """A pydantic model or dataclass instance (what ``publish`` turns into JSON)."""
    return (_is_pydantic_class(type(value)) or
            (dataclasses.is_dataclass(value) and not isinstance(value, type)))


def model_json(value: object) -> bytes:
    """The JSON of a model instance; ``EncodeError`` when a field has no JSON form."""
    if _is_pydantic_class(type(value)):
        try:
            return bytes(value.model_dump_json().encode("utf-8"))  # type: ignore[attr-defined]
        except Exception as exc:  # pydantic's PydanticSerializationError and friends
            raise EncodeError(f"{type(value).__name__} does not serialise: {exc}") from None
    try:
        plain = _plain(value, type(value).__name__)
        return json.dumps(plain, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")
    except ValueError as exc:  # nan / inf
        raise EncodeError(f"{type(value).__name__} does not serialise: {exc}") from None
    except RecursionError:
        raise EncodeError(f"{type(value).__name__} is nested too deeply") from None


def _plain(value: object, path: str) -> Any:
    """A dataclass instance (or a value inside one) as JSON-ready Python values."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), f"{path}.{f.name}")
                for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value, path)
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, (uuid.UUID, Decimal)):
        return str(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise EncodeError(f"{path} has a key of type {type(k).__name__}; JSON keys "
                                  "are str")
            out[k] = _plain(v, f"{path}[{k!r}]")
        return out
    raise EncodeError(f"{path} is a {type(value).__name__}, which has no JSON form")


class Model:
    """How a subscription builds its ``model`` from a decoded JSON value."""

    def __init__(self, tp: object) -> None:
        if _is_pydantic_class(tp):
            self.load = self._pydantic
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            self.load = self._dataclass
            try:
                _shape(tp)
            except Exception as exc:
                raise InvalidArgument(f"model {tp.__name__}: annotations do not resolve: "
                                      f"{exc}") from None
        else:
            raise InvalidArgument(f"model must be a pydantic model class or a dataclass, "
                                  f"got {tp!r}")
        self.type: type = tp  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Model({self.type.__name__})"

    def _pydantic(self, value: Any) -> Any:
        try:
            return self.type.model_validate(value)  # type: ignore[attr-defined]
        except Exception as exc:  # pydantic.ValidationError (pydantic is an optional extra)
            raise InvalidPayload(f"not a valid {self.type.__name__}: {_one_line(exc)}") \
                from None

    def _dataclass(self, value: Any) -> Any:
        try:
            return _build(value, self.type, self.type.__name__)
        except InvalidPayload:
            raise
        except Exception as exc:  # a number too big for float, a __post_init__, recursion
            raise InvalidPayload(f"not a valid {self.type.__name__}: {type(exc).__name__}: "
                                 f"{_one_line(exc)[:200]}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _fail(path: str, want: str, value: object) -> InvalidPayload:
    return InvalidPayload(f"{path}: expected {want}, got {type(value).__name__} "
                          f"{_one_line(Exception(repr(value)))[:80]}")


def _build(value: Any, hint: Any, path: str) -> Any:
    """``value`` (decoded JSON) checked and converted to the annotation ``hint``."""
    while hasattr(hint, "__supertype__"):  # typing.NewType
        hint = hint.__supertype__
    if hint is Any or hint is object:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _build(value, arm, path)
            except InvalidPayload as exc:
                errors.append(str(exc))
        raise InvalidPayload("; ".join(errors) or f"{path}: no type of the union fits")
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _fail(path, f"one of {list(args)!r}", value)
    if hint is type(None) or hint is None:
        if value is None:
            return None
        raise _fail(path, "null", value)
    kind = _ARRAYS.get(origin or hint)
    if kind is not None:
        if not isinstance(value, list):
            raise _fail(path, "an array", value)
        if kind is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise _fail(path, f"an array of {len(args)}", value)
            return tuple(_build(v, a, f"{path}[{i}]") for i, (v, a) in
                         enumerate(zip(value, args, strict=True)))
        item = args[0] if args else Any
        items = [_build(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if kind is list else kind(items)
    if (origin or hint) in _MAPS:
        if not isinstance(value, dict):
            raise _fail(path, "an object", value)
        vt = args[1] if len(args) == 2 else Any
        return {k: _build(v, vt, f"{path}[{k!r}]") for k, v in value.items()}
    if not isinstance(hint, type):
        return value  # an annotation this checker does not know (TypeVar, NewType ...)
    if dataclasses.is_dataclass(hint):
        return _build_dataclass(value, hint, path)
    if issubclass(hint, enum.Enum):
        if isinstance(value, bool) and not any(isinstance(m.value, bool) for m in hint):
            raise _fail(path, f"a {hint.__name__} value", value)
        try:
            return hint(value)
        except ValueError:
            raise _fail(path, f"a {hint.__name__} value", value) from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _fail(path, "a boolean", value)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _fail(path, "an integer", value)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _fail(path, "a number", value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _fail(path, "a string", value)
    parse = _PARSERS.get(hint)
    if parse is not None:
        if not isinstance(value, str):
            raise _fail(path, f"a {hint.__name__} string", value)
        try:
            return parse(value)
        except (ValueError, ArithmeticError):
            raise _fail(path, f"a {hint.__name__} string", value) from None
    if isinstance(value, hint):
        return value
    raise _fail(path, hint.__name__, value)


_ARRAYS: dict[Any, type] = {
    list: list, abc.Sequence: list, abc.MutableSequence: list, tuple: tuple,
    set: set, abc.Set: set, abc.MutableSet: set, frozenset: frozenset,
}
_MAPS = (dict, abc.Mapping, abc.MutableMapping)

_PARSERS: dict[type, Any] = {
    dt.datetime: dt.datetime.fromisoformat,
    dt.date: dt.date.fromisoformat,
    uuid.UUID: uuid.UUID,
    Decimal: Decimal,
}


@functools.cache
def _shape(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    """A dataclass's resolved annotations and its init fields: once per class, not per
    message (resolving annotations evaluates their strings)."""
    return (typing.get_type_hints(cls),
            {f.name: f for f in dataclasses.fields(cls) if f.init})


def _build_dataclass(value: Any, cls: type, path: str) -> Any:
    if not isinstance(value, dict):
        raise _fail(path, f"an object for {cls.__name__}", value)
    hints, known = _shape(cls)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise InvalidPayload(f"{path}: unknown fields {unknown}")
    kwargs = {}
    for name, f in known.items():
        if name in value:
            kwargs[name] = _build(value[name], hints.get(name, Any), f"{path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InvalidPayload(f"{path}.{name}: required field missing")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a __post_init__ check
        raise InvalidPayload(f"{path}: {_one_line(exc)}") from None
