"""The mqabstract conformance suite, as a pytest plugin.

Run it against any URL, including third-party drivers::

    pytest -p mqabstract.conformance --mq-url memory:// [--mq-url amqp://... ...]

Every scenario runs once per ``--mq-url`` (and per API with ``--mq-api async|both``: the
asyncio API through a sync-shaped wrapper). Scenarios are gated by the driver's declared
capabilities: a feature's tests run wherever it is not UNSUPPORTED (skipped with the
reason otherwise), and the truthfulness scenarios check that every UNSUPPORTED feature
raises ``Unsupported``. All names are unique per test, so a shared broker is fine.
"""

from __future__ import annotations

from .plugin import (
    mq_api,
    mq_broker,
    mq_ctx,
    mq_url,
    pytest_addoption,
    pytest_configure,
    pytest_generate_tests,
)

__all__ = [
    "mq_api",
    "mq_broker",
    "mq_ctx",
    "mq_url",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
]
