"""``mqa``: the mqabstract command line (standard library ``argparse`` only).

    mqa publish orders.eu.created '{"id": 42}' --json
    mqa consume billing 'orders.#' --count 10
    mqa stats billing
    mqa dlq list billing
    mqa relay --from postgresql://app@db/app --to kafka://k:9092

Every command takes ``--url`` (default ``$MQ_URL``, then the embedded SQLite default) and
``--verbose``. Exit codes are listed in ``EXIT_CODES`` and docs/cli.md; expected errors
print one line on stderr, never a traceback, and never a secret from the URL.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import IO, Any, NoReturn

from . import captable, connect
from .broker import Broker, Message, Subscription
from .capabilities import Capabilities, Feature
from .errors import (
    ConnectionFailed,
    InvalidArgument,
    MissingDependency,
    MQError,
    NotFound,
    Timeout,
    Unsupported,
    ValidationError,
)
from .model import DeadLetter, GroupStats, OutgoingMessage
from .url import BrokerURL, redact

__all__ = ["EXIT_CODES", "main"]

EXIT_OK = 0
EXIT_ERROR = 1  #: any other MQError (and unexpected errors)
EXIT_INVALID = 2  #: bad input: ValidationError (InvalidURL, InvalidName, ...), Unsupported
EXIT_UNAVAILABLE = 3  #: ConnectionFailed, Timeout: the broker could not be reached in time
EXIT_NOT_FOUND = 4  #: NotFound (unknown group, dead letter)
EXIT_USAGE = 64  #: wrong command line (unknown option, missing argument)
EXIT_INTERRUPTED = 130  #: Ctrl-C

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_ERROR: "other error (MQError, missing dependency, unexpected failure)",
    EXIT_INVALID: "bad input: ValidationError (invalid URL/scheme, name, argument, too large, "
    "encode error) or Unsupported feature",
    EXIT_UNAVAILABLE: "broker unreachable: ConnectionFailed or Timeout",
    EXIT_NOT_FOUND: "NotFound: unknown group or dead letter",
    EXIT_USAGE: "usage error: unknown command or option, missing argument",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class UsageError(Exception):
    """Wrong command line; printed with the command's usage."""

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage


def exit_code(exc: BaseException) -> int:
    """The process exit code for an exception raised by a command."""
    if isinstance(exc, (ValidationError, Unsupported)):
        return EXIT_INVALID
    if isinstance(exc, (ConnectionFailed, Timeout)):
        return EXIT_UNAVAILABLE
    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    return EXIT_ERROR


