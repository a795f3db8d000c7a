"""``mqa relay``: a relay (or a bridge) as a process, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from dataclasses import asdict
from typing import Any

from .relay import Relay

__all__ = ["add_arguments", "cmd_relay"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source", required=True, metavar="SOURCE",
                   help="outbox database (sqlite:///app.db, postgresql://…/db?schema=mq) or a "
                        "broker group to bridge (amqp://…?group=NAME[&pattern=P])")
    p.add_argument("--to", dest="target", required=True, metavar="URL",
                   help="broker URL the messages go to")
    p.add_argument("--batch", type=int, default=500, metavar="N",
                   help="messages per claim and publish (default 500)")
    p.add_argument("--poll", type=float, default=0.5, metavar="S",
                   help="seconds between looks at an empty outbox (default 0.5)")
    p.add_argument("--lease", type=float, default=30.0, metavar="S",
                   help="seconds a claim may take before the source takes it back "
                        "(default 30)")
    p.add_argument("--idle", type=float, default=None, metavar="S",
                   help="exit after S seconds with nothing to move (default: run until "
                        "Ctrl-C or SIGTERM)")


def cmd_relay(args: argparse.Namespace) -> int:
    """Run a relay; on exit print its counts as one JSON line."""
    stop = threading.Event()
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with Relay(args.source, args.target, batch=args.batch, poll_interval=args.poll,
                   lease=args.lease) as relay:
            try:
                stats = relay.run(stop, idle_timeout=args.idle)
            except KeyboardInterrupt:
                stats = relay.stats
            sys.stdout.write(json.dumps(asdict(stats)) + "\n")
            sys.stdout.flush()
    finally:
        if previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, previous)
    return 0
