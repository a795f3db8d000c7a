"""Argument checks shared by the sync and the asyncio API (typed errors before any I/O)."""

from __future__ import annotations

import math

from .errors import InvalidArgument

__all__ = ["check_count", "check_seconds"]


def check_count(value: object, what: str) -> None:
    """A count argument (max_messages, batch, limit ...) must be an int ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{what} must be an int ≥ 1, got {value!r}")


def check_seconds(value: object, what: str, maximum: float, allow_zero: bool = True) -> float:
    """A duration in seconds: a finite number ≥ 0 (> 0 without ``allow_zero``) ≤ ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (not allow_zero and seconds == 0):
        bound = "≥ 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{what} must be finite and {bound}, got {value!r}")
    if seconds > maximum:
        raise InvalidArgument(f"{what}={seconds:g}s exceeds this backend's maximum of {maximum:g}s")
    return seconds
