"""Find a real broker for the tests of one backend, or say clearly why there is none.

:func:`resolve_url` tries, in order: the URL in ``MQ_TEST_<KIND>_URL``; a broker already
answering at the local default address (protocol handshake, not a port check); a
container started like ``--mq-container KIND`` when a Docker engine answers. Otherwise it
skips the test, or fails it when ``CI`` is set: in CI a missing broker is a broken
pipeline, not a pass.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import brokerctl  # scripts/ is not a package: found via sys.path

_cache: dict[str, str] = {}
_failures: dict[str, str] = {}
_containers: list[Any] = []

def in_ci() -> bool:
    """True when running in CI (``CI=true``/``1``), where missing brokers must fail."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def resolve_url(kind: str) -> str:
    """URL of a usable broker of *kind* ("rabbitmq", "kafka", "sqs" or "postgresql");
    cached per session.

    Skips the calling test when none is found, or fails it under ``CI=true``.
    """
    if kind not in brokerctl.KINDS:
        raise ValueError(f"unknown broker kind {kind!r}; expected one of {brokerctl.KINDS}")
    if kind in _cache:
        return _cache[kind]
    if kind not in _failures:
        url, tried = _find(kind)
        if url:
            _cache[kind] = url
            return url
        _failures[kind] = (
            f"no {kind} broker for the tests: tried {'; '.join(tried)}. Start one with "
            f"`scripts/brokers up {kind}` (local process), or set "
            f"{brokerctl.ENV_URL_VARS[kind]} to a broker URL"
        )
    if in_ci():
        pytest.fail(f"{_failures[kind]} (CI=true: a missing broker fails, never skips)")
    pytest.skip(_failures[kind])


def _find(kind: str) -> tuple[str | None, list[str]]:
    var = brokerctl.ENV_URL_VARS[kind]
    explicit = os.environ.get(var, "").strip()
    if explicit:
        return explicit, []  # the user's choice: a wrong URL should fail loudly in the test
    tried = [f"${var} (unset)"]
    port = brokerctl.default_port(kind)
    if brokerctl.ready(kind, port):
        return brokerctl.broker_url(kind, port), tried
    tried.append(f"a local {kind} at {brokerctl.HOST}:{port} (no answer)")
    url, why = _container(kind)
    if url:
        return url, tried
    tried.append(f"testcontainers ({why})")
    return None, tried


def _container(kind: str) -> tuple[str | None, str]:
    """Start a session-lived container for *kind* (the conformance plugin's launcher);
    (url, "") or (None, why not)."""
    if os.environ.get("MQ_TEST_NO_CONTAINERS"):
        return None, "disabled by MQ_TEST_NO_CONTAINERS"
    from mqabstract.conformance import containers

    try:
        box = containers.start(kind)
    except containers.ContainerError as exc:
        return None, str(exc)
    _keep(box)
    return box.url, ""


def _keep(container: Any) -> None:
    """Keep *container* for the whole session; stop it when the interpreter exits."""
    if not _containers:
        atexit.register(stop_containers)
    _containers.append(container)


def stop_containers() -> None:
    """Stop the containers this module started (also safe to call from a fixture)."""
    while _containers:
        with contextlib.suppress(Exception):
            _containers.pop().stop()
