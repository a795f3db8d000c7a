"""Broker URL parsing and secret redaction.

A URL is the only thing a user changes to swap backends, so it must be parsed the same way
everywhere and must never leak a password or secret key into a repr, log line or error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from .errors import InvalidURL

__all__ = ["SECRET_PARAMS", "BrokerURL", "redact"]

#: Query parameters whose values are secrets (compared case-insensitively, substring match).
SECRET_PARAMS = ("password", "secret", "token", "credential", "passwd", "sasl_plain_password")

_MASK = "***"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")


def _is_secret_param(name: str) -> bool:
    lowered = name.lower()
    return any(s in lowered for s in SECRET_PARAMS)


@dataclass(frozen=True)
class BrokerURL:
    """A parsed broker URL. ``str()`` and ``repr()`` are redacted; ``raw`` is not."""

    scheme: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    hosts: tuple[tuple[str, int | None], ...] = ()
    path: str = ""
    params: tuple[tuple[str, str], ...] = ()
    raw: str = field(default="", repr=False, compare=False)

    @classmethod
    def parse(cls, url: str) -> BrokerURL:
        """Parse ``scheme://[user[:pass]@]host[:port][,host[:port]...][/path][?query]``."""
        if not isinstance(url, str) or "://" not in url:
            # Never echo unparsable input: it may hold a password in an unexpected place.
            head = str(url).split(":", 1)[0][:20]
            raise InvalidURL(f"not a broker URL (expected scheme://...); it starts {head!r}")
        scheme, rest = url.split("://", 1)
        if not _SCHEME.match(scheme):
            raise InvalidURL(f"invalid URL scheme {scheme!r}")
        # urlsplit cannot parse comma-separated host lists with ports; split netloc ourselves.
        netloc, sep, tail = rest.partition("/")
        query = ""
        if "?" in netloc:
            netloc, _, query = rest.partition("?")  # query may contain "/" (endpoint_url)
            tail = ""
        else:
            parts = urlsplit("x://h/" + tail) if sep else None
            if parts is not None:
                tail, query = parts.path[1:], parts.query
        username = password = None
        if "@" in netloc:
            userinfo, netloc = netloc.rsplit("@", 1)
            user, has_pw, pw = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(pw) if has_pw else None
        hosts: list[tuple[str, int | None]] = []
        for item in filter(None, netloc.split(",")):
            host, port = _split_host_port(item, url)
            hosts.append((host, port))
        try:
            params = tuple(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
        except ValueError as exc:  # pragma: no cover - parse_qsl is lenient
            raise InvalidURL(f"invalid query string in {redact(url)!r}") from exc
        return cls(
            scheme=scheme.lower(),
            username=username,
            password=password,
            hosts=tuple(hosts),
            path=unquote(tail),
            params=params,
            raw=url,
        )

    def param(self, name: str, default: str | None = None) -> str | None:
        """Last value of query parameter ``name`` (case-sensitive), or ``default``."""
        value = default
        for key, val in self.params:
            if key == name:
                value = val
        return value

    def param_dict(self) -> dict[str, str]:
        """Query parameters as a dict (last value wins)."""
        return dict(self.params)

    def redacted(self) -> str:
        """The URL with password and secret query values replaced by ``***``."""
        out = f"{self.scheme}://"
        if self.username is not None or self.password is not None:
            out += quote(self.username or "", safe="")
            if self.password is not None:
                out += ":" + _MASK
            out += "@"
        out += ",".join(h if p is None else f"{_fmt_host(h)}:{p}" for h, p in self.hosts)
        if self.path:
            out += "/" + quote(self.path, safe="/%")
        if self.params:
            out += "?" + "&".join(
                f"{quote(k, safe='')}={_MASK if _is_secret_param(k) else quote(v, safe=':/')}"
                for k, v in self.params
            )
        return out

    def __str__(self) -> str:
        return self.redacted()

    def __repr__(self) -> str:
        return f"BrokerURL({self.redacted()!r})"


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _split_host_port(item: str, url: str) -> tuple[str, int | None]:
    if item.startswith("["):  # IPv6 literal
        host, _, after = item[1:].partition("]")
        port_s = after[1:] if after.startswith(":") else ""
    else:
        host, _, port_s = item.partition(":")
    if not port_s:
        return unquote(host), None
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise InvalidURL(f"invalid port {port_s!r} in {redact(url)!r}")
    return unquote(host), int(port_s)


_USERINFO_PW = re.compile(r"(?P<pre>://[^:/@?#,]*):(?P<pw>[^@/?#]*)@")
_QUERY_SECRET = re.compile(r"(?P<key>[?&][^=&#]*)=(?P<val>[^&#]*)")


def redact(text: str) -> str:
    """Redact any URL-embedded password or secret query value found in ``text``.

    Works on arbitrary text (error messages from native clients), not only on clean URLs,
    so it is safe to pass a native exception's message through it.
    """
    text = _USERINFO_PW.sub(lambda m: f"{m['pre']}:{_MASK}@", text)
    return _QUERY_SECRET.sub(
        lambda m: f"{m['key']}={_MASK}" if _is_secret_param(m["key"][1:]) else m[0], text
    )
