"""A Docker engine and locally built broker images for the container conformance runs.

``up`` makes a Docker engine answer: it uses one that already does (``$DOCKER_HOST`` or
the system socket); otherwise it installs Debian's ``docker.io`` when missing and starts a
private ``dockerd`` (own socket, pid file and exec root under the state dir; its data root
under the download cache, so images survive between runs). ``down`` stops only a dockerd
that ``up`` started. ``images`` builds the broker images from the versioned build contexts
in ``scripts/images/`` on a Debian base made with ``debootstrap`` (no image registry is
needed): RabbitMQ and PostgreSQL 15 from Debian, Apache Kafka from the Maven jars, moto
from PyPI. Each tag
carries a hash of its context, so an image is built once and rebuilt only when its
context changes. ``env`` prints ``DOCKER_HOST`` and ``MQ_CONTAINER_<KIND>_IMAGE``.

Standard library only, like brokerctl.py (whose helpers it reuses).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import brokerctl
from brokerctl import BrokerError, _run_step, apt_install, cache_root

IMAGES_DIR = brokerctl.REPO / "scripts" / "images"
KINDS = ("rabbitmq", "kafka", "sqs", "postgresql")
BASE_SUITE = "bookworm"
SYSTEM_SOCKET = "/var/run/docker.sock"
ENGINE_TIMEOUT = 60.0


# --------------------------------------------------------------------------- the engine


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def engine_answers(host: str, timeout: float = 3.0) -> bool:
    """True when the Docker engine at *host* (``unix://PATH``) answers ``GET /_ping``."""
    if not host.startswith("unix://"):
        return _cli_ping(host)  # tcp:// or ssh://: let the docker CLI speak it
    conn = _UnixHTTP(host[len("unix://"):], timeout)
    try:
        conn.request("GET", "/_ping")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _cli_ping(host: str) -> bool:
    try:
        done = subprocess.run(["docker", "-H", host, "version", "--format", "{{.Server.Version}}"],
                              capture_output=True, timeout=15, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


class PrivateDockerd(brokerctl._Managed):
    """A dockerd of our own: socket, pid file and exec root in the state dir.

    Its data root (images, layers) is in the download cache, shared by every run of this
    user, so the images are built once. Two engines cannot share a data root: when another
    of ours holds it, start fails with dockerd's own message.
    """

    kind = "docker"

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(0, state_dir)
        self.name = "dockerd"
        self.dir = self.root / "dockerd"
        self.state_file = self.root / "dockerd.json"
        self.log = self.dir / "dockerd.log"
        self.socket = self.dir / "docker.sock"
        self.pidfile = self.dir / "docker.pid"
        self.data_root = cache_root() / "docker-data"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def ready(self, timeout: float = 3.0) -> bool:
        return engine_answers(self.url, timeout)

    def _marker(self) -> str:
        return f"--pidfile {self.pidfile}"

    def _launch(self) -> int:
        ensure_docker_installed()
        self.dir.mkdir(parents=True, exist_ok=True)
        # exec-root holds containerd's sockets: a short path (unix sockets: 108 bytes).
        exec_root = Path(tempfile.gettempdir()) / f"mqa-docker-{_short_hash(str(self.dir))}"
        argv = ["dockerd", "--data-root", str(self.data_root), "--exec-root", str(exec_root),
                "--pidfile", str(self.pidfile), "-H", self.url]
        return self._spawn(argv, dict(os.environ))


def ensure_docker_installed() -> None:
    """Install Debian's docker.io (dockerd, containerd, runc, the CLI) when dockerd is missing."""
    if shutil.which("dockerd") is None:
        apt_install("docker", ["docker.io"])


def engine_host(state_dir: str | None = None) -> str | None:
    """DOCKER_HOST of an engine that answers now: the caller's, the system's, or ours."""
    given = os.environ.get("DOCKER_HOST", "").strip()
    if given:
        return given if engine_answers(given) else None
    for host in (f"unix://{SYSTEM_SOCKET}", PrivateDockerd(state_dir).url):
        if engine_answers(host):
            return host
    return None


def up(state_dir: str | None = None) -> str:
    """Make an engine answer; return its DOCKER_HOST. Raises a one-line BrokerError."""
    given = os.environ.get("DOCKER_HOST", "").strip()
    host = engine_host(state_dir)
    if host:
        print(f"docker        {host}  answering", file=sys.stderr)
        return host
    if given:
        raise BrokerError(f"docker: DOCKER_HOST={given} does not answer; start that engine or "
                          "unset DOCKER_HOST to let this script start one")
    if os.geteuid() != 0:
        raise BrokerError("docker: step 'start dockerd' failed: no engine answers and dockerd "
                          "needs root; to fix: start Docker (e.g. `sudo systemctl start docker`)"
                          " and add yourself to the docker group, or run this as root")
    engine = PrivateDockerd(state_dir)
    t0 = time.monotonic()
    with brokerctl._locked(engine.root):
        engine.start(ENGINE_TIMEOUT)
    print(f"docker        {engine.url}  started pid {engine.pid()} in "
          f"{time.monotonic() - t0:.1f}s", file=sys.stderr)
    return engine.url


def down(state_dir: str | None = None) -> bool:
    """Stop the dockerd that ``up`` started (and the containers it runs); True if one ran."""
    engine = PrivateDockerd(state_dir)
    with brokerctl._locked(engine.root):
        stopped = engine.stop(timeout=30.0)
    if stopped:
        print(f"docker        stopped ({engine.url})", file=sys.stderr)
    return stopped


# --------------------------------------------------------------------------- images


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _docker(host: str, *args: str) -> list[str]:
    return ["docker", "-H", host, *args]


def image_present(host: str, tag: str) -> bool:
    done = subprocess.run(_docker(host, "image", "inspect", tag), capture_output=True,
                          check=False)
    return done.returncode == 0


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (its sources), for debootstrap."""
    for path in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        with contextlib.suppress(OSError):
            text = path.read_text()
            found = re.search(r"^URIs:\s*(\S+)", text, re.M) or re.search(
                r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+\s+main", text, re.M)
            if found and "security" not in found.group(1):
                return found.group(1)
    return "http://deb.debian.org/debian"


def base_image(host: str) -> str:
    """Tag of the Debian base (debootstrap minbase, imported); made when missing."""
    mirror = apt_mirror()
    tag = f"mqabstract-test/debian:{BASE_SUITE}-{_short_hash(mirror)}"
    if image_present(host, tag):
        return tag
    if shutil.which("debootstrap") is None:
        apt_install("docker", ["debootstrap"])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mqa-rootfs-", dir=cache_root()) as tmp:
        root = Path(tmp) / "root"
        _run_step("images", f"debootstrap {BASE_SUITE}",
                  ["debootstrap", "--variant=minbase", BASE_SUITE, str(root), mirror],
                  f"check that {mirror} is reachable")
        # The image's apt gets the same mirror.
        (root / "etc/apt/sources.list").write_text(f"deb {mirror} {BASE_SUITE} main\n")
        pipe = (f"set -o pipefail; tar -C {shlex.quote(str(root))} -c . | "
                f"{shlex.join(_docker(host, 'import', '-', tag))}")
        _run_step("images", "docker import", ["bash", "-c", pipe], "see the engine's log")
    print(f"images        {tag}  built in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return tag


#: Files from elsewhere in the repository that an image's context also carries.
EXTRA_FILES = {"sqs": [brokerctl.REPO / "scripts" / "moto_server.py"]}


def _context_files(kind: str) -> list[Path]:
    own = sorted(p for p in (IMAGES_DIR / kind).rglob("*") if p.is_file())
    return own + EXTRA_FILES.get(kind, [])


def _build_args(kind: str, python: str | None) -> dict[str, str]:
    if kind == "sqs":
        moto = brokerctl._package_version(python or sys.executable, "moto")
        if not moto:
            raise BrokerError("images: sqs needs the moto version to install; run scripts/setup "
                              "first (moto is in the test extra)")
        return {"MOTO_VERSION": moto}
    if kind == "kafka":
        return {"KAFKA_VERSION": brokerctl.kafka_version()}
    return {}


def moto_wheels(version: str, python: str | None) -> Path:
    """Wheels of ``moto[server]==version`` and its dependencies, built once on the host."""
    out = cache_root() / f"wheels-moto-{version}"
    if (out / ".complete").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    _run_step("images", f"pip wheel moto[server]=={version}",
              [python or sys.executable, "-m", "pip", "wheel", "-q", "-w", str(out),
               f"moto[server]=={version}"], "check that PyPI is reachable")
    (out / ".complete").touch()
    return out


def image_tag(kind: str, python: str | None = None) -> str:
    """The tag of *kind*'s image: its context files and build arguments, hashed."""
    digest = hashlib.sha256()
    for path in _context_files(kind):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    args = _build_args(kind, python)
    digest.update(repr(sorted(args.items())).encode())
    version = {"kafka": args.get("KAFKA_VERSION"), "sqs": args.get("MOTO_VERSION")}.get(kind)
    label = {"rabbitmq": "rabbitmq-deb12", "kafka": "kafka", "sqs": "moto",
             "postgresql": "postgresql15-deb12"}[kind]
    return f"mqabstract-test/{label}:{version + '-' if version else ''}{digest.hexdigest()[:10]}"


def build(kind: str, host: str, python: str | None = None) -> str:
    """Build *kind*'s image when its tag is missing; return the tag."""
    tag = image_tag(kind, python)
    if image_present(host, tag):
        return tag
    base = base_image(host)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mqa-ctx-{kind}-") as tmp:
        ctx = Path(tmp)
        for path in _context_files(kind):
            shutil.copy2(path, ctx / path.name)
        args = {"BASE": base, **_build_args(kind, python)}
        if kind == "kafka":
            libs = brokerctl.kafka_libs()  # downloads the jars from Maven Central if needed
            shutil.copytree(libs, ctx / "libs")
        if kind == "sqs":
            shutil.copytree(moto_wheels(args["MOTO_VERSION"], python), ctx / "wheels")
        argv = _docker(host, "build", "-q", "-t", tag,
                       *[f"--build-arg={k}={v}" for k, v in args.items()], str(ctx))
        _run_step("images", f"docker build {tag}", argv,
                  f"read the build output above; the context is scripts/images/{kind}")
    print(f"images        {tag}  built in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return tag


def env_lines(host: str | None, python: str | None = None) -> list[str]:
    """``export`` lines: DOCKER_HOST, and the image of every kind already built."""
    if host is None:
        return []
    lines = [f"export DOCKER_HOST={shlex.quote(host)}"]
    for kind in KINDS:
        with contextlib.suppress(BrokerError):
            tag = image_tag(kind, python)
            if image_present(host, tag):
                lines.append(f"export MQ_CONTAINER_{kind.upper()}_IMAGE={shlex.quote(tag)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """CLI: ``containers up|down|status|env|images [rabbitmq|kafka|sqs|postgresql ...]``."""
    parser = argparse.ArgumentParser(prog="containers", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status", "env", "images"))
    parser.add_argument("kinds", nargs="*", metavar="kind",
                        help="images to build: rabbitmq, kafka, sqs, postgresql (default: all)")
    parser.add_argument("--python", help="interpreter whose moto version the sqs image pins")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kind(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    kinds = list(dict.fromkeys(args.kinds)) or list(KINDS)
    python = args.python or os.environ.get("MQ_BROKERS_PYTHON") or None
    try:
        if args.command in ("up", "images"):
            host = up()
            if args.command == "images" or args.kinds:
                for kind in kinds:
                    print(f"images        {build(kind, host, python)}  ready", file=sys.stderr)
        elif args.command == "down":
            down()
        elif args.command == "env":
            print("\n".join(env_lines(engine_host(), python)))
        else:
            host = engine_host()
            print(f"docker        {host or 'no engine answers'}")
            return 0 if host else 3
    except BrokerError as exc:
        print(f"containers {args.command} failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
