"""Repository-level pytest setup.

Lets ``--mq-url`` take backend aliases besides URLs, so one command runs the conformance
suite on every backend with brokers found by ``tests/brokers.py``:

    pytest tests -p mqabstract.conformance --mq-url all
    pytest -p mqabstract.conformance --mq-url rabbitmq --mq-url sqlite

Aliases: memory, sqlite (a fresh file per session), rabbitmq, kafka, sqs, all.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

BACKEND_ALIASES = ("memory", "sqlite", "rabbitmq", "kafka", "sqs")
BROKER_KINDS = ("rabbitmq", "kafka", "sqs")


def pytest_configure(config: pytest.Config) -> None:
    urls = getattr(config.option, "mq_url", None)
    if urls and "all" in urls:
        expanded: list[str] = []
        for url in urls:
            for item in BACKEND_ALIASES if url == "all" else (url,):
                if item not in expanded:
                    expanded.append(item)
        config.option.mq_url = expanded
    # moto needs some credentials; never override real ones.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def mq_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Resolve backend aliases to URLs (overrides the plugin's fixture)."""
    raw = str(request.param)
    if raw == "memory":
        return "memory://conformance"
    if raw == "sqlite":
        path = Path(tmp_path_factory.mktemp("sqlite")) / "conformance.db"
        return f"sqlite:///{path}"
    if raw in BROKER_KINDS:
        from tests.brokers import resolve_url

        return resolve_url(raw)
    return raw
