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
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import MQError
from ..url import redact
from ._base import (
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UsageError,
    _Parser,
    exit_code,
)
from .bench import cmd_bench, percentile
from .commands import (
    cmd_capabilities,
    cmd_conformance,
    cmd_consume,
    cmd_dlq,
    cmd_ping,
    cmd_publish,
    cmd_relay,
    cmd_stats,
    cmd_top,
)

__all__ = ["EXIT_CODES", "EXIT_USAGE", "main", "percentile", "run"]


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
    from ..outbox.command import add_arguments

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
