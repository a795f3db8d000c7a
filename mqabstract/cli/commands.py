"""The ``mqa`` commands that talk to a broker: publish, consume, ping, stats, top, dlq,
conformance, capabilities and relay."""

from __future__ import annotations

import argparse
import base64
import math
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import IO, Any

from .. import captable, connect
from ..broker import Broker, Message, Subscription
from ..capabilities import Capabilities, Feature
from ..errors import (
    InvalidArgument,
    NotFound,
    Unsupported,
    ValidationError,
)
from ..model import GroupStats, OutgoingMessage
from ..url import BrokerURL, redact
from ._base import (
    EXIT_OK,
    UsageError,
    _connect,
    _emit,
    _headers,
    _json_value,
    _read_file,
    _stdin_bytes,
    message_record,
)

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



def cmd_relay(args: argparse.Namespace) -> int:
    from ..outbox.command import cmd_relay as run

    return run(args)