class _Parser(argparse.ArgumentParser):
    """Raise ``UsageError`` instead of exiting, so ``main`` returns an int."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage())


# -- small helpers ----------------------------------------------------------------------------
def _stdin_bytes() -> bytes:
    stream = sys.stdin
    if stream is None:
        raise InvalidArgument("no body: give BODY, --file, or pipe it on stdin")
    if stream.isatty():
        raise InvalidArgument("no body: give BODY, --file, or pipe it on stdin (stdin is a tty)")
    buffer = getattr(stream, "buffer", None)
    return buffer.read() if buffer is not None else stream.read().encode("utf-8")


def _read_file(path: str) -> bytes:
    if path == "-":
        return _stdin_bytes()
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror or exc}") from exc


def _headers(pairs: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidArgument(f"header {pair!r} is not name=value")
        out[name] = value
    return out


def _json_value(data: bytes | str, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from exc


def _body_fields(body: bytes) -> dict[str, str]:
    """``body`` as text when it is UTF-8, else base64; ``body_encoding`` says which."""
    try:
        return {"body": body.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode("ascii"), "body_encoding": "base64"}


def message_record(msg: Message | DeadLetter) -> dict[str, Any]:
    """The JSON-lines record printed for a received message or a dead letter."""
    record: dict[str, Any] = {"id": msg.id, "topic": msg.topic, "key": msg.key,
                              "priority": msg.priority}
    if isinstance(msg, DeadLetter):
        record["attempts"] = msg.attempts
        record["reason"] = msg.reason
        record["published_at"] = msg.published_at.isoformat()
        record["dead_lettered_at"] = (
            msg.dead_lettered_at.isoformat() if msg.dead_lettered_at else None
        )
    else:
        record["attempt"] = msg.attempt
        record["published_at"] = msg.published_at.isoformat()
    record["headers"] = dict(msg.headers)
    record.update(_body_fields(msg.body))
    return record


def _emit(record: object, out: IO[str]) -> None:
    out.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
    out.flush()


# -- publish ----------------------------------------------------------------------------------
_BATCH_FIELDS = {"topic", "body", "body_base64", "headers", "key", "priority", "delay",
                 "deliver_at", "id"}


def _batch_messages(
    lines: Iterator[str], args: argparse.Namespace
) -> tuple[list[OutgoingMessage], list[int]]:
    """Messages from JSON lines, and the input line number of each."""
    base_headers = _headers(args.header)
    out: list[OutgoingMessage] = []
    numbers: list[int] = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"batch line {index + 1}"
        item = _json_value(line, where)
        if not isinstance(item, dict):
            raise InvalidArgument(f"{where}: expected a JSON object")
        unknown = set(item) - _BATCH_FIELDS
        if unknown:
            raise InvalidArgument(f"{where}: unknown fields {', '.join(sorted(unknown))}; "
                                  f"known: {', '.join(sorted(_BATCH_FIELDS))}")
        topic = item.get("topic", args.topic)
        if topic is None:
            raise InvalidArgument(f"{where}: no topic (give it per line or as TOPIC)")
        if "body_base64" in item:
            if "body" in item:
                raise InvalidArgument(f"{where}: give body or body_base64, not both")
            try:
                body: Any = base64.b64decode(item["body_base64"], validate=True)
            except (ValueError, TypeError) as exc:
                raise InvalidArgument(f"{where}: body_base64 is not base64") from exc
        elif "body" in item:
            body = item["body"]
        else:
            raise InvalidArgument(f"{where}: no body")
        headers = dict(base_headers)
        if item.get("headers") is not None:
            if not isinstance(item["headers"], dict):
                raise InvalidArgument(f"{where}: headers must be an object")
            headers.update(item["headers"])
        deliver_at = item.get("deliver_at")
        if deliver_at is not None:
            try:
                deliver_at = datetime.fromisoformat(str(deliver_at).replace("Z", "+00:00"))
            except ValueError as exc:
                raise InvalidArgument(f"{where}: deliver_at is not an ISO 8601 time") from exc
        out.append(OutgoingMessage(
            topic=topic, body=body, headers=headers or None,
            key=item.get("key", args.key), priority=item.get("priority", args.priority),
            delay=item.get("delay", args.delay if deliver_at is None else None),
            deliver_at=deliver_at, id=item.get("id"),
        ))
        numbers.append(index + 1)
    return out, numbers


def cmd_publish(args: argparse.Namespace) -> int:
    if args.batch:
        if args.body is not None or args.json or args.id:
            raise UsageError("--batch reads JSON lines from stdin (or --file); it takes no "
                             "BODY, --json or --id")
        data = _read_file(args.file) if args.file else _stdin_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument("batch input is not UTF-8 JSON lines") from exc
        messages, numbers = _batch_messages(iter(text.splitlines()), args)
        with _connect(args) as mq:
            try:
                ids = mq.publish_batch(messages)
            except ValidationError as exc:
                if exc.index is None:
                    raise
                raise type(exc)(f"{exc} (input line {numbers[exc.index]}); nothing was "
                                "published") from exc
    else:
        if args.topic is None:
            raise UsageError("publish needs a TOPIC")
        if args.body is not None and args.file:
            raise UsageError("give BODY or --file, not both")
        body: Any
        if args.body is not None:
            body = args.body
        else:
            body = _read_file(args.file) if args.file else _stdin_bytes()
        if args.json:
            body = _json_value(body, "body")
        with _connect(args) as mq:
            ids = [mq.publish(args.topic, body, headers=_headers(args.header) or None,
                              key=args.key, priority=args.priority, delay=args.delay,
                              id=args.id)]
    for message_id in ids:
        sys.stdout.write(message_id + "\n")
    return EXIT_OK


# -- consume / tail ---------------------------------------------------------------------------
def _consume_loop(
    sub: Subscription, caps: Capabilities, args: argparse.Namespace, ack: bool
) -> None:
    """Print messages as JSON lines; stop after ``--count`` or ``--wait`` idle seconds."""
    count: int | None = args.count
    idle = math.inf if args.follow else args.wait
    held: list[tuple[Message, float]] = []  # no-ack: messages we keep leased until exit
    can_extend = caps.supports(Feature.LEASE_EXTEND)
    lease = args.lease
    seen = 0
    last = time.monotonic()
    while count is None or seen < count:
        now = time.monotonic()
        left = idle - (now - last)
        if left <= 0:
            break
        poll = min(left, 1.0)
        if held and can_extend:  # keep held messages from going back to the group mid-run
            poll = min(poll, lease / 3)
            for i, (msg, until) in enumerate(held):
                if until - now < lease / 2:
                    msg.extend(lease)
                    held[i] = (msg, now + lease)
        want = 100 if count is None else min(100, count - seen)
        batch = sub.receive(want, poll)
        if batch:
            last = time.monotonic()
        for msg in batch:
            _emit(message_record(msg), sys.stdout)  # printed before acked: never lost
            seen += 1
            if ack:
                msg.ack()
            else:
                held.append((msg, time.monotonic() + lease))
    if count is not None and seen < count:
        sys.stderr.write(f"mqa: received {seen} of {count} messages before --wait ran out\n")


def cmd_consume(args: argparse.Namespace) -> int:
    ack = args.ack if args.ack is not None else args.command == "consume"
    if args.count is not None and args.count < 1:
        raise UsageError("--count must be ≥ 1")
    if args.wait < 0:
        raise UsageError("--wait must be ≥ 0")
    with _connect(args) as mq:
        sub = mq.subscribe(args.group, args.pattern, lease=args.lease,
                           max_attempts=args.max_attempts)
        with sub:
            _consume_loop(sub, mq.capabilities, args, ack)
    return EXIT_OK


# -- stats / dlq -------------------------------------------------------------------------------
def cmd_ping(args: argparse.Namespace) -> int:
    """Connect and make ``--count`` round trips: exit 0 when the broker answered, 3 when it
    could not be reached (a liveness/readiness probe)."""
    if args.count < 1:
        raise UsageError("--count must be ≥ 1")
    with _connect(args) as mq:
        times = [mq.ping() for _ in range(args.count)]
        backend, where = mq.backend, mq.url
    best, worst = min(times) * 1000, max(times) * 1000
    if args.json:
        _emit({"ok": True, "backend": backend, "url": where, "round_trips": len(times),
               "min_ms": round(best, 3), "max_ms": round(worst, 3)}, sys.stdout)
    else:
        sys.stdout.write(f"ok {backend} {where}: {len(times)} round trip(s), "
                         f"{best:.2f} to {worst:.2f} ms\n")
    return EXIT_OK


COUNTS = ("ready", "leased", "delayed", "dead", "lag")


def _group_stats(mq: Broker, groups: Sequence[str]) -> list[GroupStats]:
    """The stats of ``groups``, or of every group when none is named."""
    if not groups:
        try:
            groups = mq.groups()
        except Unsupported as exc:
            raise UsageError(f"{exc}: name the groups (mqa stats GROUP ...)") from exc
    return [mq.stats(group) for group in groups]


def _table(rows: Sequence[Sequence[str]], out: IO[str]) -> None:
    """Rows of cells: the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        out.write("  ".join(cells).rstrip() + "\n")


