"""Pytest hooks and fixtures of the conformance suite."""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import mqabstract
from mqabstract.url import BrokerURL, redact

from .harness import Ctx

SUITE_DIR = Path(__file__).resolve().parent
# URLs of the containers started for this run -> their test id ("rabbitmq-container").
_CONTAINER_IDS = pytest.StashKey[dict[str, str]]()
_RUNNING = pytest.StashKey[list[Any]]()


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
        "--mq-container",
        action="append",
        default=[],
        metavar="KIND",
        help="also run the suite against a throwaway broker container of KIND (rabbitmq, "
        "kafka, sqs, postgresql), started with testcontainers (extra 'containers'); repeatable",
    )
    group.addoption(
        "--mq-container-image",
        action="append",
        default=[],
        metavar="KIND=IMAGE",
        help="image for --mq-container KIND (default: $MQ_CONTAINER_<KIND>_IMAGE or the "
        "public image)",
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
    _add_containers(config)
    if not config.getoption("mq_url"):
        return
    # Collect the suite. With no explicit paths run only the suite; with paths, add it.
    suite = str(SUITE_DIR)
    explicit = config.args_source == pytest.Config.ArgsSource.ARGS
    if not explicit:
        config.args[:] = [suite]
    elif not any(Path(a).resolve() == SUITE_DIR for a in config.args if Path(a).exists()):
        config.args.append(suite)


def _add_containers(config: pytest.Config) -> None:
    """Start the ``--mq-container`` brokers (once, in the controlling process) and add their
    URLs to ``--mq-url``; pytest-xdist workers get the URLs from the controller."""
    kinds = list(dict.fromkeys(config.getoption("mq_container") or []))
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        ids = dict(worker_input.get("mq_containers", {}))
    elif kinds:
        ids = _start_containers(config, kinds)
    else:
        ids = {}
    config.stash[_CONTAINER_IDS] = ids
    config.option.mq_url = [*config.getoption("mq_url"), *ids]


def _start_containers(config: pytest.Config, kinds: list[str]) -> dict[str, str]:
    from . import containers

    images: dict[str, str] = {}
    for item in config.getoption("mq_container_image") or []:
        kind, sep, image = item.partition("=")
        if not sep or kind not in containers.KINDS or not image:
            raise pytest.UsageError(f"--mq-container-image {item!r}: expected KIND=IMAGE with "
                                    f"KIND one of {', '.join(containers.KINDS)}")
        images[kind] = image
    running: list[containers.Running] = []
    config.stash[_RUNNING] = running
    atexit.register(_stop_containers, running)  # also when pytest dies before unconfigure
    ids = {}
    for kind in kinds:
        try:
            box = containers.start(kind, images.get(kind))
        except containers.ContainerError as exc:
            _stop_containers(running)
            raise pytest.UsageError(str(exc)) from None
        running.append(box)
        ids[box.url] = f"{kind}-container"
    return ids


def _stop_containers(running: list[Any]) -> None:
    while running:
        running.pop().stop()


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop_containers(config.stash.get(_RUNNING, []))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist: hand the started containers' URLs to each worker."""
    node.workerinput["mq_containers"] = node.config.stash.get(_CONTAINER_IDS, {})


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    running = config.stash.get(_RUNNING, [])
    return [f"container {b.kind}: {b.image} at {redact(b.url)} (ready in {b.seconds:.1f}s)"
            for b in running] or None


def _url_id(url: str) -> str:
    try:
        parsed = BrokerURL.parse(url)
    except mqabstract.MQError:
        return redact(url)
    return parsed.scheme


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mq_url" in metafunc.fixturenames:
        urls = metafunc.config.getoption("mq_url")
        named = metafunc.config.stash.get(_CONTAINER_IDS, {})
        ids = [named.get(u) or _url_id(u) for u in urls]
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
