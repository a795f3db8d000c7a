"""The ``mqa`` command line: in-process through ``main()`` and as real subprocesses."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mqabstract
from mqabstract import captable, cli
from mqabstract.capabilities import Capabilities, Feature, Support

ROOT = Path(__file__).resolve().parent.parent
MQA = Path(sys.executable).with_name("mqa")


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.db'}"


def feed_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def mqa_proc(*argv: str, env: dict[str, str] | None = None, timeout: float = 60,
             stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    full_env = {k: v for k, v in os.environ.items() if k != "MQ_URL"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "mqabstract", *argv], input=stdin,
                          capture_output=True, timeout=timeout, env=full_env, check=False)


# -- in-process ---------------------------------------------------------------------------------
def test_publish_and_consume_round_trip(capsys, monkeypatch, url):
    code, _, _ = run(capsys, "consume", "billing", "orders.#", "--url", url, "--wait", "0")
    assert code == 0  # declares the group
    code, out, _ = run(capsys, "publish", "orders.eu.created", '{"id": 42}', "--json",
                       "-H", "source=test", "--key", "k1", "--priority", "3", "--id", "m-1",
                       "--url", url)
    assert (code, out) == (0, "m-1\n")
    feed_stdin(monkeypatch, b"\xff\x00binary")
    code, out, _ = run(capsys, "publish", "orders.bin", "--url", url)
    assert code == 0
    bin_id = out.strip()

    code, out, _ = run(capsys, "consume", "billing", "orders.#", "--url", url, "--count", "2",
                       "--wait", "5")
    assert code == 0
    first, second = lines(out)
    assert first["id"] == "m-1" and first["topic"] == "orders.eu.created"
    assert json.loads(first["body"]) == {"id": 42} and first["body_encoding"] == "utf-8"
    assert first["headers"]["source"] == "test"
    assert first["headers"]["content-type"] == "application/json"
    assert (first["key"], first["priority"], first["attempt"]) == ("k1", 3, 1)
    assert first["published_at"].endswith("+00:00")
    assert second["id"] == bin_id and second["body_encoding"] == "base64"
    assert base64.b64decode(second["body"]) == b"\xff\x00binary"
    # acked: nothing left
    code, out, _ = run(capsys, "stats", "billing", "--json", "--url", url)
    assert lines(out) == [{"group": "billing", "ready": 0, "leased": 0, "delayed": 0, "dead": 0,
                           "lag": None}]


def test_body_from_file_and_delay(capsys, tmp_path, url):
    run(capsys, "consume", "g", "t", "--url", url, "--wait", "0")
    body = tmp_path / "body.bin"
    body.write_bytes(b"from a file")
    assert run(capsys, "publish", "t", "--file", str(body), "--url", url)[0] == 0
    assert run(capsys, "publish", "t", "later", "--delay", "60", "--url", url)[0] == 0
    code, out, _ = run(capsys, "stats", "g", "--url", url)
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["group", "ready", "leased", "delayed", "dead", "lag"]
    assert row.split() == ["g", "1", "0", "1", "0", "-"]
    code, out, _ = run(capsys, "consume", "g", "t", "--url", url, "--wait", "0.2")
    assert [m["body"] for m in lines(out)] == ["from a file"]


def test_stats_without_names_lists_every_group_and_top_shows_rates(capsys, url):
    for group in ("b-group", "a-group"):
        run(capsys, "consume", group, "t.#", "--url", url, "--wait", "0")
    for n in range(3):
        run(capsys, "publish", "t.x", str(n), "--url", url)
    code, out, _ = run(capsys, "stats", "--url", url)
    assert code == 0
    assert [r.split()[:2] for r in out.splitlines()[1:]] == [["a-group", "3"], ["b-group", "3"]]
    code, out, _ = run(capsys, "top", "a-group", "--url", url, "--count", "2",
                       "--interval", "0.05")
    assert code == 0
    frames = [line.split() for line in out.splitlines() if line.startswith("a-group")]
    assert len(frames) == 2 and frames[0][-2:] == ["-", "-"]  # no rate before a 2nd reading
    assert frames[1][-2:] == ["+0.0", "+0.0"]  # depth 3 both times
    assert run(capsys, "top", "--url", "memory://", "--count", "0")[0] == 64


def test_url_defaults_to_mq_url(capsys, monkeypatch, url):
    monkeypatch.setenv("MQ_URL", url)
    run(capsys, "consume", "g", "t", "--wait", "0")
    assert run(capsys, "publish", "t", "x")[0] == 0
    out = run(capsys, "stats", "g", "--json")[1]
    assert lines(out)[0]["ready"] == 1


def test_batch_publish_all_or_nothing(capsys, monkeypatch, url):
    run(capsys, "consume", "g", "b.#", "--url", url, "--wait", "0")
    good = b'{"topic": "b.one", "body": {"n": 1}}\n\n{"body": "text", "key": "k"}\n'
    feed_stdin(monkeypatch, good + b'{"body_base64": "//4=", "id": "raw-1"}\n')
    code, out, _ = run(capsys, "publish", "b.default", "--batch", "-H", "h=v", "--url", url)
    assert code == 0
    assert len(out.split()) == 3 and out.split()[2] == "raw-1"

    feed_stdin(monkeypatch, good + b'{"topic": "bad topic!", "body": 1}\n')
    code, out, err = run(capsys, "publish", "b.default", "--batch", "--url", url)
    assert code == 2 and out == ""
    assert "InvalidName" in err and "message #2" in err and "input line 4" in err
    feed_stdin(monkeypatch, b'{"topic": "b.x", "bodee": 1}\n')
    code, _, err = run(capsys, "publish", "--batch", "--url", url)
    assert code == 2 and "unknown fields bodee" in err

    code, out, _ = run(capsys, "consume", "g", "b.#", "--url", url, "--wait", "0.2")
    got = lines(out)
    assert [m["topic"] for m in got] == ["b.one", "b.default", "b.default"]
    assert all(m["headers"].get("h") == "v" for m in got)
    assert base64.b64decode(got[2]["body"]) == b"\xff\xfe"


def test_tail_does_not_ack(capsys, url):
    run(capsys, "tail", "g", "t", "--url", url, "--wait", "0")
    run(capsys, "publish", "t", "hello", "--url", url)
    code, out, _ = run(capsys, "tail", "g", "t", "--url", url, "--count", "1")
    assert code == 0 and lines(out)[0]["attempt"] == 1
    code, out, _ = run(capsys, "consume", "g", "t", "--url", url, "--count", "1")
    assert lines(out)[0]["attempt"] == 2 and lines(out)[0]["body"] == "hello"
    code, out, err = run(capsys, "consume", "g", "t", "--url", url, "--count", "1",
                         "--wait", "0.2")
    assert code == 0 and out == "" and "received 0 of 1" in err


def test_dead_letters_list_replay_purge(capsys, url):
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe("g", "t", max_attempts=1)
        mq.publish("t", "one", id="d-1")
        mq.publish("t", "two", id="d-2")
        for msg in sub.receive(2, wait=5):
            msg.dead_letter("poison")
    code, out, _ = run(capsys, "dlq", "list", "g", "--url", url)
    assert code == 0
    got = lines(out)
    assert [d["id"] for d in got] == ["d-1", "d-2"]
    assert got[0]["reason"] == "poison" and got[0]["attempts"] == 1 and got[0]["body"] == "one"
    assert run(capsys, "dlq", "list", "g", "--id", "d-2", "--url", url)[1].count("\n") == 1
    code, out, _ = run(capsys, "dlq", "replay", "g", "--id", "d-1", "--url", url)
    assert (code, out) == (0, "replayed 1\n")
    code, _, err = run(capsys, "dlq", "purge", "g", "--url", url)
    assert code == cli.EXIT_USAGE and "--all" in err
    assert run(capsys, "dlq", "purge", "g", "--all", "--url", url)[1] == "purged 1\n"
    code, out, _ = run(capsys, "stats", "g", "--json", "--url", url)
    assert lines(out)[0]["ready"] == 1 and lines(out)[0]["dead"] == 0


def test_expected_errors_have_exit_codes_and_no_traceback(capsys, url):
    code, _, err = run(capsys, "stats", "nope", "--url", url)
    assert code == 4 and "NotFound" in err and "Traceback" not in err
    code, _, err = run(capsys, "publish", "t", "x", "--priority", "12", "--url", url)
    assert code == 2 and "InvalidArgument" in err
    code, _, err = run(capsys, "publish", "t", "{oops", "--json", "--url", url)
    assert code == 2 and "not valid JSON" in err
    code, _, err = run(capsys, "publish", "t", "--file", "/nonexistent/x", "--url", url)
    assert code == 2 and "cannot read" in err
    code, _, err = run(capsys, "--url", "nosuch://host", "stats", "g")
    assert code == 2 and "known schemes" in err and "sqlite" in err
    code, _, err = run(capsys, "stats", "nope", "--url", url, "--verbose")
    assert code == 4 and "Traceback" in err


def test_usage_errors(capsys, url):
    assert run(capsys)[0] == cli.EXIT_USAGE
    code, _, err = run(capsys, "frobnicate")
    assert code == cli.EXIT_USAGE and "invalid choice" in err
    code, _, err = run(capsys, "publish", "--url", url)
    assert code == cli.EXIT_USAGE and "usage: mqa publish" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "exit codes" in out and "130" in out


def test_capabilities(capsys, url):
    code, out, _ = run(capsys, "capabilities", url)
    assert code == 0 and "backend: sqlite" in out
    for feature in Feature:
        assert f"{feature.value}" in out
    assert "max body" in out
    code, out, _ = run(capsys, "capabilities", "--markdown")
    assert code == 0
    assert out.startswith("| feature | memory")
    code, out, _ = run(capsys, "capabilities", "--markdown", "memory://", url)
    assert out.splitlines()[0] == "| feature | memory | sqlite |"


def test_capability_table_markdown():
    caps = Capabilities.all_native(max_body_bytes=1 << 20).with_features(
        priority=Support.UNSUPPORTED, delay=Support.EMULATED
    )
    table = captable.capability_table_markdown({"a": caps, "b": Capabilities.all_native(
        max_body_bytes=262144, durable=False)})
    rows = table.splitlines()
    assert rows[0] == "| feature | a | b |"
    assert "| priority 0-9 | — | native |" in rows
    assert "| delay / deliver_at | emulated | native |" in rows
    assert "| max body | 1 MiB | 256 KiB |" in rows
    assert "| durable | yes | no |" in rows
    assert table.endswith("\n")
    readme = f"intro\n{captable.README_BEGIN}\nold\n{captable.README_END}\nrest\n"
    assert captable.replace_marked_block(readme, table) == (
        f"intro\n{captable.README_BEGIN}\n{table}{captable.README_END}\nrest\n"
    )


def test_readme_capability_table_is_current():
    text = (ROOT / "README.md").read_text()
    assert captable.README_BEGIN in text, "README.md lost its capability-table markers"
    block = text[text.index(captable.README_BEGIN) + len(captable.README_BEGIN):
                 text.index(captable.README_END)]
    assert block.strip(), "README.md's table is empty: mqa capabilities --update README.md"
    assert captable.update_readme(text) == text, (
        "README.md's capability table disagrees with the drivers: "
        "run `mqa capabilities --update README.md`"
    )


def test_capabilities_update(capsys, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{captable.README_BEGIN}\n{captable.README_END}\ntail\n")
    code, _, err = run(capsys, "capabilities", "--update", str(readme))
    assert code == 0 and "updated" in err
    text = readme.read_text()
    assert "| feature | memory" in text and text.endswith(f"{captable.README_END}\ntail\n")
    assert run(capsys, "capabilities", "--update", str(readme))[2].endswith("up to date\n")
    readme.write_text("no markers\n")
    code, _, err = run(capsys, "capabilities", "--update", str(readme))
    assert code == 2 and "markers not found" in err


def test_bench_small(capsys, url):
    code, out, err = run(capsys, "bench", url, "--messages", "40", "--batch", "8", "--json")
    assert code == 0
    rows = lines(out)
    assert [r["phase"] for r in rows] == ["publish", "consume", "cycle"]
    assert all(r["messages"] == 40 and r["msg_per_s"] > 0 for r in rows)
    assert all(r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] for r in rows)
    assert "done 40" in err  # progress on stderr
    code, out, _ = run(capsys, "bench", "--url", url, "--messages", "5", "--no-progress")
    assert code == 0 and "p99 ms" in out


def test_bench_plot_without_matplotlib(capsys, monkeypatch, url):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    code, _, err = run(capsys, "bench", url, "--messages", "5", "--plot", "x.png")
    assert code == 1 and "pip install matplotlib" in err


def test_percentile():
    values = sorted(float(i) for i in range(1, 101))
    assert cli.percentile(values, 50) == 50.0
    assert cli.percentile(values, 99) == 99.0
    assert cli.percentile([3.0], 90) == 3.0


def test_conformance_passes_exit_code_through(capsys):
    # No test matches -k: pytest's own exit code 5 comes back unchanged.
    code = cli.main(["conformance", "memory://", "-q", "-k", "no_such_scenario_xyz"])
    assert code == 5


# -- real subprocesses ------------------------------------------------------------------------
def test_subprocesses_share_a_sqlite_broker(url):
    declare = mqa_proc("consume", "g", "jobs.*", "--url", url, "--wait", "0")
    assert declare.returncode == 0, declare.stderr
    pub = mqa_proc("publish", "jobs.new", "--url", url, stdin=b"from stdin\n")
    assert pub.returncode == 0, pub.stderr
    assert MQA.exists(), "console script mqa not installed in the venv"
    got = subprocess.run([str(MQA), "consume", "g", "jobs.*", "--url", url, "--count", "1"],
                         capture_output=True, timeout=60, check=False)
    assert got.returncode == 0, got.stderr
    record = json.loads(got.stdout)
    assert record["id"] == pub.stdout.decode().strip() and record["body"] == "from stdin\n"


def test_unreachable_broker_exits_3_fast_without_secret():
    start = time.monotonic()
    proc = mqa_proc("stats", "g", "--url", "amqp://guest:secret@127.0.0.1:1/", timeout=30)
    assert time.monotonic() - start < 15
    assert proc.returncode == 3
    both = proc.stdout + proc.stderr
    assert b"ConnectionFailed" in proc.stderr and b"secret" not in both
    assert b"Traceback" not in both


def test_ping_answers_with_round_trips(capsys, url):
    code, out, err = run(capsys, "ping", "--url", url, "--count", "3", "--json")
    assert code == 0, err
    [line] = lines(out)
    assert line["ok"] and line["backend"] == "sqlite" and line["round_trips"] == 3
    assert 0 <= line["min_ms"] <= line["max_ms"]
    code, out, _ = run(capsys, "ping", "--url", url)
    assert code == 0 and out.startswith("ok sqlite ")
    assert run(capsys, "ping", "--url", url, "--count", "0")[0] == cli.EXIT_USAGE


def test_ping_of_an_unreachable_broker_exits_3_without_secret():
    proc = mqa_proc("ping", "--url", "amqp://guest:secret@127.0.0.1:1/", timeout=30)
    assert proc.returncode == 3
    both = proc.stdout + proc.stderr
    assert b"secret" not in both and b"Traceback" not in both


def test_unknown_scheme_exits_2_listing_schemes():
    proc = mqa_proc("stats", "g", env={"MQ_URL": "nosuch://x"})
    assert proc.returncode == 2
    assert b"known schemes" in proc.stderr and b"sqlite" in proc.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery is POSIX-specific")
def test_ctrl_c_exits_130_cleanly_and_releases_messages(url):
    with mqabstract.connect(url) as mq:
        mq.declare("g", "t")
        mq.publish("t", "held", id="h-1")
    # A job started in the background by a non-interactive shell inherits SIGINT ignored,
    # and Python then installs no KeyboardInterrupt handler: `scripts/test &` made this
    # test hang in receive, SIGINT never delivered. The CLI is right to keep an ignored
    # SIGINT ignored; the test gives its child the default disposition, as a terminal's
    # foreground job has. (-X faulthandler: SIGABRT prints every thread's stack.)
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "mqabstract", "tail", "g", "t",
         "--follow", "--url", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the message is printed, and held (no ack)
    assert json.loads(first)["id"] == "h-1"
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # where it hangs, then fail with it
        _, err = proc.communicate(timeout=30)
        pytest.fail("mqa tail did not exit within 30 s of SIGINT; its threads:\n"
                    + err.decode(errors="replace")[-6000:])
    assert proc.returncode == 130
    assert b"Traceback" not in err and b"interrupted" in err
    with mqabstract.connect(url) as mq:  # released on exit: deliverable again right away
        msgs = mq.subscribe("g", "t").receive(1, wait=5)
        assert [m.id for m in msgs] == ["h-1"] and msgs[0].attempt == 2, (
            f"not released at exit (failed once in a full CI run, cause open); "
            f"the CLI's stderr: {err.decode(errors='replace')[-2000:]}")
