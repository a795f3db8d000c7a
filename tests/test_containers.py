"""The container path of the conformance plugin (``--mq-container``) and its test bed.

The suite itself runs against containers in CI (scripts/test); these tests pin what a user
sees when something is missing (one line: the step and the fix, never a silent skip) and
that a container's port is published on loopback only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.brokers import in_ci

REPO = Path(__file__).resolve().parents[1]


def _pytest(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "mqabstract.conformance",
                           "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def _engine() -> str:
    """DOCKER_HOST of an engine that answers; skipped without one (failed in CI)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import containerctl  # type: ignore[import-not-found]

    host = containerctl.engine_host()
    if host is None:
        why = "no Docker engine answers (scripts/containers up starts one)"
        if in_ci():
            pytest.fail(f"{why}; CI=true: never skipped")
        pytest.skip(why)
    return str(host)


def _error_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("ERROR:")]


def test_no_engine_is_one_line_naming_the_step(tmp_path: Path) -> None:
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"}
    done = _pytest("--mq-container", "rabbitmq", env=env)
    assert done.returncode == 4, done.stdout + done.stderr  # usage error: nothing ran
    lines = _error_lines(done.stdout + done.stderr)
    assert len(lines) == 1, done.stdout + done.stderr
    assert "step 'engine' failed" in lines[0] and "to fix:" in lines[0]
    assert "passed" not in done.stdout and "skipped" not in done.stdout


def test_missing_image_is_one_line_naming_the_step() -> None:
    env = {**os.environ, "DOCKER_HOST": _engine()}
    done = _pytest("--mq-container", "kafka",
                   "--mq-container-image", "kafka=mqabstract-test/no-such-image:0", env=env)
    assert done.returncode == 4, done.stdout + done.stderr
    lines = _error_lines(done.stdout + done.stderr)
    assert len(lines) == 1 and "step 'image' failed" in lines[0], done.stdout + done.stderr


def test_bad_image_option_is_a_usage_error() -> None:
    done = _pytest("--mq-container", "kafka", "--mq-container-image", "kafka", env=dict(os.environ))
    assert done.returncode == 4
    assert "expected KIND=IMAGE" in done.stdout + done.stderr


def test_cli_without_url_or_container_is_a_typed_error() -> None:
    done = subprocess.run([sys.executable, "-m", "mqabstract", "conformance"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "InvalidArgument: give a broker URL or --container KIND" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to run the script as an unprivileged user")
def test_engine_start_without_permission_is_one_line() -> None:
    home = Path(tempfile.mkdtemp(prefix="mqa-nobody-"))  # pytest's tmp dirs are root-only
    home.chmod(0o777)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CACHE_HOME": str(home),
           "MQ_BROKERS_DIR": str(home / "state")}
    done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           sys.executable, str(REPO / "scripts" / "containerctl.py"), "up"],
                          capture_output=True, text=True, env=env, timeout=60)
    shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs root; to fix:" in done.stderr, done.stderr


def test_container_port_is_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", _engine())
    from mqabstract.conformance import containers

    box = containers.start("rabbitmq")
    try:
        bindings = box._box.get_wrapped_container().attrs["HostConfig"]["PortBindings"]
        hosts = {b["HostIp"] for binds in bindings.values() for b in binds}
        assert hosts == {"127.0.0.1"}, bindings
        assert box.url.startswith("amqp://guest:guest@127.0.0.1:")
        import mqabstract

        with mqabstract.connect(box.url) as mq:  # the broker is usable, not just listening
            sub = mq.subscribe("port-check", "port.check")
            mid = mq.publish("port.check", b"x")
            got = sub.receive(1, 10.0)
            assert [m.id for m in got] == [mid]
            got[0].ack()
    finally:
        box.stop()


def test_a_pause_the_engine_could_not_make_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 23: the runtime gave up freezing a loaded container ("unable to freeze")
    and the scenario failed before any fault was injected. That error asks again; any
    other, or the same one every time, is raised."""
    from mqabstract.conformance import containers

    monkeypatch.setattr(containers.time, "sleep", lambda _s: None)

    class Box:
        def __init__(self, errors: list[str]) -> None:
            self.errors, self.calls = errors, 0

        def get_wrapped_container(self) -> Box:
            return self

        def pause(self) -> None:
            self.calls += 1
            if self.errors:
                raise RuntimeError(self.errors.pop(0))

    freezing = Box(["500: OCI runtime pause failed: unable to freeze: unknown"] * 2)
    containers.Running("kafka", "img", "kafka://x", 1.0, freezing).pause()
    assert freezing.calls == 3
    gone = Box(["404: no such container"])
    with pytest.raises(RuntimeError, match="no such container"):
        containers.Running("kafka", "img", "kafka://x", 1.0, gone).pause()
    assert gone.calls == 1
    stuck = Box(["unable to freeze"] * 10)
    with pytest.raises(RuntimeError, match="unable to freeze"):
        containers.Running("kafka", "img", "kafka://x", 1.0, stuck).pause()
    assert stuck.calls == containers._PAUSE_TRIES
