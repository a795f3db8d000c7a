"""Backend parametrization and reporting for the reliability suite.

Tests take the ``backend`` fixture (an alias: memory, sqlite, rabbitmq, kafka, sqs,
postgresql, or ``kafka-python``: Kafka on its other client, ``CLIENT_ALIASES``) and
``rel_url`` (its URL, resolved like the conformance suite's aliases: ``tests/brokers.py``
finds the shared brokers; in CI a missing broker fails, never skips). The backends come from
``--mq-url`` when the conformance plugin is loaded with aliases, else from
``MQ_RELIABILITY_BACKENDS`` (comma-separated), else all of ``ALIASES``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support import Reporter, fault_url, kind

ALIASES = ("memory", "sqlite", "rabbitmq", "kafka", "kafka-python", "sqs", "postgresql")
BROKER_KINDS = ("rabbitmq", "kafka", "sqs", "postgresql")


def _selected(config: pytest.Config) -> list[str]:
    from_option = [u for u in (getattr(config.option, "mq_url", None) or []) if u in ALIASES]
    if from_option:
        return from_option
    env = os.environ.get("MQ_RELIABILITY_BACKENDS", "").strip()
    if env:
        chosen = [b.strip() for b in env.split(",") if b.strip()]
        unknown = sorted(set(chosen) - set(ALIASES))
        if unknown:
            raise pytest.UsageError(f"MQ_RELIABILITY_BACKENDS: unknown {unknown}; use {ALIASES}")
        return chosen
    return list(ALIASES)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    wanted = _selected(metafunc.config)
    marker = metafunc.definition.get_closest_marker("backends")
    if marker is not None:  # the scenario is meaningful only on these
        wanted = [b for b in wanted if kind(b) in marker.args]
        if marker.kwargs.get("one_client"):  # a portable-layer scenario: the default client
            wanted = [b for b in wanted if b == kind(b)]
    # Module scope: pytest runs a module's backends together, so a module's own brokers
    # (the three-node Kafka cluster) start once, not once per backend.
    metafunc.parametrize("backend", wanted, scope="module")


#: The broker a scenario loads, by test module (else by its backend's kind): the fault
#: stage's lanes (``scripts/test``: ``-n 3 --dist loadgroup --no-loadscope-reorder``) take
#: whole groups, so no two running scenarios ever share a broker.
_OWN_BROKERS = {"test_kafka_cluster.py": "kafka-cluster",
                "test_container_faults.py": "container-",
                # the relays and the dedupe store load the shared PostgreSQL
                "test_outbox_faults.py": "postgresql"}
#: The order the lanes take the groups in: longest first (a CI run's seconds per group:
#: kafka 517, kafka-cluster 449, sqs 238, container-kafka 183, postgresql 172, rabbitmq
#: 152, embedded 130, container-rabbitmq 67, container-postgresql 44), except that the
#: container Kafka waits until the three-node cluster's JVMs are past their start. Three
#: lanes in this order end at ~675 s of the ~1,950 s in all; xdist's default order (most
#: tests first) started the cluster after the embedded group and ended at ~700-740 s.
_LONGEST_FIRST = ("kafka", "kafka-cluster", "sqs", "postgresql", "rabbitmq",
                  "container-kafka", "embedded", "container-rabbitmq", "container-postgresql")


def _lane(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend") if callspec is not None else None
    broker = "embedded" if backend in (None, "memory", "sqlite") else kind(backend)
    own = _OWN_BROKERS.get(item.path.name)
    if own is None:
        return broker
    return own + broker if own.endswith("-") else own


_HERE = Path(__file__).parent


def _ours(item: pytest.Item) -> bool:
    """A test of this folder (the hook sees the whole session's items: the main stage
    collects every other test too, and must keep its own groups and order)."""
    return item.path.is_relative_to(_HERE)


@pytest.hookimpl(tryfirst=True)  # before xdist turns the marks into groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not all(_ours(item) for item in items):
        return  # a mixed run (the main stage): the fault lanes are the fault stage's
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_lane(item)))
    order = {lane: i for i, lane in enumerate(_LONGEST_FIRST)}
    # Stable: within a group the modules keep their order (module-scoped brokers start once).
    items.sort(key=lambda item: order.get(_lane(item), len(order)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends(*names): run this reliability test only on these backends"
    )


@pytest.fixture(scope="module")
def rel_url(backend: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """URL of the shared broker (or a fresh file / hub) for ``backend``."""
    if backend == "memory":
        return "memory://reliability"
    if backend == "sqlite":
        path = Path(tmp_path_factory.mktemp("rel-sqlite")) / "reliability.db"
        return f"sqlite:///{path}"
    from tests.brokers import resolve_url

    return fault_url(backend, resolve_url(kind(backend)))


@pytest.fixture(autouse=True)
def _client_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    """The library's DEBUG log (rebalances, take-overs, commits, stall checks) is kept for
    every scenario and shown when one fails: a fault that does not reproduce on demand
    must still say what the client did."""
    caplog.set_level(logging.DEBUG, logger="mqabstract")


@pytest.fixture(scope="session")
def reporter() -> Iterator[Reporter]:
    """Collects per-test counts; appends them as JSON lines to ``$MQ_RELIABILITY_REPORT``."""
    rep = Reporter(os.environ.get("MQ_RELIABILITY_REPORT"))
    yield rep
    rep.close()
