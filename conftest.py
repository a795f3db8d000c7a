"""Repository-level pytest setup.

Lets ``--mq-url`` take backend aliases besides URLs, so one command runs the conformance
suite on every backend with brokers found by ``tests/brokers.py``:

    pytest tests -p mqabstract.conformance --mq-url all
    pytest -p mqabstract.conformance --mq-url rabbitmq --mq-url sqlite

Aliases: memory, sqlite (a fresh file per session), rabbitmq, kafka (its default client:
confluent-kafka), kafka-python (the same broker on the other client), sqs, postgresql
(a fresh schema per session), all.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

BACKEND_ALIASES = ("memory", "sqlite", "rabbitmq", "kafka", "kafka-python", "sqs",
                   "postgresql")
# Under pytest-xdist (--dist loadgroup) these files run on one worker each: private broker
# processes and the shared SparkSession must not be started twice at once. (The fault
# scenarios' private brokers are grouped by tests/reliability/conftest.py's lanes.)
_SERIAL_GROUPS = {
    "test_brokerctl.py": "private-brokers",
    "test_rabbitmq.py": "private-brokers",
    "spark": "spark",
}
BROKER_KINDS = ("rabbitmq", "kafka", "sqs", "postgresql")


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


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """Name the brokers the run talks to (version as the broker reports it, and origin)."""
    urls = getattr(config.option, "mq_url", None) or []
    kinds = [k for k in BROKER_KINDS if k in urls]
    if not kinds or hasattr(config, "workerinput"):  # once, in the controlling process
        return None
    # tests.brokers puts scripts/ on sys.path, so brokerctl is importable after it.
    import tests.brokers
    brokerctl = tests.brokers.brokerctl

    lines = []
    for row in brokerctl.status(kinds):
        explicit = os.environ.get(brokerctl.ENV_URL_VARS[row["kind"]], "")
        if explicit and explicit != row["url"]:
            lines.append(f"broker {row['kind']}: {brokerctl.redact(explicit)} (given by env)")
        elif row["listening"]:
            url = brokerctl.redact(row["url"])
            lines.append(f"broker {row['kind']}: {row['version']} at {url} "
                         f"(from {row['origin']})")
        else:
            lines.append(f"broker {row['kind']}: none at {row['url']}")
    return lines


@pytest.fixture(scope="session")
def mq_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Resolve backend aliases to URLs (overrides the plugin's fixture)."""
    raw = str(request.param)
    if raw == "memory":
        return "memory://conformance"
    if raw == "sqlite":
        path = Path(tmp_path_factory.mktemp("sqlite")) / "conformance.db"
        return f"sqlite:///{path}"
    if raw in BROKER_KINDS or raw == "kafka-python":
        from tests.brokers import resolve_url
        from tests.reliability.support import kind, with_client

        url = with_client(raw, resolve_url(kind(raw)))
        if raw == "postgresql":  # a schema of this session's own: no earlier run's groups
            url += ("&" if "?" in url else "?") + f"schema=mq_{uuid.uuid4().hex[:12]}"
        return url
    return raw


@pytest.hookimpl(tryfirst=True)  # before xdist turns the marks into groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        for key, group in _SERIAL_GROUPS.items():
            if key == item.path.name or key in parts[:-1]:
                item.add_marker(pytest.mark.xdist_group(group))


#: The only skips a CI run may report: a scenario the backend declares it cannot run (the
#: conformance suite's feature gates) and the memory backend's process-local scenarios.
#: Anything else — a missing client library, broker, engine or tool — fails under
#: ``CI=true`` (tests/brokers.py already fails a missing broker; this catches the rest,
#: such as an ``importorskip`` of a client the setup forgot to install).
CI_SKIPS = ("declares", "UNSUPPORTED", "is process-local")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not hasattr(report, "wasxfail") and (reason := _disallowed_skip(report)) is not None:
        report.outcome = "failed"
        report.longrepr = (f"CI=true: skipped for a reason CI does not allow "
                           f"(conftest.CI_SKIPS): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    """The same rule for a module skipped whole at collection (a module-level
    ``importorskip``), which no test report carries."""
    outcome = yield
    report = outcome.get_result()
    if (reason := _disallowed_skip(report)) is not None:
        report.outcome = "failed"
        report.longrepr = (f"CI=true: {collector.nodeid} skipped for a reason CI does "
                           f"not allow (conftest.CI_SKIPS): {reason}")


def _disallowed_skip(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The reason of a skip CI does not allow (None: not a skip, allowed, or not CI)."""
    if not report.skipped or not _in_ci():
        return None
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
    return None if any(word in reason for word in CI_SKIPS) else reason


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