def _cell(value: float | None, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def cmd_stats(args: argparse.Namespace) -> int:
    with _connect(args) as mq:
        rows = _group_stats(mq, args.groups)
    if args.json:
        for st in rows:
            _emit({"group": st.group, **{c: getattr(st, c) for c in COUNTS}}, sys.stdout)
        return EXIT_OK
    _table([("group", *COUNTS)]
           + [(st.group, *(_cell(getattr(st, c)) for c in COUNTS)) for st in rows],
           sys.stdout)
    return EXIT_OK


def _depth(st: GroupStats) -> int | None:
    """Messages waiting or held: the lag where the backend has offsets, else the sum."""
    if st.lag is not None:
        return st.lag
    parts = [v for v in (st.ready, st.leased, st.delayed) if v is not None]
    return sum(parts) if parts else None


def cmd_top(args: argparse.Namespace) -> int:
    """Every ``--interval`` seconds, the groups' counts and how fast their depth and dead
    letters change (depth/s < 0: consumers are ahead)."""
    if args.interval <= 0 or (args.count is not None and args.count < 1):
        raise UsageError("--interval must be > 0 and --count ≥ 1")
    tty = sys.stdout.isatty()
    before: dict[str, tuple[float, GroupStats]] = {}
    with _connect(args) as mq:
        n = 0
        while args.count is None or n < args.count:
            if n:
                time.sleep(args.interval)
            n += 1
            now, rows = time.monotonic(), _group_stats(mq, args.groups)
            table: list[tuple[str, ...]] = [("group", *COUNTS, "depth/s", "dead/s")]
            for st in rows:
                rate = dead_rate = None
                if st.group in before:
                    then, old = before[st.group]
                    depth, old_depth = _depth(st), _depth(old)
                    if depth is not None and old_depth is not None:
                        rate = (depth - old_depth) / (now - then)
                    if st.dead is not None and old.dead is not None:
                        dead_rate = (st.dead - old.dead) / (now - then)
                before[st.group] = (now, st)
                table.append((st.group, *(_cell(getattr(st, c)) for c in COUNTS),
                              _cell(rate, "{:+.1f}"), _cell(dead_rate, "{:+.1f}")))
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")  # home, clear
            sys.stdout.write(f"{mq.backend} {mq.url}  {datetime.now():%H:%M:%S}\n")
            _table(table, sys.stdout)
            sys.stdout.flush()
    return EXIT_OK


def cmd_dlq(args: argparse.Namespace) -> int:
    ids = args.id or None
    with _connect(args) as mq:
        if args.action == "list":
            letters = mq.dead_letters(args.group, limit=args.limit)
            if ids:
                letters = [d for d in letters if d.id in set(ids)]
            for letter in letters:
                _emit(message_record(letter), sys.stdout)
            return EXIT_OK
        if args.action == "replay":
            n = mq.replay_dead_letters(args.group, ids)
            sys.stdout.write(f"replayed {n}\n")
            return EXIT_OK
        if ids is None and not args.all:
            raise UsageError("dlq purge deletes dead letters for good: give --id ID ... or --all")
        n = mq.purge_dead_letters(args.group, ids)
        sys.stdout.write(f"purged {n}\n")
        return EXIT_OK


# -- conformance --------------------------------------------------------------------------------
def cmd_conformance(args: argparse.Namespace) -> int:
    pytest_args = list(args.pytest_args)
    if args.target is not None and args.target.startswith("-"):  # `--container K -- -x`
        args.target, pytest_args = None, [args.target, *pytest_args]
    targets = [] if args.target is None else [args.target]
    if not targets and not args.container:
        raise InvalidArgument("give a broker URL or --container KIND")
    for target in targets:
        BrokerURL.parse(target)  # reject a malformed URL before starting pytest
    cmd = [sys.executable, "-m", "pytest", "-p", "mqabstract.conformance"]
    for target in targets:
        cmd += ["--mq-url", target]
    for kind in args.container:
        cmd += ["--mq-container", kind]
    if args.image:
        if len(args.container) != 1:
            raise InvalidArgument("--image needs exactly one --container KIND")
        cmd += ["--mq-container-image", f"{args.container[0]}={args.image}"]
    cmd += [a for a in pytest_args if a != "--"]
    what = [redact(t) for t in targets] + [f"a {k} container" for k in args.container]
    sys.stderr.write(f"mqa: running conformance suite against {', '.join(what)}\n")
    sys.stderr.flush()
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # pytest got the same SIGINT; let it report and finish
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


# -- bench ---------------------------------------------------------------------------------------
class Progress:
    """A plain-text progress bar on stderr; on a non-terminal, one line per phase."""

    def __init__(self, label: str, total: int, enabled: bool, stream: IO[str]) -> None:
        self.label, self.total, self.enabled, self.stream = label, max(1, total), enabled, stream
        self.tty = enabled and stream.isatty()
        self._last = 0.0
        self._start = time.monotonic()

    def update(self, done: int) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label:<8} [{bar:<30}] {frac * 100:5.1f}% "
                          f"{done}/{self.total}")
        self.stream.flush()

    def finish(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.update(self.total)
        secs = time.monotonic() - self._start
        prefix = "\r" if self.tty else ""
        self.stream.write(f"{prefix}{self.label:<8} [{'#' * 30}] done {self.total} in "
                          f"{secs:.2f}s\n")
        self.stream.flush()


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (``nan`` when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _summary(name: str, n: int, seconds: float, latencies: list[float]) -> dict[str, Any]:
    lat = sorted(latencies)
    return {
        "phase": name,
        "messages": n,
        "seconds": round(seconds, 4),
        "msg_per_s": round(n / seconds, 1) if seconds > 0 else None,
        "p50_ms": round(percentile(lat, 50) * 1000, 3),
        "p90_ms": round(percentile(lat, 90) * 1000, 3),
        "p99_ms": round(percentile(lat, 99) * 1000, 3),
    }


def _check_plot() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from exc


def _plot(path: str, series: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in series.items():
        if not values:
            continue
        ms = sorted(v * 1000 for v in values)
        ax.plot(ms, [100 * (i + 1) / len(ms) for i in range(len(ms))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("percentile")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise InvalidArgument(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.messages < 1 or args.batch < 1 or args.size < 0:
        raise UsageError("--messages and --batch must be ≥ 1, --size ≥ 0")
    if args.plot:
        _check_plot()
    n, size, step = args.messages, args.size, args.batch
    body = os.urandom(size)
    tag = uuid.uuid4().hex[:12]
    topic, group = f"mqa.bench.{tag}", f"mqa-bench-{tag}"
    show = not args.no_progress
    results: list[dict[str, Any]] = []
    series: dict[str, list[float]] = {}
    with _connect(args) as mq:
        caps = mq.capabilities
        if step > 1 and not caps.supports(Feature.BATCH):
            raise Unsupported(f"{mq.backend} does not support batch publish; use --batch 1")
        label = f"{mq.backend} ({mq.url})"
        sub = mq.subscribe(group, topic, lease=60.0)
        try:
            # 1. publish N messages (single or in batches of --batch)
            lat: list[float] = []
            bar = Progress("publish", n, show, sys.stderr)
            t0 = time.perf_counter()
            for start in range(0, n, step):
                k = min(step, n - start)
                s = time.perf_counter()
                if k == 1 and step == 1:
                    mq.publish(topic, body)
                else:
                    mq.publish_batch([OutgoingMessage(topic, body) for _ in range(k)])
                lat.append(time.perf_counter() - s)
                bar.update(start + k)
            results.append(_summary("publish", n, time.perf_counter() - t0, lat))
            bar.finish()
            series["publish"] = lat
            # 2. receive + ack what was published
            lat = []
            bar = Progress("consume", n, show, sys.stderr)
            t0 = time.perf_counter()
            got = 0
            while got < n:
                s = time.perf_counter()
                batch = sub.receive(min(step, n - got), wait=10.0)
                if not batch:
                    raise Timeout(f"bench: only {got} of {n} messages came back within 10 s")
                for msg in batch:
                    msg.ack()
                lat.append(time.perf_counter() - s)
                got += len(batch)
                bar.update(got)
            results.append(_summary("consume", n, time.perf_counter() - t0, lat))
            bar.finish()
            series["receive+ack"] = lat
            # 3. full cycles: publish, receive, ack one message (or batch) at a time
            lat = []
            bar = Progress("cycle", n, show, sys.stderr)
            t0 = time.perf_counter()
            done = 0
            while done < n:
                k = min(step, n - done)
                s = time.perf_counter()
                if k == 1 and step == 1:
                    mq.publish(topic, body)
                else:
                    mq.publish_batch([OutgoingMessage(topic, body) for _ in range(k)])
                left = k
                while left:
                    batch = sub.receive(left, wait=10.0)
                    if not batch:
                        raise Timeout("bench: a published message did not arrive within 10 s")
                    for msg in batch:
                        msg.ack()
                    left -= len(batch)
                lat.append(time.perf_counter() - s)
                done += k
                bar.update(done)
            results.append(_summary("cycle", n, time.perf_counter() - t0, lat))
            bar.finish()
            series["publish+receive+ack"] = lat
        finally:
            sub.close()
            with contextlib.suppress(MQError):  # best effort: the group is empty anyway
                mq.delete_group(group)
    if args.json:
        for row in results:
            _emit({"backend": label, "size": size, "batch": step, **row}, sys.stdout)
    else:
        unit = "per batch" if step > 1 else "per message"
        sys.stdout.write(f"{label}: {n} messages of {size} B, batch {step} "
                         f"(latency {unit})\n")
        sys.stdout.write(f"{'phase':<8} {'msg/s':>10} {'p50 ms':>9} {'p90 ms':>9} "
                         f"{'p99 ms':>9}\n")
        for r in results:
            sys.stdout.write(f"{r['phase']:<8} {r['msg_per_s'] or 0:>10.0f} {r['p50_ms']:>9.3f} "
                             f"{r['p90_ms']:>9.3f} {r['p99_ms']:>9.3f}\n")
    if args.plot:
        _plot(args.plot, series, f"mqa bench: {label}, {size} B, batch {step}")
        sys.stderr.write(f"mqa: wrote {args.plot}\n")
    return EXIT_OK


# -- capabilities ------------------------------------------------------------------------------
def cmd_capabilities(args: argparse.Namespace) -> int:
    urls: list[str] = list(args.targets)
    if args.update:
        if urls:
            raise UsageError("--update uses the built-in backends' static capabilities; "
                             "it takes no URL")
        try:
            with open(args.update, encoding="utf-8") as fh:
                text = fh.read()
            new = captable.update_readme(text)
        except OSError as exc:
            raise InvalidArgument(f"cannot read {args.update}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise InvalidArgument(f"{args.update}: {exc} ({captable.README_BEGIN} ... "
                                  f"{captable.README_END})") from exc
        if new != text:
            with open(args.update, "w", encoding="utf-8") as fh:
                fh.write(new)
        sys.stderr.write(f"mqa: {args.update} {'updated' if new != text else 'up to date'}\n")
        return EXIT_OK
    if args.markdown:
        backends: dict[str, Capabilities] = {}
        if urls:
            for url in urls:
                with connect(url) as mq:
                    backends.setdefault(mq.backend, mq.capabilities)
        else:
            backends, skipped = captable.builtin_capabilities()
            for name, reason in skipped.items():
                sys.stderr.write(f"mqa: skipped {name}: {reason}\n")
        if not backends:
            raise NotFound("no backend capabilities to show")
        sys.stdout.write(captable.capability_table_markdown(backends))
        return EXIT_OK
    if len(urls) > 1:
        raise UsageError("give one URL (or use --markdown for several)")
    with connect(urls[0] if urls else args.url) as mq:
        name, caps = f"{mq.backend} ({mq.url})", mq.capabilities
    sys.stdout.write(captable.capability_table_text(name, caps))
    return EXIT_OK


# -- parser --------------------------------------------------------------------------------------
def cmd_relay(args: argparse.Namespace) -> int:
    from .outbox.command import cmd_relay as run

    return run(args)


def _connect(args: argparse.Namespace) -> Broker:
    return connect(args.url)


def build_parser() -> argparse.ArgumentParser:
    """The ``mqa`` argument parser."""
    common = _Parser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help="broker URL (default: $MQ_URL, then the embedded SQLite file)")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks of errors")

    epilog = "exit codes:\n" + "\n".join(f"  {c:<4} {d}" for c, d in EXIT_CODES.items())
    parser = _Parser(prog="mqa", description="One command line for every mqabstract broker.",
                     epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None,
                        help="broker URL (default: $MQ_URL, then the embedded SQLite file)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str,
            **kw: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help, **kw)
        p.set_defaults(func=fn, parser=p)
        return p

    p = add("publish", cmd_publish, "publish a message (body from BODY, --file or stdin); "
            "prints its id")
    p.add_argument("topic", nargs="?", metavar="TOPIC",
                   help="topic, e.g. orders.eu.created (with --batch: default for lines)")
    p.add_argument("body", nargs="?", metavar="BODY", help="body text (default: stdin)")
    p.add_argument("--file", metavar="PATH", help="read the body from PATH ('-' = stdin)")
    p.add_argument("--json", action="store_true", help="parse the body as JSON, send as JSON")
    p.add_argument("-H", "--header", action="append", metavar="NAME=VALUE",
                   help="header (repeatable)")
    p.add_argument("--key", help="ordering key")
    p.add_argument("--priority", type=int, metavar="0-9", help="priority, higher first")
    p.add_argument("--delay", type=float, metavar="S", help="deliver after S seconds")
    p.add_argument("--id", help="message id (default: random)")
    p.add_argument("--batch", action="store_true",
                   help='read JSON lines {"topic","body",...} from stdin and publish as one '
                        "batch (all or nothing on bad input)")

    for name, desc in (("consume", "receive messages of GROUP and print them as JSON lines "
                                   "(acked after printing)"),
                       ("tail", "like consume, but does not ack (messages go back to the "
                                "group on exit)")):
        p = add(name, cmd_consume, desc)
        p.add_argument("group", metavar="GROUP")
        p.add_argument("pattern", metavar="PATTERN", help="topic pattern, e.g. 'orders.#'")
        p.add_argument("-n", "--count", type=int, metavar="N", help="stop after N messages")
        p.add_argument("--wait", type=float, default=5.0, metavar="S",
                       help="stop when nothing arrives for S seconds (default 5)")
        p.add_argument("-f", "--follow", action="store_true",
                       help="keep waiting for messages until Ctrl-C")
        p.add_argument("--ack", dest="ack", action="store_true", default=None,
                       help="ack each message after printing it (consume's default)")
        p.add_argument("--no-ack", dest="ack", action="store_false",
                       help="do not ack; messages return to the group on exit (tail's default)")
        p.add_argument("--lease", type=float, default=30.0, metavar="S",
                       help="visibility timeout of the group (default 30)")
        p.add_argument("--max-attempts", type=int, default=5, metavar="N",
                       help="deliveries before a message is dead-lettered (default 5)")

    p = add("ping", cmd_ping, "one round trip to the broker: exit 0 if it answers, 3 if not")
    p.add_argument("--count", type=int, default=1, metavar="N", help="round trips (default 1)")
    p.add_argument("--json", action="store_true", help="a JSON line instead of text")

    p = add("stats", cmd_stats,
            "message counts per group: ready, leased, delayed, dead, lag (default: every group)")
    p.add_argument("groups", nargs="*", metavar="GROUP")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")

    p = add("top", cmd_top, "the groups' counts refreshed live, with depth and dead-letter rates")
    p.add_argument("groups", nargs="*", metavar="GROUP")
    p.add_argument("--interval", type=float, default=2.0, metavar="S",
                   help="seconds between refreshes (default 2)")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="stop after N refreshes (default: until Ctrl-C)")

    p = add("dlq", cmd_dlq, "list, replay or purge a group's dead letters")
    p.add_argument("action", choices=("list", "replay", "purge"))
    p.add_argument("group", metavar="GROUP")
    p.add_argument("--id", action="append", metavar="ID", help="only this id (repeatable)")
    p.add_argument("--limit", type=int, default=100, metavar="N",
                   help="list at most N (default 100)")
    p.add_argument("--all", action="store_true", help="purge: confirm deleting all")

    p = add("conformance", cmd_conformance,
            "run the conformance suite against URL and/or a throwaway broker container "
            "(extra arguments go to pytest)")
    p.add_argument("--container", action="append", default=[], metavar="KIND",
                   choices=("rabbitmq", "kafka", "sqs"),
                   help="start a KIND container for the run (rabbitmq, kafka, sqs; extra "
                   "'containers'; repeatable)")
    p.add_argument("--image", metavar="IMAGE",
                   help="image for --container (default: $MQ_CONTAINER_<KIND>_IMAGE or the "
                   "public image)")
    p.add_argument("target", nargs="?", metavar="URL",
                   help="broker URL; with --container only, pytest arguments follow `--`")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="PYTEST_ARGS")

    p = add("bench", cmd_bench, "throughput and latency percentiles of publish, receive+ack "
            "and publish+receive+ack cycles")
    p.add_argument("target", nargs="?", metavar="URL", help="broker URL (default: --url)")
    p.add_argument("--messages", type=int, default=1000, metavar="N", help="default 1000")
    p.add_argument("--size", type=int, default=256, metavar="BYTES", help="default 256")
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="publish and receive N at a time (default 1)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument("--plot", metavar="OUT.png", help="latency CDF plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    p = add("relay", cmd_relay, "move committed outbox rows (or a broker group's messages: a "
            "bridge) to another broker, ids kept, removed only after it confirmed them")
    from .outbox.command import add_arguments

    add_arguments(p)

    p = add("capabilities", cmd_capabilities,
            "a backend's features (NATIVE/EMULATED/UNSUPPORTED) and limits")
    p.add_argument("targets", nargs="*", metavar="URL",
                   help="broker URL (default: --url); with --markdown, several")
    p.add_argument("--markdown", action="store_true",
                   help="Markdown table; without URLs, all built-in backends that import")
    p.add_argument("--update", metavar="README.md",
                   help="rewrite the generated table between the markers in this file")
    return parser


def _fail(exc: BaseException, verbose: bool) -> None:
    if verbose:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.write(f"mqa: error: {type(exc).__name__}: {redact(str(exc))}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mqa`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    verbose = False
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
        verbose = bool(args.verbose)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if getattr(args, "target", None) and args.command in ("bench",):
            args.url = args.target
        return int(args.func(args))
    except UsageError as exc:
        sub_parser = getattr(locals().get("args"), "parser", parser)
        sys.stderr.write(exc.usage or sub_parser.format_usage())
        sys.stderr.write(f"mqa: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("mqa: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `mqa consume ... | head`: the reader went away
        _silence_stdout()
        return EXIT_ERROR
    except MQError as exc:
        _fail(exc, verbose)
        return exit_code(exc)
    except Exception as exc:  # a bug: say so, without a secret-leaking traceback by default
        _fail(exc, verbose)
        if not verbose:
            sys.stderr.write("mqa: unexpected error; run with --verbose for the traceback\n")
        return EXIT_ERROR


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def run() -> None:
    """Entry point for ``python -m mqabstract``."""
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    run()
