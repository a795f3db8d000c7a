"""The mqabstract conformance suite, as a pytest plugin.

Run it against any URL, including third-party drivers::

    pytest -p mqabstract.conformance --mq-url memory:// [--mq-url amqp://... ...]

Every scenario runs once per ``--mq-url`` (and per API with ``--mq-api async|both``: the
asyncio API through a sync-shaped wrapper). Scenarios are gated by the driver's declared
capabilities: a feature's tests run wherever it is not UNSUPPORTED (skipped with the
reason otherwise), and the truthfulness scenarios check that every UNSUPPORTED feature
raises ``Unsupported``. All names are unique per test, so a shared broker is fine.

``--mq-container KIND`` (rabbitmq, kafka, sqs, postgresql; extra ``containers``) starts a throwaway
broker container for the run and adds its URL (``mqabstract.conformance.containers``).
"""

from __future__ import annotations

from .plugin import (
    mq_api,
    mq_broker,
    mq_ctx,
    mq_url,
    pytest_addoption,
    pytest_configure,
    pytest_configure_node,
    pytest_generate_tests,
    pytest_report_header,
    pytest_unconfigure,
)

__all__ = [
    "mq_api",
    "mq_broker",
    "mq_ctx",
    "mq_url",
    "pytest_addoption",
    "pytest_configure",
    "pytest_configure_node",
    "pytest_generate_tests",
    "pytest_report_header",
    "pytest_unconfigure",
]
