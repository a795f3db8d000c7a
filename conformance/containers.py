"""Throwaway broker containers for the conformance suite (``--mq-container KIND``).

:func:`start` runs one broker in a container with testcontainers (extra ``containers``),
publishes its port on 127.0.0.1 only, waits until the broker completes a real protocol
exchange (:mod:`mqabstract.probe`), and returns a :class:`Running` with the URL to test
and ``stop()``. The defaults are the public images users already pull; any image that
takes the same settings works (``--mq-container-image KIND=IMAGE`` or
``MQ_CONTAINER_<KIND>_IMAGE``), such as the ones ``scripts/containers images`` builds
locally where no registry is reachable.

Every failure is a :class:`ContainerError` whose message is one line: the step that
failed (engine, image, start, readiness) and what to do about it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from mqabstract.probe import HOST, PG_DATABASE, PG_PASSWORD, PG_USER, new_cluster_id, ready


class ContainerError(RuntimeError):
    """A broker container could not be provided; the message names the step and the fix."""


@dataclass(frozen=True)
class Kind:
    """How to run one kind of broker in a container: image, port, settings, URL."""

    name: str
    image: str  # the public image used by default
    port: int  # the broker's port inside the container
    probe: str  # the mqabstract.probe kind
    start_timeout: float
    same_port: bool = False  # publish on the same host port (Kafka advertises it)
    env: dict[str, str] = field(default_factory=dict)

    def url(self, port: int) -> str:
        if self.name == "rabbitmq":
            return f"amqp://guest:guest@{HOST}:{port}/%2F"
        if self.name == "kafka":
            return f"kafka://{HOST}:{port}"
        if self.name == "postgresql":
            return f"postgresql://{PG_USER}:{PG_PASSWORD}@{HOST}:{port}/{PG_DATABASE}"
        return f"sqs://?region=us-east-1&endpoint_url=http://{HOST}:{port}"

    def settings(self, port: int) -> dict[str, str]:
        """Environment of the container when the broker is published on host *port*."""
        if self.name != "kafka":
            return dict(self.env)
        # The apache/kafka image's interface: KAFKA_<PROPERTY> variables (dots as '_') and
        # CLUSTER_ID. The broker listens on the published port number inside the container
        # too, so the address it advertises is the one the client reaches.
        return {
            **self.env,
            "CLUSTER_ID": new_cluster_id(),
            "KAFKA_LISTENERS": f"PLAINTEXT://0.0.0.0:{port},CONTROLLER://localhost:9093",
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{HOST}:{port}",
        }


_KAFKA_ENV = {
    "KAFKA_NODE_ID": "1",
    "KAFKA_PROCESS_ROLES": "broker,controller",
    "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
    "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
    "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
    "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
    "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    "KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS": "1000",  # the fault scenarios' 2 s sessions
}

KINDS: dict[str, Kind] = {
    # The official image lets guest log in from outside the container.
    "rabbitmq": Kind("rabbitmq", "rabbitmq:3.13", 5672, "rabbitmq", 120.0),
    "kafka": Kind("kafka", "apache/kafka:4.1.0", 9092, "kafka", 120.0, same_port=True,
                  env=_KAFKA_ENV),
    "sqs": Kind("sqs", "motoserver/moto:5.1.4", 5000, "sqs", 60.0),
    # The postgres image's interface: the test bed's login and database (mqabstract.probe).
    "postgresql": Kind("postgresql", "postgres:15", 5432, "postgresql", 60.0,
                       env={"POSTGRES_USER": PG_USER, "POSTGRES_PASSWORD": PG_PASSWORD,
                            "POSTGRES_DB": PG_DATABASE}),
}


def image_for(kind: str, override: str | None = None) -> str:
    """The image to run: *override*, else ``$MQ_CONTAINER_<KIND>_IMAGE``, else the default."""
    return override or os.environ.get(f"MQ_CONTAINER_{kind.upper()}_IMAGE") or KINDS[kind].image


#: Times ``Running.pause`` asks the engine to freeze a container that it failed to freeze.
_PAUSE_TRIES = 5


@dataclass
class Running:
    """A started broker container: the URL to test and how to stop it."""

    kind: str
    image: str
    url: str
    seconds: float  # from `docker create` until the broker answered
    _box: Any = field(repr=False)

    def stop(self) -> None:
        """Stop and remove the container (idempotent; errors are not worth a failure)."""
        box, self._box = self._box, None
        if box is not None:
            with contextlib.suppress(Exception):
                box.stop()

    _cut_from: list[str] = field(default_factory=list, repr=False)

    def pause(self) -> None:
        """Freeze every process in the container (``docker pause``): a broker that hangs.

        The engine's runtime freezes the container's cgroup and gives up with "unable to
        freeze" when not every process has stopped within its own time limit, which a
        2-core machine at load ~25 reached once in session 23's sitting (a JVM's threads
        busy in the kernel); it thaws what it froze. The fault was then not injected at
        all, so it is injected again, a few times, before that counts as an error."""
        box = self._box.get_wrapped_container()
        for attempt in range(_PAUSE_TRIES):
            try:
                box.pause()
                return
            except Exception as exc:  # docker.errors.APIError (docker is optional here)
                if "unable to freeze" not in str(exc) or attempt == _PAUSE_TRIES - 1:
                    raise
                time.sleep(0.5)

    def unpause(self) -> None:
        self._box.get_wrapped_container().unpause()

    def cut(self) -> None:
        """Cut the network between clients and the broker: the container leaves its
        networks, so new connections are refused and open ones go silent."""
        box = self._box.get_wrapped_container()
        box.reload()
        self._cut_from = list(box.attrs["NetworkSettings"]["Networks"])
        for name in self._cut_from:
            box.client.networks.get(name).disconnect(box)

    def restore(self) -> None:
        """Undo :meth:`cut`: reconnect the networks (the published port comes back)."""
        box = self._box.get_wrapped_container()
        while self._cut_from:
            box.client.networks.get(self._cut_from.pop()).connect(box)


def start(kind: str, image: str | None = None) -> Running:
    """Start a broker of *kind* in a container and wait until it is usable."""
    if kind not in KINDS:
        raise ContainerError(f"unknown container kind {kind!r}; choose from {', '.join(KINDS)}")
    spec = KINDS[kind]
    image = image_for(kind, image)
    where = f"--mq-container {kind} ({image})"
    client = _engine(where)
    _image(client, image, where)
    port = _free_port()
    box = _container(spec, image, port)
    t0 = time.monotonic()
    try:
        box.start()
    except Exception as exc:  # docker's errors: report them as one line
        with contextlib.suppress(Exception):
            box.stop()
        raise ContainerError(f"{where}: step 'start' failed: {_short(exc)}; to fix: check "
                             "`docker ps -a` and the engine's log") from None
    deadline = t0 + spec.start_timeout
    while not ready(spec.probe, port, timeout=2.0):
        state = _state(box)
        if state != "running" or time.monotonic() > deadline:
            logs = _logs(box)
            with contextlib.suppress(Exception):
                box.stop()
            why = (f"the container {state}" if state != "running"
                   else f"no {kind} protocol answer on {HOST}:{port} after "
                        f"{spec.start_timeout:.0f}s")
            raise ContainerError(f"{where}: step 'readiness' failed: {why}; last log line: "
                                 f"{logs!r}; to fix: run the image by hand and read its log")
        time.sleep(0.3)
    return Running(kind, image, spec.url(port), time.monotonic() - t0, box)


def _engine(where: str) -> Any:
    """A docker client that answered a ping, or a one-line ContainerError."""
    try:
        import docker  # installed with testcontainers
    except ImportError:
        raise ContainerError(f"{where}: step 'import' failed: testcontainers is not installed; "
                             "to fix: pip install 'mqabstract[containers]'") from None
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:
        raise ContainerError(
            f"{where}: step 'engine' failed: no Docker engine answers at {host} "
            f"({_short(exc)}); to fix: start Docker (or, in a checkout, `scripts/containers up`"
            " and `eval \"$(scripts/containers env)\"`) or set DOCKER_HOST"
        ) from None
    return client


def _image(client: Any, image: str, where: str) -> None:
    """Make sure *image* is here: present, or pulled now."""
    import docker.errors

    try:
        client.images.get(image)
        return
    except docker.errors.ImageNotFound:
        pass
    except Exception as exc:
        raise ContainerError(f"{where}: step 'image' failed: {_short(exc)}; to fix: check the "
                             "Docker engine") from None
    try:
        client.images.pull(image)
    except Exception as exc:
        raise ContainerError(
            f"{where}: step 'image' failed: {image} is not here and could not be pulled "
            f"({_short(exc)}); to fix: pull or build it (in a checkout: `scripts/containers "
            f"images`), or pass --mq-container-image KIND=IMAGE"
        ) from None


def _container(spec: Kind, image: str, port: int) -> Any:
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # we stop what we start
    from testcontainers.core.container import DockerContainer

    box = DockerContainer(image, env=spec.settings(port),
                          labels={"org.mqabstract.conformance": spec.name})
    inner = port if spec.same_port else spec.port
    # Published on loopback only (testcontainers binds every interface by default).
    box.ports[f"{inner}/tcp"] = (HOST, port)
    return box


def _state(box: Any) -> str:
    try:
        wrapped = box.get_wrapped_container()
        wrapped.reload()
        return str(wrapped.status)
    except Exception as exc:
        return f"vanished ({_short(exc)})"


def _logs(box: Any) -> str:
    with contextlib.suppress(Exception):
        lines = box.get_wrapped_container().logs(tail=5).decode(errors="replace").splitlines()
        return lines[-1][:200] if lines else ""
    return ""


def _free_port() -> int:
    """A port free on 127.0.0.1 now (the engine binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"
