"""Fit a name into a broker's limits without ever mapping two names to one."""

from __future__ import annotations

import hashlib
import re

__all__ = ["fit_name"]


def fit_name(name: str, limit: int, *, safe: re.Pattern[str] | None = None,
             digest_chars: int = 10, sep: str = "-", reserved_suffixes: tuple[str, ...] = (),
             keep_head: bool = True) -> str:
    """``name`` itself when it fits, else a readable head plus a digest of the whole name.

    A name fits when its UTF-8 length is at most ``limit``, it fully matches ``safe`` (when
    given) and does not end with a ``reserved_suffixes`` entry (suffixes the driver adds to
    other names). Otherwise the result is the name with characters outside ``safe``
    replaced by ``_``, cut to leave room, then ``sep`` and the first ``digest_chars`` hex
    digits of its SHA-256 — always different from every name that fits, because fitting
    names are kept verbatim and a fitted one carries a digest of the original. With
    ``keep_head=False`` only the digest is kept.
    """
    fits = (len(name.encode()) <= limit and (safe is None or safe.fullmatch(name) is not None)
            and not name.endswith(reserved_suffixes))
    if fits:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:digest_chars]
    if not keep_head:
        return digest
    room = limit - len(sep) - digest_chars
    if room < 0:
        raise ValueError(f"limit {limit} leaves no room for a {digest_chars}-digit digest")
    head = name if safe is None else "".join(
        c if safe.fullmatch(c) else "_" for c in name)
    head = head.encode()[:room].decode("utf-8", "ignore")
    return f"{head}{sep}{digest}"
