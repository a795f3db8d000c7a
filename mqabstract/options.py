"""Driver options from URL query parameters and ``connect(**options)``, typed and checked.

Each driver declares ``OPTIONS``; unknown names and unparsable values are rejected before
any connection is made, with the list of options the backend knows.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .clock import Clock
from .errors import InvalidArgument
from .url import BrokerURL, _is_secret_param

__all__ = ["CLOCK", "Option", "check_options", "parse_options"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Option:
    """One option a driver accepts: its type, default, a one-line help text and the values
    it may take, checked by ``check_options`` before anything connects: ``choices``
    (case-insensitive for strings; the value is passed on lower-cased), ``min``/``max``
    (inclusive) and ``above`` (exclusive). Numbers must be finite (``nan`` and ``inf``
    would hang or overflow a timeout later). Defaults are trusted, not checked."""

    type: type
    default: Any = None
    help: str = ""
    choices: tuple[str, ...] = ()
    min: float | None = None
    max: float | None = None
    above: float | None = None


#: The one ``clock`` option (every driver that emulates time takes it): a
#: :class:`mqabstract.clock.Clock`; tests pass a ``FakeClock``.
CLOCK = Option(Clock, None, "a mqabstract.Clock (tests pass FakeClock)")


def _check_value(name: str, value: Any, opt: Option) -> Any:
    """``value`` if ``opt`` allows it, else ``InvalidArgument`` saying what is allowed."""
    if opt.choices:
        text = str(value).strip().lower()
        if text not in opt.choices:
            raise InvalidArgument(f"option {name}={value!r} must be one of "
                                  f"{', '.join(opt.choices)}")
        return text
    if opt.type not in (int, float):
        return value
    if not math.isfinite(value):
        raise InvalidArgument(f"option {name}={value!r} must be a finite number")
    low = "" if opt.min is None else f"≥ {opt.min:g}"
    low = low if opt.above is None else f"> {opt.above:g}"
    high = "" if opt.max is None else f"≤ {opt.max:g}"
    if ((opt.min is not None and value < opt.min) or (opt.max is not None and value > opt.max)
            or (opt.above is not None and value <= opt.above)):
        raise InvalidArgument(f"option {name}={value!r} must be "
                              f"{' and '.join(b for b in (low, high) if b)} ({opt.help})")
    return value


def _convert(name: str, raw: Any, opt: Option) -> Any:
    if opt.type is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    elif opt.type in (int, float):
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return opt.type(raw)
        try:
            return opt.type(str(raw).strip())
        except ValueError:
            pass
    elif opt.type is str:
        if isinstance(raw, str):
            return raw
    elif isinstance(raw, opt.type):
        return raw
    shown = "***" if _is_secret_param(name) else repr(raw)
    raise InvalidArgument(f"option {name}={shown} is not a valid {opt.type.__name__}")


def parse_options(
    url: BrokerURL, kwargs: Mapping[str, Any], spec: Mapping[str, Option], backend: str
) -> dict[str, Any]:
    """Merge URL query parameters and keyword options (keywords win) into typed values."""
    merged: dict[str, Any] = dict(url.params)
    merged.update(kwargs)
    return check_options(merged, spec, f"{backend} option")


def check_options(given: Mapping[str, Any], spec: Mapping[str, Option], what: str,
                  also: tuple[str, ...] = ()) -> dict[str, Any]:
    """``given`` typed by ``spec``, defaults filled in; an unknown name is refused with
    the closest known one and the whole list (``also``: names the caller takes itself)."""
    unknown = sorted(set(given) - set(spec))
    if unknown:
        known = sorted({*spec, *also})
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise InvalidArgument(f"unknown {what}(s) {', '.join(unknown)}{hint}; known: "
                              f"{', '.join(known) or 'none'}")
    out = {name: opt.default for name, opt in spec.items()}
    for name, raw in given.items():
        opt = spec[name]
        out[name] = _check_value(name, _convert(name, raw, opt), opt)
    return out
