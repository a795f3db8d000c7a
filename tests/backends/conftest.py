"""Fixtures shared by the backend-specific tests; each module defines its own ``url``."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

import mqabstract


@pytest.fixture
def mq(url: str) -> Iterator[mqabstract.Broker]:
    """A connection to the module's broker, closed after the test."""
    broker = mqabstract.connect(url)
    yield broker
    broker.close()


@pytest.fixture
def names(mq: mqabstract.Broker) -> Iterator[tuple[str, str]]:
    """A unique (group, topic root); the group is deleted afterwards."""
    token = "t" + secrets.token_hex(4)
    group = f"interop-{token}"
    yield group, f"it.{token}"
    mq.delete_group(group)
