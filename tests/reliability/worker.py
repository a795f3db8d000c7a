"""Subprocess side of the fault tests (run as a script, not collected by pytest).

    worker.py consume URL GROUP PATTERN LEASE MAX_ATTEMPTS IDLE KILL SEED [BATCH [WORK]]
        print ``READY pid t``, then receive up to BATCH (default 5) at a time, printing
        ``CALLING start`` before and ``CALL start returned n`` after each receive call (a
        ``CALLING`` without its ``CALL``: a kill cut that call short); then the
        ``RECV id attempt digest origin deadline returned`` line of every message the call
        returned (all before processing any: a kill mid-batch must not hide the rest, which
        the broker counted and this process held), and per message "process" it (sleep up
        to WORK seconds, default 0.02), then ``ACKING id t``,
        ack, ``ACKED id t``. KILL is ``none`` or ``PHASE:N``: SIGKILL itself when the Nth
        message reaches PHASE (``recv``: before acking, ``acking``: just before the ack
        call, ``acked``: right after it). A message with header ``poison=crash`` kills the
        process on receipt. Exits (``DONE t``) after IDLE seconds without messages.
        An ack after the lease deadline (the process was frozen) prints ``EXPIRED id t``.
    worker.py hold URL GROUP PATTERN LEASE COUNT
        receive up to COUNT messages in one call (``CALL`` lines as above), print
        ``RECVAT t`` (time.monotonic() before that call: the lease deadline is at most
        t + LEASE), the ``RECV`` lines and ``HELD t``; then wait for a line on stdin (the
        parent freezes this process meanwhile) and try to ack each message, printing
        ``ACKING id t`` and ``ACKED id t`` or ``EXPIRED id t``.
    worker.py dedupe URL GROUP PATTERN LEASE STORE KILL IDLE
        ``consume`` with ``dedupe=SQLiteStore(STORE)`` (or, STORE ``postgresql://…#SCHEMA``,
        ``PostgresStore`` with effects in ``SCHEMA.effects``); the handler inserts a row into
        the store's ``effects`` table inside ``store.transaction`` (its side effect, once
        per id or never). KILL is ``none``, ``inside:N`` (SIGKILL inside the Nth handler's
        transaction: rolled back) or ``after:N`` (SIGKILL right after the Nth handler's
        transaction committed, printing ``KILLED id``: between its success and the ack).
        Each message its handler gets prints a ``RECV`` line (``returned``: the time the
        handler started, by which its receive call had returned).
        Prints ``STATS received acked duplicates`` when it exits after IDLE seconds
        without messages.
    worker.py relay SOURCE TARGET BATCH LEASE KILL
        ``outbox.Relay(SOURCE, TARGET)`` until SIGTERM; KILL is ``none`` or ``confirm:N``:
        SIGKILL itself on the Nth claim after the target confirmed it, before the source
        settles it (printing ``KILLED n``): those messages are published again by the next
        relay, with their ids.
    worker.py publish URL TOPIC COUNT PREFIX SEED
        publish COUNT messages with ids PREFIX-n, mixing single publishes and batches;
        ``TRY id...`` before each call, ``PUB id...`` after it returned (confirmed).

Every mode that receives prints ``LATE id attempt t`` for each message of a receive call
that returned after its lease had ended (handed to nobody, counted by the broker).

Every line is flushed before the next step, so a parent that SIGKILLs this process knows
what had happened up to that point. Times are time.monotonic() readings (one clock for all
processes on Linux): a RECV's ``origin`` is the start of the receive call that returned the
message (its lease deadline - LEASE), ``returned`` when that call returned; ``ACKING``'s is
when the ack call started, ``ACKED``'s and ``EXPIRED``'s when it ended. A process that kills
itself prints ``KILL t`` first.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Sequence

import mqabstract
from tests.reliability.support import body_for, digest

_trace = None  # the log's "worker" logger when MQ_WORKER_LOG_DIR is set


def out(*words: object) -> None:
    line = " ".join(map(str, words))
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if _trace is not None:  # the same line in the log, among the library's records
        _trace.info("OUT %s", line)


def now() -> str:
    return repr(time.monotonic())


def die() -> None:
    out("KILL", now())
    os.kill(os.getpid(), signal.SIGKILL)


#: (id, attempt) of every message a receive handed to this process's code
handed: set[tuple[str, int]] = set()


class LateDeliveries(mqabstract.Middleware):
    """Prints ``LATE id attempt t`` for each message of a receive call that returned after
    its lease ended: the portable layer hands those to nobody (its ``expired`` settle), yet
    the broker counted each as a delivery, so the history must know of it."""

    def settled(self, sub: object, op: str, messages: Sequence[mqabstract.Message],
                started_ns: int, error: object) -> None:
        if op == "expired":
            for msg in messages:
                if (msg.id, msg.attempt) not in handed:
                    out("LATE", msg.id, msg.attempt, now())


if os.environ.get("MQ_WORKER_LOG_DIR"):  # each worker's log in <dir>/<pid>.log
    # The library at DEBUG, the clients at INFO (at DEBUG kafka-python logs every request:
    # ~10,000 lines a worker in a chaos run; MQ_WORKER_LOG_CLIENTS=debug for those too).
    # Times are epoch seconds; the OUT lines carry the worker's monotonic ones.
    import logging
    logging.basicConfig(filename=os.path.join(os.environ["MQ_WORKER_LOG_DIR"],
                                              f"{os.getpid()}.log"),
                        level=(logging.DEBUG if os.environ.get("MQ_WORKER_LOG_CLIENTS")
                               == "debug" else logging.INFO),
                        format="%(created).3f %(threadName)s %(name)s %(message)s")
    logging.getLogger("mqabstract").setLevel(logging.DEBUG)
    logging.getLogger("pika").setLevel(logging.INFO)
    _trace = logging.getLogger("worker")


def connect(url: str) -> mqabstract.Broker:
    return mqabstract.connect(url, middleware=[LateDeliveries()])


def recv_line(msg: mqabstract.Message, lease: float, returned: float) -> None:
    """``RECV id attempt digest origin deadline returned``: the deadline is fixed at receive
    (now + what is left of the lease), even if this process is frozen before printing."""
    handed.add((msg.id, msg.attempt))
    deadline = time.monotonic() + msg.lease_remaining
    out("RECV", msg.id, msg.attempt, digest(msg.body), repr(deadline - lease), repr(deadline),
        repr(returned))


def consume(url: str, group: str, pattern: str, lease: float, max_attempts: int,
            idle: float, kill: str, seed: int, batch: int = 5, work: float = 0.02) -> None:
    rng = random.Random(seed)
    phase, _, nth = kill.partition(":")
    kill_at = int(nth) if nth else -1
    mq = connect(url)
    sub = mq.subscribe(group, pattern, lease=lease, max_attempts=max_attempts)
    out("READY", os.getpid(), now())
    seen = 0
    last = time.monotonic()
    while True:
        called = time.monotonic()
        out("CALLING", repr(called))
        msgs = sub.receive(max_messages=batch, wait=0.5)
        returned = time.monotonic()
        out("CALL", repr(called), repr(returned), len(msgs))
        if not msgs:
            if time.monotonic() - last > idle:
                break
            continue
        last = time.monotonic()
        for msg in msgs:  # the call handed every one over: all are held from here on
            recv_line(msg, lease, returned)
        for msg in msgs:
            seen += 1
            if msg.headers.get("poison") == "crash":
                die()
            if phase == "recv" and seen == kill_at:
                die()
            time.sleep(rng.random() * work)  # "processing"
            out("ACKING", msg.id, now())
            if phase == "acking" and seen == kill_at:
                die()
            try:
                msg.ack()
            except mqabstract.LeaseExpired:  # frozen past the deadline: it comes back
                out("EXPIRED", msg.id, now())
                continue
            out("ACKED", msg.id, now())
            if phase == "acked" and seen == kill_at:
                die()
    out("DONE", now())
    mq.close()


def dedupe(url: str, group: str, pattern: str, lease: float, store_path: str, kill: str,
           idle: float) -> None:
    from mqabstract.dedupe import DedupeStore, SQLiteStore

    phase, _, nth = kill.partition(":")
    kill_at = int(nth) if nth else -1
    handled = 0
    store: DedupeStore
    if store_path.startswith("postgresql://"):  # PostgresStore: effects in table <schema>.effects
        from mqabstract.dedupe import PostgresStore

        where, _, schema = store_path.partition("#")
        store = PostgresStore(where, schema=schema)
        insert = f"INSERT INTO {schema}.effects VALUES (%s, %s, %s)"
    else:
        store = SQLiteStore(store_path)
        insert = "INSERT INTO effects VALUES (?, ?, ?)"
    mq = connect(url)
    sub = mq.subscribe(group, pattern, lease=lease, max_attempts=50)
    out("READY", os.getpid(), now())

    def handler(msg: mqabstract.Message) -> None:
        nonlocal handled
        handled += 1
        recv_line(msg, lease, time.monotonic())  # (its receive had returned by now)
        # (">=": the Nth message may be a duplicate, whose transaction raises Duplicate
        # before its block; the kill then lands on the next one that is processed. With
        # "==" both planned kills of a run were skipped once, under load, when lapsed leases
        # made duplicates common.)
        with store.transaction(msg) as db:  # type: ignore[attr-defined]
            db.execute(insert, (msg.id, msg.attempt, os.getpid()))
            if phase == "inside" and handled >= kill_at:
                die()  # before the commit: neither the effect nor the id stays
        if phase == "after" and handled >= kill_at:
            out("KILLED", msg.id)
            die()  # the effect and the id are committed; the message is not acked

    stats = sub.consume(handler, idle_timeout=idle, batch=20, wait=0.5)
    out("STATS", stats.received, stats.acked, stats.duplicates)
    mq.close()
    store.close()


def relay(source: str, target: str, batch: int, lease: float, kill: str) -> None:
    import threading

    from mqabstract import outbox

    _, _, nth = kill.partition(":")
    kill_at = int(nth) if nth else -1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with outbox.Relay(source, target, batch=batch, lease=lease, poll_interval=0.05) as r:
        confirm = r.source.confirm
        claims = 0

        def confirm_or_die() -> None:
            nonlocal claims
            claims += 1
            if claims == kill_at:
                out("KILLED", claims)
                die()  # the target has the claim's messages; the source still has them too
            confirm()

        r.source.confirm = confirm_or_die  # type: ignore[method-assign]
        out("READY", os.getpid(), now())
        r.run(stop)
    out("DONE", now())


def hold(url: str, group: str, pattern: str, lease: float, count: int) -> None:
    with connect(url) as mq:
        sub = mq.subscribe(group, pattern, lease=lease, max_attempts=50)
        out("READY", os.getpid(), now())
        while True:
            started = time.monotonic()
            msgs = sub.receive(max_messages=count, wait=1.0)
            returned = time.monotonic()
            out("CALL", repr(started), repr(returned), len(msgs))
            if msgs:
                break
        out("RECVAT", repr(started))
        for msg in msgs:
            recv_line(msg, lease, returned)
        out("HELD", now())
        sys.stdin.readline()
        for msg in msgs:
            out("ACKING", msg.id, now())
            try:
                msg.ack()
            except mqabstract.LeaseExpired:
                out("EXPIRED", msg.id, now())
            else:
                out("ACKED", msg.id, now())
        out("DONE", now())
        sub.close()


def publish(url: str, topic: str, count: int, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    with connect(url) as mq:
        out("READY", os.getpid(), now())
        n = 0
        while n < count:
            size = rng.choice((1, 1, 3, 7))
            ids = [f"{prefix}-{i}" for i in range(n, min(count, n + size))]
            n += len(ids)
            out("TRY", *ids)
            if len(ids) == 1:
                mq.publish(topic, body_for(ids[0]), id=ids[0])
            else:
                mq.publish_batch(
                    [mqabstract.OutgoingMessage(topic, body_for(i), id=i) for i in ids]
                )
            out("PUB", *ids)
        out("DONE")


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "consume":
        consume(args[0], args[1], args[2], float(args[3]), int(args[4]), float(args[5]),
                args[6], int(args[7]), int(args[8]) if len(args) > 8 else 5,
                float(args[9]) if len(args) > 9 else 0.02)
    elif mode == "hold":
        hold(args[0], args[1], args[2], float(args[3]), int(args[4]))
    elif mode == "dedupe":
        dedupe(args[0], args[1], args[2], float(args[3]), args[4], args[5], float(args[6]))
    elif mode == "relay":
        relay(args[0], args[1], int(args[2]), float(args[3]), args[4])
    elif mode == "publish":
        publish(args[0], args[1], int(args[2]), args[3], int(args[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
