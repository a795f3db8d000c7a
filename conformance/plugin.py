"""Pytest hooks and fixtures of the conformance suite."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest

import mqabstract
from mqabstract.url import BrokerURL, redact

from .harness import Ctx

SUITE_DIR = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mqabstract", "mqabstract conformance suite")
    group.addoption(
        "--mq-url",
        action="append",
        default=[],
        metavar="URL",
        help="broker URL to run the conformance suite against (repeatable)",
    )
    group.addoption(
        "--mq-api",
        choices=("sync", "async", "both"),
        default="sync",
        help="run the scenarios through the sync API, the asyncio API (mqabstract.aio), or both",
    )
    group.addoption(
        "--mq-time-scale",
        type=float,
        default=1.0,
        help="multiply the suite's waits (leases, delays, receive timeouts) by this factor",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mq_feature(name): scenario needs a capability")
    if not config.getoption("mq_url"):
        return
    # Collect the suite. With no explicit paths run only the suite; with paths, add it.
    suite = str(SUITE_DIR)
    explicit = config.args_source == pytest.Config.ArgsSource.ARGS
    if not explicit:
        config.args[:] = [suite]
    elif not any(Path(a).resolve() == SUITE_DIR for a in config.args if Path(a).exists()):
        config.args.append(suite)


def _url_id(url: str) -> str:
    try:
        parsed = BrokerURL.parse(url)
    except mqabstract.MQError:
        return redact(url)
    return parsed.scheme


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mq_url" in metafunc.fixturenames:
        urls = metafunc.config.getoption("mq_url")
        ids = [_url_id(u) for u in urls]
        if len(set(ids)) != len(ids):
            ids = [f"{i}{n}" for n, i in enumerate(ids)]
        metafunc.parametrize("mq_url", urls, ids=ids, indirect=True, scope="session")
        api = metafunc.config.getoption("mq_api")
        apis = ["sync", "async"] if api == "both" else [api]
        metafunc.parametrize("mq_api", apis, ids=apis, indirect=True, scope="session")


@pytest.fixture(scope="session")
def mq_url(request: pytest.FixtureRequest) -> str:
    """The URL under test. A conftest may override this fixture to resolve aliases."""
    return str(request.param)


@pytest.fixture(scope="session")
def mq_api(request: pytest.FixtureRequest) -> str:
    """``sync``, or ``async``: the scenarios call ``mqabstract.aio`` through a sync-shaped
    wrapper (``through_async``)."""
    return str(getattr(request, "param", "sync"))


def _connector(api: str) -> Callable[[str], mqabstract.Broker]:
    if api == "async":
        from . import through_async

        return cast(Callable[[str], mqabstract.Broker], through_async.connect)
    return mqabstract.connect


@pytest.fixture(scope="session")
def mq_broker(mq_url: str, mq_api: str) -> Iterator[mqabstract.Broker]:
    """One shared connection per URL (and API) for the whole session."""
    broker = _connector(mq_api)(mq_url)
    yield broker
    broker.close()


@pytest.fixture
def mq_ctx(
    mq_url: str, mq_api: str, mq_broker: mqabstract.Broker, request: pytest.FixtureRequest
) -> Iterator[Ctx]:
    """Per-test helper: unique names, cleanup of groups and extra connections."""
    ctx = Ctx(mq_url, mq_broker, request.config.getoption("mq_time_scale"),
              connect=_connector(mq_api))
    yield ctx
    ctx.cleanup()
